"""Compile cache and TVM-FFI calling, shared by every specialized CuTe DSL kernel.

How a kernel file uses it (see ``norm_qkv_proj.py`` for a full example)::

    from decodescope.kernels.specialized import interface as itf

    def _compile(shape facts...):
        op = MyKernel(facts...)                       # compile-time facts in __init__
        args = (itf.fake(torch.bfloat16, (m, k)), ..., itf.env_stream())
        return op, args

    def my_op(x, w, out):                             # thin torch-facing function
        key = ("my_op", x.dtype, tuple(x.shape), ...)  # exactly what changes the code
        fn = itf.compiled(key, lambda: _compile(...))
        fn(x, w, out)                                  # torch tensors straight in, no conversion

Rules this module enforces:

- every kernel is compiled once per key with ``--enable-tvm-ffi``; the compiled callable takes
  torch tensors (and Python ints / floats for scalar parameters) directly, with no per-call
  ``from_dlpack``;
- the stream parameter is the TVM-FFI *environment stream*: it is dropped from the compiled
  signature and TVM-FFI fills it, on every call, with torch's current stream of the arguments'
  device (torch's DLPack exchange API). Launches therefore follow ``torch.cuda.stream(...)`` and
  ``torch.cuda.graph(...)`` capture without any stream argument;
- shapes are static per compile (fake tensors with integer shapes): the key must carry them;
- compilation works without a GPU: with ``CUTE_DSL_ARCH=sm_90a`` set (``ensure_arch`` sets it on
  a machine without CUDA), ``compile_only`` builds the same code the H200 runs, which is what the
  CPU tests do.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

_DEFAULT_ARCH = "sm_90a"
_LOCK = threading.Lock()
_CACHE: dict[tuple, Any] = {}


def ensure_arch() -> None:
    """Set ``CUTE_DSL_ARCH`` to sm_90a when nothing set it (needed to compile without a GPU).

    Must run before ``cutlass`` is imported for the first time; kernel modules call it at import.
    """
    os.environ.setdefault("CUTE_DSL_ARCH", _DEFAULT_ARCH)


ensure_arch()

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402
from cutlass.cute.runtime import (  # noqa: E402
    make_fake_compact_tensor,
    make_fake_stream,
    make_fake_tensor,
)

TORCH_TO_CUTE = {
    torch.bfloat16: cutlass.BFloat16,
    torch.float16: cutlass.Float16,
    torch.float32: cutlass.Float32,
    torch.int32: cutlass.Int32,
    torch.int64: cutlass.Int64,
    torch.uint8: cutlass.Uint8,
    torch.float8_e4m3fn: cutlass.Float8E4M3FN,
}


def cute_dtype(dtype: torch.dtype) -> type:
    """The CuTe DSL numeric type of a torch dtype."""
    try:
        return TORCH_TO_CUTE[dtype]
    except KeyError:
        raise TypeError(f"no CuTe DSL type for torch dtype {dtype}") from None


_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}


def placeholder(device, shape: Sequence[int] = (16, 16), dtype: torch.dtype = torch.bfloat16):
    """A small zero tensor (cached per device, shape and dtype) passed for a kernel argument the
    compiled plan does not read (an absent segment, residual or norm weight)."""
    key = (str(device), tuple(shape), dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.zeros(tuple(shape), dtype=dtype, device=device)
    return t


def fake(dtype: torch.dtype | type, shape: Sequence[int], align: int = 16) -> Any:
    """A fake row-major (last mode contiguous) global tensor with a static shape, for compiling.

    ``dtype`` is a torch dtype or a cutlass numeric type; ``align`` the base-pointer alignment in
    bytes the kernel may assume (16 lets it use 16-byte vector loads; callers check it).
    """
    ct = cute_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype
    shape = tuple(int(s) for s in shape)
    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(ct, shape, stride_order=order, assumed_align=align)


def fake_strided(
    dtype: torch.dtype | type, shape: Sequence[int], stride: Sequence[int], align: int = 16
) -> Any:
    """A fake global tensor with a static shape and explicit static strides (in elements)."""
    ct = cute_dtype(dtype) if isinstance(dtype, torch.dtype) else dtype
    return make_fake_tensor(
        ct, tuple(int(s) for s in shape), tuple(int(s) for s in stride), assumed_align=align
    )


def env_stream() -> Any:
    """The stream placeholder: TVM-FFI fills it with torch's current stream at each call."""
    return make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_only(op: Callable, *args: Any) -> Any:
    """Compile ``op`` (a ``@cute.jit`` callable) with TVM-FFI calling; no cache, no GPU needed."""
    return cute.compile(op, *args, options="--enable-tvm-ffi")


def ptx_text(op: Callable, *args: Any) -> str:
    """The PTX of ``op`` compiled for the target arch as :func:`compile_only` compiles it (a
    temporary dump folder, removed after), for tests that check what the code generator
    emitted (which loads precede ``griddepcontrol.wait``, ...)."""
    import glob
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="decodescope_ptx_")
    try:
        cute.compile(op, *args, options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")
        (path,) = glob.glob(f"{d}/**/*.ptx", recursive=True)
        with open(path) as f:
            return f.read()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def compiled(key: tuple, build: Callable[[], tuple[Callable, Sequence[Any]]]) -> Any:
    """The compiled kernel for ``key``; ``build()`` returns ``(jit_callable, fake_args)``.

    Compiles on the first call for a key (thread-safe), then returns the cached callable.
    Never call this inside CUDA-graph capture for a new key: compile in warm-up.
    """
    from decodescope.kernels.specialized.utils import sigmoid_mode

    # the sigmoid's mode is an input of the trace (``auto`` follows the step's token count)
    key = (*key, ("sigmoid", sigmoid_mode()))
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            op, args = build()
            fn = compile_only(op, *args)
            _CACHE[key] = fn
    return fn


def cache_size() -> int:
    """How many kernels are compiled in this process."""
    return len(_CACHE)


def check(t: torch.Tensor, name: str, shape: Sequence[int], dtype: torch.dtype) -> None:
    """Raise ValueError unless ``t`` is a contiguous, 16-byte-aligned tensor of that shape/dtype."""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if t.data_ptr() % 16:
        raise ValueError(f"{name}: base pointer must be 16-byte aligned")


def key_of(*tensors: torch.Tensor) -> tuple:
    """(dtype, shape) of each tensor: the usual part of a compile key."""
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)
