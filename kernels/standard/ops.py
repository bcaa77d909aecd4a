"""The standard path's ops, each with the implementations it can run, best first.

For every op the first implementation that is there *and* passes a probe wins: vLLM's compiled
kernel (``vllm:<ns>.<op>``), then a Triton kernel of ours (``triton:decodescope``), then plain
torch (``torch``: what a CPU runs; the same math). A probe runs the candidate once on random
inputs of the real shapes and compares it with the torch implementation; a candidate that
raises (a signature mismatch) or disagrees is skipped, and why is kept in ``Ops.rejected``.
``Ops.impl`` maps each op to the implementation that ran: it goes into the run's config_json.

All implementations write into the caller's preallocated buffers (CUDA-graph safe: fixed
shapes, no host syncs) except where noted.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from decodescope.kernels import vllm_ops

TORCH = "torch"
TRITON = "triton:decodescope"

try:  # Triton is there on the H200, not on a CPU-only machine
    from decodescope.kernels.standard import triton_kernels as tk
except Exception:  # pragma: no cover - depends on the machine
    tk = None


def triton_usable(device: torch.device) -> bool:
    if tk is None:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"  # CPU tests of the kernels


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 2e-2) -> bool:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return False
    return float((a - b).norm() / b.norm().clamp_min(1e-30)) < tol


# -- torch implementations (the math every other implementation must match) -----------------


def rmsnorm_torch(x, w, eps, y, r_in=None, r_out=None):
    xf = x.float()
    if r_in is not None:
        xf = xf + r_in.float()
        r_out.copy_(xf)
    y.copy_(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float())


def act_and_mul_torch(x, y, situ: bool, beta: float = 4.0, lbeta: float = 25.0):
    inter = y.shape[-1]
    g, u = x[..., :inter].float(), x[..., inter : 2 * inter].float()
    if situ:
        y.copy_(beta * torch.tanh(g / beta) * torch.sigmoid(g) * (lbeta * torch.tanh(u / lbeta)))
    else:
        y.copy_(torch.nn.functional.silu(g) * u)


def gate_mul_torch(o_hnv, g, y):
    H, N, V = o_hnv.shape
    y.view(N, H, V).copy_(o_hnv.transpose(0, 1).float() * torch.sigmoid(g.view(N, H, V).float()))


def routing_torch(logits, bias, ids, weights, top_k, renorm, scale):
    s = torch.sigmoid(logits.float())
    top = torch.topk(s + bias.float(), top_k, dim=-1)
    w = s.gather(1, top.indices)
    if renorm:
        w = w / w.sum(-1, keepdim=True)
    ids.copy_(top.indices)
    weights.copy_(w * scale)


def moe_align_torch(topk_ids, num_experts, block_m, sorted_ids, expert_ids, ntp):
    """Graph-safe moe_align_block_size: fixed shapes, no host sync.

    Rows (token*k + j) grouped by expert in ascending order, each expert's group padded to a
    multiple of ``block_m`` with the value ``numel``; ``expert_ids[b]`` is block b's expert."""
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat * numel + torch.arange(numel, device=dev))  # stable by expert
    sorted_e = flat[order]
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(numel, device=dev) - first[sorted_e]
    dest = starts[sorted_e] + rank
    sorted_ids.fill_(numel)
    sorted_ids.scatter_(0, dest, order.to(sorted_ids.dtype))
    blocks = torch.arange(expert_ids.numel(), device=dev) * block_m
    e = torch.searchsorted(ends, blocks, right=True).clamp_max(num_experts - 1)
    expert_ids.copy_(e.to(expert_ids.dtype))
    ntp.copy_(ends[-1:].to(ntp.dtype))


def fused_moe_torch(a, w, c, topk_w, sorted_ids, expert_ids, ntp, num_valid, a_div, mul_w,
                    m_blocks, block_m=16):  # fmt: skip
    """The fused-MoE GEMM over the padded blocks, row by row (CPU; same indexing as Triton)."""
    rows = sorted_ids[: m_blocks * block_m].long()
    r = torch.arange(rows.numel(), device=rows.device)
    valid = (rows < num_valid) & (r < ntp.long())
    tok = torch.where(valid, rows, torch.zeros_like(rows))
    e = expert_ids[:m_blocks].long().repeat_interleave(block_m)
    y = torch.einsum("rk,rnk->rn", a[tok // a_div].float(), w[e].float())
    if mul_w:
        y = y * topk_w.reshape(-1)[tok].float().unsqueeze(-1)
    dst = torch.where(valid, rows, torch.full_like(rows, num_valid))
    ext = torch.zeros(num_valid + 1, c.shape[1], dtype=torch.float32, device=c.device)
    ext.index_copy_(0, dst, y)
    c.copy_(ext[:num_valid])


def kda_torch(proj, f, conv_w, conv_state, A_log, dt_bias, state, o_norm, out, *, T, D, b_off,
              lower_bound, eps):  # fmt: skip
    """Conv update + SiLU + gate + gated delta rule + gated RMSNorm (same math as the kernel)."""
    B, H, HD, _ = state.shape
    qkv = proj[:, : 3 * D].float().view(B, T, 3 * D)
    window = torch.cat([conv_state.float(), qkv.transpose(1, 2)], dim=2)
    K = conv_w.shape[1]
    cw = conv_w.float()
    conv = torch.stack([(window[:, :, t : t + K] * cw).sum(-1) for t in range(T)], dim=1)
    conv = torch.nn.functional.silu(conv)
    conv_state.copy_(window[:, :, T:])
    q, k, v = conv.split(D, dim=-1)
    fa = f.float() + dt_bias.float()
    a = torch.exp(A_log.float()).repeat_interleave(HD)
    gk = (lower_bound * torch.sigmoid(a * fa)).view(B, T, H, HD)
    beta = torch.sigmoid(proj[:, b_off : b_off + H].float()).view(B, T, H)
    q = q.reshape(B, T, H, HD)
    k = k.reshape(B, T, H, HD)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-12) / math.sqrt(HD)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-12)
    v = v.reshape(B, T, H, HD)
    S = state
    g = proj[:, 3 * D : 4 * D].float().view(B, T, H, HD)
    for t in range(T):
        S.mul_(torch.exp(gk[:, t]).unsqueeze(-1))
        kv = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        u = beta[:, t].unsqueeze(-1) * (v[:, t] - kv)
        S.add_(k[:, t].unsqueeze(-1) * u.unsqueeze(-2))
        o = torch.einsum("bhk,bhkv->bhv", q[:, t], S)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * o_norm.float()
        o = o * torch.sigmoid(g[:, t])
        out.view(B, T, H * HD)[:, t].copy_(o.reshape(B, H * HD))


