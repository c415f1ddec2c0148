"""softkv: a soft-retrieval key-value store (attention as a database), from Python.

A query is scored against stored keys, s_i = scale * q . k_i; soft retrieval answers with the
softmax-weighted blend of the values, hard retrieval with the value of the best key.

- ``softkv.Collection(dim, value_dim, ...)``: an in-process collection (the C++ library, native).
- ``softkv.Database(path)``: named collections kept by a write-ahead log and snapshots;
  ``db.collection(name)`` returns a ``CollectionView`` for queries.
- ``softkv.Client(host, port)``: the pure-Python TCP client of softkv-server.

All three answer with the same classes (``SoftResult``, ``HardResult``, ``SoftBatchResult``,
``HardBatchResult``, holding numpy arrays) and raise the same errors (``softkv.Error`` and one
subclass per error code, e.g. ``softkv.DimensionMismatch``).

Inputs: float32 C-contiguous arrays are read in place (no copy); any other real dtype
(float64, ints, bools, byte-swapped), order (Fortran, strided) or a list is converted to
float32 C order once per call. Wrong shapes raise ``softkv.DimensionMismatch``. Outputs are new
numpy arrays owned by Python. The GIL is released while queries, writes, snapshots and index
builds run, so Python threads query in parallel.
"""

from ._errors import *  # noqa: F401,F403 - Error and its subclasses
from ._errors import __all__ as _error_names
from ._results import Contributors, HardBatchResult, HardResult, SoftBatchResult, SoftResult
try:
    from ._softkv import (Collection, CollectionView, Database, __version__, available_simd_paths, check_config,
                          force_simd_path, force_tile_products, simd_path, tile_products)
except ImportError as e:  # the pure-Python files without the native module beside them
    raise ImportError(f"softkv's native module is missing or does not load ({e}); build it with CMake (target "
                      "softkv_python, on by default) and use PYTHONPATH=<build>/python, or cmake --install") from e
from .client import Client

__all__ = ["Collection", "CollectionView", "Database", "Client", "Contributors", "SoftResult", "HardResult",
           "SoftBatchResult", "HardBatchResult", "simd_path", "available_simd_paths", "force_simd_path", "check_config",
           "tile_products", "force_tile_products", "__version__", *_error_names]
