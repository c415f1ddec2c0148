# Fails when a Catch2 test name cannot be a ctest entry: ctest cuts names at ';', and Catch2 reads
# a backslash in a test spec as an escape, so such a case would be registered under a name that
# selects nothing. Run as
#   cmake -DTESTS=<softkv_tests> -P check_test_names.cmake
execute_process(COMMAND ${TESTS} --list-test-names-only OUTPUT_VARIABLE names RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 AND NOT rc GREATER 0)
  message(FATAL_ERROR "could not list the test names of ${TESTS}")
endif()
string(REPLACE ";" "<SEMICOLON>" names "${names}")
string(REPLACE "\n" ";" lines "${names}")
set(bad "")
foreach(line IN LISTS lines)
  if(line MATCHES "<SEMICOLON>" OR line MATCHES "^ " OR line MATCHES " $" OR line MATCHES "[\\\\]")
    list(APPEND bad "${line}")
  endif()
endforeach()
if(bad)
  string(REPLACE ";" "\n  " bad "${bad}")
  message(FATAL_ERROR "test names ctest cannot select (';', a backslash, or a leading/trailing space):\n  ${bad}")
endif()
