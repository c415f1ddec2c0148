# Fails unless README contains the file SNIPPET verbatim (so the README's example is the tested one).
file(READ ${README} readme)
file(READ ${SNIPPET} snippet)
string(FIND "${readme}" "${snippet}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "README.md does not contain ${SNIPPET} verbatim; copy the file into the README's example block")
endif()
