"""Specialized decode path: fused CuTe DSL kernels for Hopper (sm_90a).

One kernel per file, each a class (compile-time facts in ``__init__``, a ``@cute.jit``
``__call__`` host side, a ``@cute.kernel`` device side), a thin torch-facing function that
compiles once per key through :mod:`.interface` and calls through TVM-FFI on torch's current
stream, and a ``*_ref`` torch reference beside it.

Importing this package does not import cutlass; import the kernel modules you need.
"""
