"""``--modules``: wrap every torch ``nn.Module`` forward in a range named by its module path.

For programs that emit no NVTX ranges of their own. Uses torch's global module forward hooks,
so it works on any model without knowing its root: the first module called with no module
range open is a root; it and all its submodules get names from ``named_modules()``, prefixed
with ``model`` (``model.layers.3.self_attn``). A module first seen elsewhere is named by its
class. Ranges go through :func:`decodescope.tracer.range` (NVTX push/pop in domain
``decodescope`` + the host stack), so they attribute CUDA-graph kernels too.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from decodescope.tracer.ranges import range as trange

ROOT = "model"
_names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_local = threading.local()
_handles: list[Any] = []


def module_name(module: Any) -> str:
    """The range name of ``module``: its path under the root it was first called from."""
    name = _names.get(module)
    if name is not None:
        return name
    depth = len(getattr(_local, "stack", ()))
    if depth == 0:  # a root: name the whole tree at once
        try:
            for sub, mod in module.named_modules():
                _names.setdefault(mod, f"{ROOT}.{sub}" if sub else ROOT)
        except Exception:
            pass
    name = _names.get(module) or type(module).__name__
    _names.setdefault(module, name)
    return name.replace("/", "|")


def _pre(module: Any, args: Any) -> None:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    r = trange(module_name(module))
    r.__enter__()
    stack.append(r)


def _post(module: Any, args: Any, output: Any) -> None:
    stack = getattr(_local, "stack", None)
    if stack:
        stack.pop().__exit__(None, None, None)


def instrument() -> None:
    """Install the global hooks (idempotent)."""
    if _handles:
        return
    from torch.nn.modules import module as m

    _handles.append(m.register_module_forward_pre_hook(_pre))
    try:
        _handles.append(m.register_module_forward_hook(_post, always_call=True))
    except TypeError:  # older torch: no always_call
        _handles.append(m.register_module_forward_hook(_post))


def uninstrument() -> None:
    while _handles:
        _handles.pop().remove()
