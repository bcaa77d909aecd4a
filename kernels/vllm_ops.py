"""vLLM's compiled ops: through ``vllm._custom_ops`` when vllm is installed, else from the op
libraries in ``$VLLM_OPS_DIR`` (vllm 0.24.0's ``_C_stable_libtorch.abi3.so`` and
``_moe_C_stable_libtorch.abi3.so``, loaded with ``torch.ops.load_library``).

Nothing here is trusted blindly: :func:`op` returns the op or ``None``, and the standard path
probes each op on small random inputs against its own implementation before it uses it (a
signature or semantics mismatch falls back and is recorded, never crashes a run). The argument
orders below are those of vLLM's ``csrc/libtorch_stable`` and ``csrc/moe`` torch bindings:

- ``_C.rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon)``
- ``_C.fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon)``
- ``_C.dsv3_fused_a_gemm(Tensor! output, Tensor mat_a, Tensor mat_b)`` (bf16, 1-16 tokens,
  7168 -> 2112; ``mat_b`` is the weight's transpose, column-major)
- ``_C_cache_ops.concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor! kv_cache,
  Tensor slot_mapping, str kv_cache_dtype, Tensor scale)``
- ``_moe_C.grouped_topk(Tensor scores, int n_group, int topk_group, int topk, bool renormalize,
  float routed_scaling_factor, Tensor bias, int scoring_func) -> (Tensor, Tensor)``
  (scoring_func 1 = sigmoid, values float32)
- ``_moe_C.moe_align_block_size(Tensor topk_ids, int num_experts, int block_size,
  Tensor! sorted_token_ids, Tensor! experts_ids, Tensor! num_tokens_post_pad,
  Tensor? maybe_expert_map)``
- ``_moe_C.moe_sum(Tensor input, Tensor! output, Tensor? topk_ids=None, Tensor? expert_map=None)``
"""

from __future__ import annotations

import glob
import os
from typing import Any

import torch

LIBS = ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so")
_state: dict[str, Any] = {"loaded": None, "errors": []}


def load() -> str | None:
    """Make vLLM's ops visible under ``torch.ops``; return how ("vllm" | "dir:<path>") or None."""
    if _state["loaded"] is not None:
        return _state["loaded"] or None
    how = ""
    try:
        import vllm._custom_ops  # noqa: F401  (registers torch.ops._C / _moe_C)

        how = "vllm"
    except Exception as e:  # not installed, or installed for another stack
        _state["errors"].append(f"import vllm._custom_ops: {type(e).__name__}: {e}")
    if not how and torch.cuda.is_available():
        d = os.environ.get("VLLM_OPS_DIR", "")
        if d:
            ok = 0
            for name in LIBS:
                paths = glob.glob(os.path.join(d, "**", name), recursive=True)
                if not paths:
                    _state["errors"].append(f"{name} not under {d}")
                    continue
                try:
                    torch.ops.load_library(paths[0])
                    ok += 1
                except Exception as e:
                    _state["errors"].append(f"load {paths[0]}: {type(e).__name__}: {e}")
            if ok:
                how = f"dir:{d}"
    _state["loaded"] = how
    return how or None


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def missing() -> str | None:
    """Why vLLM's compiled ops cannot be there, found without loading anything (None: a source
    exists: vllm is importable, or ``$VLLM_OPS_DIR`` holds both libraries). A source that exists
    can still fail to load; :func:`load` then records why."""
    if vllm_installed():
        return None
    d = os.environ.get("VLLM_OPS_DIR", "")
    if not d:
        return "vllm is not installed and VLLM_OPS_DIR is not set"
    lacking = [n for n in LIBS if not glob.glob(os.path.join(d, "**", n), recursive=True)]
    if lacking:
        return f"VLLM_OPS_DIR={d} lacks {', '.join(lacking)}"
    return None


def errors() -> list[str]:
    return list(_state["errors"])


def op(qualified: str):
    """``op("_moe_C.grouped_topk")`` -> the op packet, or None where it is not there."""
    if not load():
        return None
    ns, name = qualified.split(".", 1)
    try:
        return getattr(getattr(torch.ops, ns), name)
    except (AttributeError, RuntimeError):
        return None


def first(*qualified: str):
    """The first of several qualified names that exists: ``(name, op)`` or ``(None, None)``."""
    for q in qualified:
        f = op(q)
        if f is not None:
            return q, f
    return None, None
