"""softkv's typed errors: softkv.Error and one subclass per ErrorCode, shared by the module and the client.

The codes and names are those of the C++ softkv::ErrorCode (stable: they also travel in wire error
frames). The native module raises these classes; the TCP client raises the same ones for error frames.
"""

from __future__ import annotations


class Error(Exception):
    """A softkv error: ``code`` (int, softkv::ErrorCode), ``name`` (e.g. 'non_finite') and ``message``."""

    code = 0
    name = "error"

    def __init__(self, code: int, message: str):
        self.code = code
        self.name = ERROR_NAMES.get(code, f"error_{code}")
        self.message = message
        super().__init__(code, message)

    def __str__(self) -> str:  # KeyError's quoting of its argument would otherwise show through
        # Messages from softkv (the library's what(), the server's error frames) already start with
        # "<name>: "; the prefix is added only to one that does not.
        prefix = f"{self.name}: "
        return self.message if self.message.startswith(prefix) else prefix + self.message


def _error_class(code: int, name: str, doc: str, *bases: type) -> type:
    camel = "".join(part.capitalize() for part in name.split("_"))
    return type(camel, (Error, *bases), {"__doc__": doc, "code": code, "name": name, "__module__": "softkv"})


# (code, name, extra builtin base, meaning); the C++ enum is checked against this table by the tests.
_TABLE = [
    (1, "dimension_mismatch", ValueError, "A vector's or array's shape differs from the collection's d or dv."),
    (2, "empty_collection", (), "A query on a collection with no entries."),
    (3, "non_finite", ValueError, "A NaN or infinity in an input vector or parameter."),
    (4, "unknown_id", KeyError, "No entry has this id."),
    (5, "invalid_argument", ValueError, "A parameter out of range (T <= 0, bad scale, unknown metric, ...)."),
    (6, "unknown_collection", KeyError, "No collection has this name."),
    (7, "collection_exists", (), "A collection with this name already exists."),
    (8, "corrupt_file", (), "A snapshot or log failed a size or checksum check."),
    (9, "io_error", (), "The operating system refused a file or socket operation."),
    (10, "frame_too_large", (), "A wire frame longer than the configured limit."),
    (11, "protocol_error", (), "A malformed frame or an unknown opcode."),
    (12, "unsupported", (), "A feature not available on this build or CPU."),
    (13, "numeric_overflow", (), "Scores left the float range (lower the scale)."),
    (14, "unauthenticated", (), "The server requires an auth token first, or the token was wrong."),
    (15, "server_busy", (), "The server is at its connection limit or shutting down."),
    (16, "resource_exhausted", (), "A request needs more memory (or another resource) than is available."),
    (17, "internal", (), "A broken internal invariant (a bug in softkv: please report it)."),
]

ERROR_NAMES = {code: name for code, name, _, _ in _TABLE}
ERROR_CLASSES = {
    code: _error_class(code, name, doc, *(base if isinstance(base, tuple) else (base,)))
    for code, name, base, doc in _TABLE
}
globals().update({cls.__name__: cls for cls in ERROR_CLASSES.values()})


def make_error(code: int, message: str) -> Error:
    """The exception for an error code: its subclass, or softkv.Error itself for a code this version lacks."""
    return ERROR_CLASSES.get(code, Error)(code, message)


__all__ = ["Error", "ERROR_NAMES", "ERROR_CLASSES", "make_error", *(cls.__name__ for cls in ERROR_CLASSES.values())]