def mla_decode_torch(q_lat, q_pe, cache, out_hnl, *, T, ctx, sm_scale):
    N, H, DL = q_lat.shape
    B = N // T
    kv = cache[:, : ctx + T].float()  # [B, S, 576]
    q = torch.cat([q_lat.float(), q_pe.float()], -1).view(B, T, H, -1)
    s = torch.einsum("bthl,bsl->bths", q, kv) * sm_scale
    pos = torch.arange(ctx + T, device=s.device)
    allowed = pos[None, :] <= (ctx + torch.arange(T, device=s.device))[:, None]  # [T, S]
    s = s.masked_fill(~allowed[None, :, None, :], float("-inf"))
    o = torch.einsum("bths,bsl->bthl", torch.softmax(s, -1), kv[..., :DL])
    out_hnl.copy_(o.reshape(N, H, DL).transpose(0, 1))


def cache_insert_torch(kv, pe, cache, T, ctx):
    B = cache.shape[0]
    rows = torch.cat([kv, pe], -1).view(B, T, -1)
    cache[:, ctx : ctx + T].copy_(rows.to(cache.dtype))


# -- selection --------------------------------------------------------------------------------


class Ops:
    """Chooses and records an implementation per op for one device (see the module doc)."""

    def __init__(self, device: torch.device | str, use_vllm: bool | str = True, use_triton=None):
        self.device = torch.device(device)
        self.triton = triton_usable(self.device) if use_triton is None else bool(use_triton)
        # use_vllm="force": skip the device check (tests that stand fakes in for vLLM's ops)
        on_gpu = self.device.type == "cuda" or use_vllm == "force"
        self.vllm = bool(use_vllm) and on_gpu and vllm_ops.load() is not None
        self.impl: dict[str, str] = {}
        self.rejected: dict[str, str] = {}
        self._probe_cache: dict[tuple, bool] = {}
        self.flags: dict[tuple, bool] = {}  # facts a probe found (e.g. who pads moe_align)

    def choose(self, op: str, candidates: list[tuple[str, Callable[[], bool] | None]]) -> str:
        """First candidate whose probe passes (``None`` probe: always). Records the choice."""
        for name, probe in candidates:
            if name.startswith("vllm:") and not self.vllm:
                continue
            if name == TRITON and not self.triton:
                continue
            if probe is None:
                ok, why = True, ""
            else:
                try:
                    ok, why = bool(probe()), "disagrees with the torch implementation"
                except Exception as e:  # a signature or dtype mismatch: fall back
                    ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            if ok:
                prev = self.impl.get(op)
                if prev is not None and prev != name:
                    name_all = sorted({prev, name})
                    self.impl[op] = " | ".join(name_all)  # differs between layers or shapes
                else:
                    self.impl[op] = name
                return name
            self.rejected[f"{op}:{name}"] = why
        raise RuntimeError(f"no implementation of {op} works here")

    def probed(self, key: tuple, fn: Callable[[], bool]) -> Callable[[], bool]:
        def run() -> bool:
            if key not in self._probe_cache:
                self._probe_cache[key] = fn()
            return self._probe_cache[key]

        return run

    def vllm_op(self, *qualified: str):
        return vllm_ops.first(*qualified)[1] if self.vllm else None


def vllm_name(ops: Ops, *qualified: str) -> str:
    q, _ = vllm_ops.first(*qualified) if ops.vllm else (None, None)
    return f"vllm:{q}" if q else f"vllm:{qualified[0]}"


def randn_like_shape(shape, dtype, device, scale=1.0):
    return (torch.randn(shape, device=device) * scale).to(dtype)


def close(a, b, tol=2e-2) -> bool:
    return _close(a, b, tol)
