"""Specialized decode path: fused CuTe DSL kernels for Hopper (sm_90a).

One kernel per file, each a class (compile-time facts in ``__init__``, a ``@cute.jit``
``__call__`` host side, a ``@cute.kernel`` device side), a thin torch-facing function that
compiles once per key through :mod:`.interface` and calls through TVM-FFI on torch's current
stream, and a ``*_ref`` torch reference beside it.

Importing this package does not import cutlass (it only sets ``CUTE_DSL_ARCH`` to sm_90a where
unset); import the kernel modules you need.
"""

import os

# Compile for Hopper when no GPU tells CuTe DSL the arch (CI, CPU machines). Set here, in the
# package, so that it precedes the first ``import cutlass`` of any kernel module.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
