"""Specialized attention halves (KDA, gated MLA) on the H200: every check, then a timing table.

    python scripts/gpu_specialized_attn.py --out $OUT/attn [--tp 8 16]
        [--kinds kda mla mla-fp8] [--points 1x1 8x1 32x1 64x1 1x8 8x8] [--copies 0]
        [--replays 30] [--no-timing] [--no-standard] [--tiny] [--no-sweep | --sweep-only]
        [--sweep-ms 1 8 32 64]

A point ``BxT`` is B sequences of T tokens (1x8: one sequence verifying 7 drafts). Per (TP
shape, kind, point), with fresh random inputs and outputs poisoned with NaN before each launch:

- each kernel vs its torch reference (same rounding points, FP32 math): the fused residual +
  RMSNorm + input projection(s), q_b with its q_a norm prologue, o_proj + residual -- each
  GEMM with both kernels, ``[skinny]`` (the small-M kernel) and ``[splitk]`` (activations in
  shared memory, K split across CTAs: :mod:`.splitk_gemm`); KDA decode (output, recurrent and
  conv state); MLA decode (output, the new cache rows) with ``[tc ...]`` (tensor cores,
  :mod:`.mla_decode_tc`, BF16 cache) and ``[simt ...]`` (the old kernel); RMSNorm;
- with timing on, each MLA kernel alone, and at 8x1 / 64x1 / 1x8 / 8x8 the tc kernel with
  other head groups and splits (``MLA_SWEEP``);
- the whole attention half vs the chained references, vs the float32 evaluation of the layer's
  reference math (``decodescope.kernels.reference``), and vs the standard path's attention half
  (``StandardLayer``: residual norm, its attention ops, the post-attention residual norm);
- timing: CUDA-graph replay medians per kernel and per attention half, weights and state rotated
  over ``--copies`` independent layers (0: enough to pass 3x the L2), for the new default
  kernels, for the old ones (``[old kernels]``: skinny GEMM everywhere, simt MLA), and for the
  defaults with the split-K partial-sum reduction (``[partial kernels]``), every projection by
  the tiled GEMM (``[tile kernels]``, :mod:`.tile_gemm`); below 8 tokens also
  ``[splitk-all kernels]``, the standard path's attention half beside it, the bytes
  floor at the copy bandwidth measured in this process; at 1x1 and 64x1 also with programmatic
  dependent launch off;
- then (first TP only) a sweep of the GEMMs on the in_proj and o_proj shapes at M = 1, 8, 32,
  64: skinny rt 1/2/4, split-K with its own and two other split counts, each checked, the split
  norm path and cuBLAS beside.

Kernel choice is by environment, read at each launch: ``DECODESCOPE_SPLITK_GEMM`` (0 never, 1
wherever K allows, unset from 8 tokens on at K >= 4096), ``DECODESCOPE_SPLITK_REDUCE``
(atomic / partial), ``DECODESCOPE_MLA_KERNEL`` (tc / simt), ``DECODESCOPE_MLA_HEADS_PER_CTA``,
``DECODESCOPE_NO_PDL``, ``DECODESCOPE_ATTN_GEMM`` (default / tile / auto),
``DECODESCOPE_SKINNY_LOAD`` (regs / ring: the skinny GEMM's weight loads at M <= 16). Up to 16
tokens the skinny GEMMs are also checked as ``[skinny-ring]``, timed as the ``[ring kernels]``
(the defaults, ring: reaches the skinny GEMMs the defaults still use), ``[skinny kernels]``
(the skinny GEMM for every projection, registers), ``[skinny-ring kernels]`` (the same, ring)
and ``[skinny-auto kernels]`` (the same, the ring for K 7168 only) variants, and swept as ``rt1/ks8 ring s4`` (stages 2, 4, 8; ``rounds``:
the runtime-round form) and ``rt2/ks8 ring s4``.

One failing piece is recorded and the run goes on; ``results.json`` is rewritten after every
point (a run cut short keeps what it measured). Writes ``results.json`` and ``table.md`` under
``--out``; prints the table last. Split runs by ``--kinds`` (and ``--sweep-only`` /
``--no-sweep``) to stay within 10 minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from decodescope.kernels import reference as R
from decodescope.kernels.bandwidth import copy_bandwidth_tbs
from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.specialized import gemv_stream as gs
from decodescope.kernels.specialized import kda_decode as kda
from decodescope.kernels.specialized import mla_decode as mla
from decodescope.kernels.specialized import mla_decode_tc as mtc
from decodescope.kernels.specialized import norm_qkv_proj as nqp
from decodescope.kernels.specialized import oproj_residual_norm as op
from decodescope.kernels.specialized import rmsnorm as rms
from decodescope.kernels.specialized import skinny_gemm as sg
from decodescope.kernels.specialized import splitk_gemm as sk
from decodescope.kernels.specialized import tile_gemm as tg
from decodescope.kernels.specialized.attention_layers import SpecializedAttention, attention_ref
from decodescope.kernels.timing import graph_time_us
from decodescope.kernels.weights import make_layer_weights, make_state

DEV = torch.device("cuda")
BF16 = torch.bfloat16
F32 = torch.float32
L2_BYTES = 50 * 2**20
RESULTS: list[dict] = []
ATTN_KEYS = {
    "kda": ("attn_norm", "mlp_norm", "in_proj", "conv_w", "f_b", "A_log", "dt_bias", "o_norm",
            "o_proj"),
    "mla": ("attn_norm", "mlp_norm", "qkv_a", "g_proj", "q_a_norm", "kv_a_norm", "q_b", "w_uk",
            "w_uv", "o_proj"),
}  # fmt: skip
TOL = {"out": 2e-2, "state": 2e-3}
PDL_AB_POINTS = ("1x1", "64x1")
# kernel variants of the attention half (environment read at each launch, so a graph captures
# the variant that was set while it was captured): the new defaults, and the kernels as of
# commit 8394aa2 (small-M skinny GEMM everywhere, the SIMT MLA decode)
VARIANTS = {  # old first (see check_kernels)
    "old": {"DECODESCOPE_SPLITK_GEMM": "0", "DECODESCOPE_MLA_KERNEL": "simt",
            "DECODESCOPE_ATTN_GEMM": "default", "DECODESCOPE_SKINNY_GEMV": "0"},
    "new": {},
    # the defaults with the split-K partial-sum reduction instead of FP32 atomics
    "partial": {"DECODESCOPE_SPLITK_REDUCE": "partial", "DECODESCOPE_ATTN_GEMM": "default"},
    # every projection by the tiled cp.async GEMM (tile_gemm.py, issue #5)
    "tile": {"DECODESCOPE_ATTN_GEMM": "tile"},
}  # fmt: skip
MLA_SWEEP = {  # (heads per CTA, splits; 0 = the plan's) of the tc kernel, timed alone
    "8x1": [(2, 0), (1, 4)],
    "64x1": [(3, 0), (12, 0), (6, 2)],
    "1x8": [(1, 4), (1, 16)],
    "8x8": [(2, 0), (1, 4)],
}
RING = {"DECODESCOPE_SKINNY_LOAD": "ring"}  # the skinny GEMM's cp.async-ring weight stream
GEMM_KINDS = {
    "skinny": {"DECODESCOPE_SPLITK_GEMM": "0", "DECODESCOPE_ATTN_GEMM": "default",
               "DECODESCOPE_SKINNY_LOAD": "regs"},
    "skinny-ring": {"DECODESCOPE_SPLITK_GEMM": "0", "DECODESCOPE_ATTN_GEMM": "default", **RING},
    "splitk": {"DECODESCOPE_SPLITK_GEMM": "1", "DECODESCOPE_ATTN_GEMM": "default"},
    "splitk-partial": {"DECODESCOPE_SPLITK_GEMM": "1", "DECODESCOPE_SPLITK_REDUCE": "partial",
                       "DECODESCOPE_ATTN_GEMM": "default"},
    "tile": {"DECODESCOPE_ATTN_GEMM": "tile"},  # norm launch + tiled cp.async GEMM
    # the streaming GEMV (gemv_stream.py) up to 4 tokens, its knobs from DECODESCOPE_GEMV_CFG
    "gemv": {"DECODESCOPE_SPLITK_GEMM": "0", "DECODESCOPE_ATTN_GEMM": "default",
             "DECODESCOPE_SKINNY_GEMV": "4"},
    # the skinny kernel (registers) with the whole-slice L2 prefetch of o_proj / q_b
    "skinny-l2pf": {"DECODESCOPE_SPLITK_GEMM": "0", "DECODESCOPE_ATTN_GEMM": "default",
                    "DECODESCOPE_SKINNY_LOAD": "regs", "DECODESCOPE_L2_PREFETCH": "1"},
}  # fmt: skip
GEMV = {"DECODESCOPE_SKINNY_GEMV": "4"}
L2PF = {"DECODESCOPE_L2_PREFETCH": "1"}
TIMING = {"on": False, "replays": 30}


def record(**kw) -> dict:
    RESULTS.append(kw)
    print(" ".join(f"{k}={v}" for k, v in kw.items() if k != "trace"), flush=True)
    if kw.get("status") == "error" and "trace" in kw:
        print(kw["trace"], file=sys.stderr, flush=True)
    return kw


def guarded(what: str, ctx: dict, fn):
    try:
        return fn()
    except Exception as e:  # never abort the run on one failure
        record(check=what, **ctx, status="error", error=f"{type(e).__name__}: {e}"[:300],
               trace=traceback.format_exc())  # fmt: skip
        return None


def check(what: str, ctx: dict, out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    written = bool(torch.isfinite(out.float()).all())
    err = R.rel_l2(out, ref)
    ok = written and err < tol
    record(check=what, **ctx, rel_l2=f"{err:.2e}", tol=tol, all_written=written,
           status="ok" if ok else "FAIL")  # fmt: skip
    return ok


class env:
    """Set environment variables for a block (restored after)."""

    def __init__(self, kv: dict):
        self.kv, self.old = kv, {}

    def __enter__(self):
        for k, v in self.kv.items():
            self.old[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def gemm_kinds(m: int, k: int) -> list[str]:
    """The GEMM kernels that can serve an m x k projection (split-K needs K % 256 == 0)."""
    kinds = ["skinny"] + (["skinny-ring"] if m <= 16 else [])
    kinds += ["gemv", "skinny-l2pf"] if gs.supports(m, k) else []
    kinds += ["splitk", "splitk-partial"] if k % sk.KGRAIN == 0 else []
    return kinds + (["tile"] if k % tg.BK == 0 else [])


def poison(*ts: torch.Tensor) -> None:
    for t in ts:
        t.fill_(float("nan"))


def rnd(*shape, std=1.0, dtype=BF16) -> torch.Tensor:
    return (torch.randn(*shape, device=DEV) * std).to(dtype)


# -- correctness -------------------------------------------------------------------------------


def check_kernels(cfg, kind: str, w: dict, state: dict, B: int, T: int, ctx: dict) -> None:
    N, H = B * T, cfg.hidden

    def gemm_in(gk: str):
        x, r = rnd(N, H), rnd(N, H)
        segs = nqp.plan_for(cfg, kind, N).segments
        outs = [torch.empty(N, n, dtype=BF16, device=DEV) for n in segs]
        rout = torch.empty(N, H, dtype=BF16, device=DEV)
        poison(rout, *outs)
        with env(GEMM_KINDS[gk]):
            nqp.norm_qkv_proj(cfg, w, kind, x, r, rout, outs)
        ref_outs, ref_r = nqp.norm_qkv_proj_ref(cfg, w, kind, x, r)
        check(f"norm_qkv_proj.r_out[{gk}]", ctx, rout, ref_r, 1e-6)
        for i, (o, ro) in enumerate(zip(outs, ref_outs, strict=True)):
            check(f"norm_qkv_proj.out{i}[{gk}]", ctx, o, ro, TOL["out"])

    for gk in gemm_kinds(N, H):
        guarded(f"norm_qkv_proj[{gk}]", ctx, lambda gk=gk: gemm_in(gk))

    def oproj(gk: str):
        D = cfg.kda_dim if kind == "kda" else cfg.mla_v_dim
        o, r = rnd(N, D), rnd(N, H)
        out = torch.empty(N, H, dtype=BF16, device=DEV)
        poison(out)
        with env(GEMM_KINDS[gk]):
            op.oproj_residual(cfg, w, o, r, out)
        check(f"o_proj+residual[{gk}]", ctx, out, op.oproj_residual_ref(cfg, w, o, r),
              TOL["out"])  # fmt: skip

    D0 = cfg.kda_dim if kind == "kda" else cfg.mla_v_dim
    for gk in gemm_kinds(N, D0):
        guarded(f"o_proj+residual[{gk}]", ctx, lambda gk=gk: oproj(gk))

    def norm():
        r = rnd(N, H)
        h = torch.empty_like(r)
        poison(h)
        rms.rmsnorm(r, w["mlp_norm"], h, cfg.eps)
        check("rmsnorm", ctx, h, rms.rmsnorm_ref(r, w["mlp_norm"], cfg.eps), 1e-2)
        x, r2 = rnd(N, H), torch.empty_like(r)
        poison(h, r2)
        rms.rmsnorm(x, w["attn_norm"], h, cfg.eps, residual=r, residual_out=r2)
        check("residual+rmsnorm.r_out", ctx, r2, (x.float() + r.float()).to(BF16), 1e-6)
        ref = rms.rmsnorm_ref(x, w["attn_norm"], cfg.eps, residual=r)
        check("residual+rmsnorm.h", ctx, h, ref, 1e-2)

    guarded("rmsnorm", ctx, norm)

    if kind == "kda":

        def kda_k():
            proj = rnd(N, cfg.kda_in_proj_out)
            s0, c0 = state["kda_state"].clone(), state["conv_state"].clone()
            s1, c1 = s0.clone(), c0.clone()
            out = torch.empty(N, cfg.kda_dim, dtype=BF16, device=DEV)
            poison(out)
            kda.kda_decode(cfg, w, proj, s1, c1, out, T)
            ro, rs, rc = kda.kda_decode_ref(cfg, w, proj, s0, c0, T)
            check("kda_decode.out", ctx, out, ro, TOL["out"])
            check("kda_decode.state", ctx, s1, rs, TOL["state"])
            check("kda_decode.conv_state", ctx, c1, rc, TOL["state"])

        guarded("kda_decode", ctx, kda_k)
    else:

        def qb(gk: str):
            a = rnd(N, cfg.mla_qkv_a_out)
            q = torch.empty(N, cfg.mla_q_b_out, dtype=BF16, device=DEV)
            poison(q)
            with env(GEMM_KINDS[gk]):
                op.q_b_proj(cfg, w, a, q)
            check(f"q_norm+q_b_proj[{gk}]", ctx, q, op.q_b_proj_ref(cfg, w, a), TOL["out"])

        for gk in gemm_kinds(N, cfg.mla.q_lora_rank):
            guarded(f"q_b_proj[{gk}]", ctx, lambda gk=gk: qb(gk))

        def mla_k(kernel: str, hpc: int, splits: int = 0):
            a, q = rnd(N, cfg.mla_qkv_a_out), rnd(N, cfg.mla_q_b_out)
            g = rnd(N, cfg.mla_v_dim)
            cache = state["kv_cache"].clone()
            poison(cache[:, cfg.context_len :])
            out = torch.empty(N, cfg.mla_v_dim, dtype=BF16, device=DEV)
            poison(out)

            def run():
                if kernel == "tc":
                    mtc.mla_decode_tc(cfg, w, a, q, g, cache, out, T, heads_per_cta=hpc,
                                      splits=splits)  # fmt: skip
                else:
                    mla.mla_decode(cfg, w, a, q, g, cache, out, T, heads_per_cta=hpc,
                                   kernel="simt")  # fmt: skip

            run()
            ro, rc = mla.mla_decode_ref(cfg, w, a, q, g, state["kv_cache"], T)
            if kernel == "tc":
                p = mtc.plan_for(cfg, B, T, hpc, splits)
                tag = f"[tc hg={p.hg} splits={p.splits}]"
            else:
                tag = f"[simt heads_per_cta={hpc}]"
            check(f"mla_decode.out{tag}", ctx, out, ro, TOL["out"])
            ctx_len = cfg.context_len
            check(f"mla_decode.new_cache_rows{tag}", ctx, cache[:, ctx_len:], rc[:, ctx_len:],
                  1e-2)  # fmt: skip
            if TIMING["on"]:  # the kernel alone (cache L2-warm at small batch): A/B
                med, lo, hi = graph_time_us([run], TIMING["replays"])
                record(time=f"mla_decode alone {tag}", **ctx, us=f"{med:.1f}",
                       us_min=f"{lo:.1f}", us_max=f"{hi:.1f}", status="time")  # fmt: skip

        bf16_cache = state["kv_cache"].dtype == BF16
        guarded("mla_decode simt", ctx, lambda: mla_k("simt", 1))  # old first: a crash of
        if bf16_cache:  # a new kernel (sticky CUDA error) still leaves the old one's results
            guarded("mla_decode tc", ctx, lambda: mla_k("tc", 0))
        if bf16_cache and TIMING["on"]:
            for hg, sp in MLA_SWEEP.get(ctx["point"], ()):
                if cfg.mla_heads % hg == 0 and hg * T <= mtc.ROWS:
                    guarded(f"mla_decode tc hg{hg} splits{sp}", ctx,
                            lambda hg=hg, sp=sp: mla_k("tc", hg, sp))  # fmt: skip


def std_attention(layer, kind: str, x_in, r_in, r_out) -> None:
    """The standard path's attention half (what ``StandardLayer.forward`` runs before the MoE)."""
    w = layer.w
    layer._norm(x_in, w["attn_norm"], layer.h, r_in, r_out)
    if kind == "kda":
        layer._kda_forward()
    else:
        layer._mla_forward()
    layer._norm(layer.attn_out, w["mlp_norm"], layer.h, r_out, r_out)


def make_standard(cfg, spec, w, state, B, T):
    from decodescope.kernels.standard.layers import StandardLayer
    from decodescope.kernels.standard.ops import Ops

    ops = Ops(DEV)
    side = torch.cuda.Stream(DEV) if DEV.type == "cuda" else None
    return StandardLayer(cfg, spec, w, state, B, T, ops, side, 1)


def check_layer(cfg, spec, w, state, B, T, ctx, std_ok: bool) -> None:
    N, H, kind = B * T, cfg.hidden, spec.attn
    x, r = rnd(N, H), rnd(N, H)
    st = {k: v.clone() for k, v in state.items()}
    layer = SpecializedAttention(cfg, spec, w, st, B, T)
    r_out, h_out = torch.empty_like(r), torch.empty_like(r)
    poison(r_out, h_out)
    layer.forward(x, r, r_out, h_out)
    torch.cuda.synchronize()
    ref_r, ref_h, ref_state = attention_ref(cfg, spec, w, state, x, r, T)
    check("attention.r_out vs chained refs", ctx, r_out, ref_r, TOL["out"])
    check("attention.h vs chained refs", ctx, h_out, ref_h, TOL["out"])
    for k, v in ref_state.items():
        sl = slice(None) if k != "kv_cache" else (slice(None), slice(cfg.context_len, None))
        # FP8 rows: a value near a rounding boundary may land one e4m3 step (6%) apart
        tol = 6e-2 if st[k].dtype == torch.float8_e4m3fn else 1e-2
        check(f"attention.{k} vs chained refs", ctx, st[k][sl], v[sl], tol)

    def vs_reference():  # the layer's math in float32 on the GPU
        h32, r32 = R.attn_res_ref(x, r, w["attn_norm"], cfg.eps, F32)
        if kind == "kda":
            a32, _, _ = R.kda_attn_ref(cfg, w, h32, state["kda_state"], state["conv_state"], T, F32)
        else:
            a32, _ = R.mla_attn_ref(cfg, w, h32, state["kv_cache"], T, F32)
        hm, rm = R.attn_res_ref(a32, r32, w["mlp_norm"], cfg.eps, F32)
        check("attention.r_out vs reference.py (fp32)", ctx, r_out, rm, TOL["out"])
        check("attention.h vs reference.py (fp32)", ctx, h_out, hm, TOL["out"])

    guarded("vs_reference", ctx, vs_reference)

    if std_ok:

        def vs_standard():
            st2 = {k: v.clone() for k, v in state.items()}
            std = make_standard(cfg, spec, w, st2, B, T)
            r2 = torch.empty_like(r)
            std_attention(std, kind, x, r, r2)
            torch.cuda.synchronize()
            check("attention.r_out vs standard", ctx, r_out, r2, TOL["out"])
            check("attention.h vs standard", ctx, h_out, std.h, TOL["out"])
            for k in st:
                sl = slice(None) if k != "kv_cache" else (slice(None), slice(cfg.context_len, None))
                # FP8 rows: a value near a rounding boundary may land one e4m3 step (6%) apart
                tol = 6e-2 if st[k].dtype == torch.float8_e4m3fn else 2e-2
                check(f"attention.{k} vs standard", ctx, st[k][sl], st2[k][sl], tol)

        guarded("vs_standard", ctx, vs_standard)


# -- timing ------------------------------------------------------------------------------------


def attn_bytes(cfg, kind: str, w: dict, state: dict, N: int) -> int:
    """Bytes the attention half must move: its weights once, state read + written, the residual
    stream in (x, r) and out (r', h), the cache read (MLA) and its new rows written."""
    wb = sum(w[k].numel() * w[k].element_size() for k in ATTN_KEYS[kind] if k in w)
    act = 4 * N * cfg.hidden * 2
    if kind == "kda":
        st = 2 * sum(t.numel() * t.element_size() for t in state.values())
    else:
        c = state["kv_cache"]
        st = c.numel() * c.element_size()
    return wb + act + st


def run_timing(cfg, spec, w, state, B, T, ctx, bw_tbs, copies, replays, std_ok) -> None:
    kind, N, H = spec.attn, B * T, cfg.hidden
    nbytes = attn_bytes(cfg, kind, w, state, N)
    n = copies or max(2, math.ceil(3 * L2_BYTES / nbytes))
    ws = [{k: (v.clone() if k in ATTN_KEYS[kind] else v) for k, v in w.items()} for _ in range(n)]
    sts = [{k: v.clone() for k, v in state.items()} for _ in range(n)]
    xs = [(rnd(N, H), rnd(N, H), torch.empty(N, H, dtype=BF16, device=DEV),
           torch.empty(N, H, dtype=BF16, device=DEV)) for _ in range(n)]  # fmt: skip
    layers = [SpecializedAttention(cfg, spec, ws[i], sts[i], B, T) for i in range(n)]
    stages = [lay.stages(*xs[i]) for i, lay in enumerate(layers)]
    floor = nbytes / (bw_tbs * 1e6)
    base = dict(**ctx, copies=n, floor_us=f"{floor:.1f}", layer_bytes=nbytes, status="time")
    fns = [(lambda lay=lay, a=a: lay.forward(*a)) for lay, a in zip(layers, xs, strict=True)]
    variants = dict(VARIANTS)
    if N < sk.MIN_M:  # is the split-K GEMM worth it below its default threshold too?
        variants["splitk-all"] = {"DECODESCOPE_SPLITK_GEMM": "1"}
    if N <= 16:  # the skinny GEMM's cp.async ring: the defaults with it (reaches q_b), and
        # the skinny kernel for every projection with registers / the ring / the ring for K 7168
        variants["ring"] = dict(RING)
        variants["skinny"] = dict(GEMM_KINDS["skinny"])
        variants["skinny-ring"] = dict(GEMM_KINDS["skinny-ring"])
        variants["skinny-auto"] = {**GEMM_KINDS["skinny"], "DECODESCOPE_SKINNY_LOAD": "auto"}
    if N <= gs.MAX_M:  # the streaming GEMV and the whole-slice L2 prefetch (o_proj, q_b):
        # each alone and together, on top of the defaults (the skinny kernel below 8 tokens)
        variants["l2pf"] = dict(L2PF)
        variants["gemv"] = dict(GEMV)
        variants["gemv-l2pf"] = {**GEMV, **L2PF}
        variants["no-gemv"] = {"DECODESCOPE_SKINNY_GEMV": "0"}  # the skinny kernel at 1 token
    spec_us = None
    for vname, venv in variants.items():
        sfx = "" if vname == "new" else f" [{vname} kernels]"
        for j, (name, _) in enumerate(stages[0]):

            def one(j=j, venv=venv):
                with env(venv):
                    return graph_time_us([st[j][1] for st in stages], replays)

            r = guarded(f"time {name}{sfx}", ctx, one)
            if r is not None:
                record(time=f"kernel {name}{sfx}", **ctx, us=f"{r[0]:.1f}", us_min=f"{r[1]:.1f}",
                       us_max=f"{r[2]:.1f}", status="time")  # fmt: skip

        def half(venv=venv):
            with env(venv):
                return graph_time_us(fns, replays)

        r = guarded(f"time specialized{sfx}", ctx, half)
        if r is not None:
            if vname == "new":
                spec_us = r[0]
            record(time=f"specialized attention{sfx}", kernels=len(stages[0]), us=f"{r[0]:.1f}",
                   us_min=f"{r[1]:.1f}", us_max=f"{r[2]:.1f}", eff=f"{r[0] / floor:.2f}",
                   **base)  # fmt: skip
    if ctx["point"] in PDL_AB_POINTS:  # the same half without programmatic dependent launch

        def no_pdl():
            with env({"DECODESCOPE_NO_PDL": "1"}):
                return graph_time_us(fns, replays)

        r = guarded("time specialized no-PDL", ctx, no_pdl)
        if r is not None:
            record(time="specialized attention, PDL off", kernels=len(stages[0]),
                   us=f"{r[0]:.1f}", us_min=f"{r[1]:.1f}", us_max=f"{r[2]:.1f}",
                   eff=f"{r[0] / floor:.2f}", **base)  # fmt: skip
    if not std_ok:
        return

    def std_time():
        stds = [make_standard(cfg, spec, ws[i], sts[i], B, T) for i in range(n)]
        f = [(lambda s=s, a=a: std_attention(s, kind, a[0], a[1], a[2]))
             for s, a in zip(stds, xs, strict=True)]  # fmt: skip
        return graph_time_us(f, replays)

    r = guarded("time standard", ctx, std_time)
    if r is not None:
        sp = r[0] / spec_us if spec_us else float("nan")
        record(time="standard attention", us=f"{r[0]:.1f}", us_min=f"{r[1]:.1f}",
               us_max=f"{r[2]:.1f}", eff=f"{r[0] / floor:.2f}", speedup=f"{sp:.2f}",
               **base)  # fmt: skip


# -- GEMM tiling sweep ---------------------------------------------------------------------------

SWEEP_VARIANTS = [(1, 8), (2, 8), (4, 8)]  # (rt, ks) of the small-M skinny GEMM
RING_SWEEP = [(1, 4, 32), (1, 8, 32), (1, 2, 32), (1, 4, 0), (2, 4, 32)]  # (rt, stages, unroll)


def gemm_sweep(cfg, tp: int, bw_tbs: float, replays: int, ms=(1, 8, 32, 64)) -> None:
    """The skinny GEMM's tilings on the KDA in_proj (norm prologue) and o_proj (residual
    epilogue) shapes, each checked and timed (weights rotated past L2), cuBLAS beside them."""
    H = cfg.hidden
    shapes = {"in_proj": (cfg.kda_in_proj_out, H, True), "o_proj": (H, cfg.kda_dim, False)}
    for name, (N, K, norm) in shapes.items():
        n = max(2, math.ceil(3 * L2_BYTES / (N * K * 2)))
        ws = [rnd(N, K, std=K**-0.5) for _ in range(n)]
        for M in ms:
            ctx = {"preset": cfg.preset, "tp": tp, "kind": f"gemm:{name}", "point": f"M{M}"}
            guarded(f"gemm {name}", ctx, lambda M=M, ctx=ctx, name=name, norm=norm, ws=ws:
                    sweep_point(name, norm, M, ws, ctx, bw_tbs, replays))  # fmt: skip
        del ws
        torch.cuda.empty_cache()


def sweep_point(name: str, norm: bool, M: int, ws: list, ctx: dict, bw: float, replays: int):
    N, K = ws[0].shape
    n = len(ws)
    x, r, e = rnd(M, K), rnd(M, K), rnd(M, N)
    nw = (1 + 0.1 * torch.randn(K, device=DEV)).to(BF16)
    outs = [torch.empty(M, N, dtype=BF16, device=DEV) for _ in range(n)]
    rout = torch.empty(M, K, dtype=BF16, device=DEV)
    floor = (N * K * 2 + 4 * M * K + 2 * M * N) / (bw * 1e6)
    if norm:
        kw = {"residual": r, "residual_out": rout, "norm_weight": nw}
        ref, _ = sg.skinny_gemm_ref(x, [ws[0]], residual=r, norm_weight=nw)
    else:
        kw = {"epilogue_residual": e}
        ref, _ = sg.skinny_gemm_ref(x, [ws[0]], epilogue_residual=e)

    def timed(what: str, fns: list) -> None:
        med, lo, hi = graph_time_us(fns, replays)
        record(time=f"gemm {name} {what}", **ctx, kernels=1, us=f"{med:.1f}", us_min=f"{lo:.1f}",
               us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}", eff=f"{med / floor:.2f}",
               status="time")  # fmt: skip

    def variant(rt: int, ks: int, load: str = "regs", stages: int = 4, unroll: int = 32) -> None:
        def one(i: int) -> None:
            sg.skinny_gemm(x, [ws[i]], [outs[i]], rt=rt, ks=ks, load=load, stages=stages,
                           ring_unroll=unroll, **kw)  # fmt: skip

        tag = f"rt{rt}/ks{ks}"
        if load == "ring":
            tag += f" ring s{stages}" + (" rounds" if unroll == 0 else "")
        poison(outs[0])
        one(0)
        torch.cuda.synchronize()
        check(f"gemm {tag}", ctx, outs[0], ref[0], TOL["out"])
        timed(tag, [(lambda i=i: one(i)) for i in range(n)])

    def split(rt: int) -> None:  # residual+norm in its own launch, then the plain GEMM on h
        hb = torch.empty(M, K, dtype=BF16, device=DEV)

        def one(i: int) -> None:
            rms.rmsnorm(x, nw, hb, 1e-5, residual=r, residual_out=rout)
            sg.skinny_gemm(hb, [ws[i]], [outs[i]], rt=rt)

        poison(outs[0])
        one(0)
        torch.cuda.synchronize()
        check(f"gemm split rt{rt}", ctx, outs[0], ref[0], TOL["out"])
        timed(f"norm launch + GEMM rt{rt} (2 kernels)", [(lambda i=i: one(i)) for i in range(n)])

    def splitk(splits: int, reduce: str = "atomic") -> None:
        def one(i: int) -> None:
            with env({"DECODESCOPE_SPLITK_REDUCE": reduce}):
                sk.splitk_gemm(x, [ws[i]], [outs[i]], splits=splits, **kw)

        plan = sk.SplitKPlan(m=M, k=K, segments=(N,), norm=norm, add_residual=norm,
                             residual_epilogue=not norm, splits_force=splits)  # fmt: skip
        poison(outs[0])
        one(0)
        torch.cuda.synchronize()
        tag = f"splitK {reduce} S{plan.splits} (kl {plan.kl}, {plan.row_ctas * plan.splits} CTAs)"
        check(f"gemm {tag}", ctx, outs[0], ref[0], TOL["out"])
        timed(tag, [(lambda i=i: one(i)) for i in range(n)])

    for rt, ks in SWEEP_VARIANTS:
        if (K // sg.KCHUNK) % ks == 0:
            guarded(f"gemm {name} rt{rt}/ks{ks}", ctx, lambda rt=rt, ks=ks: variant(rt, ks))
    if M <= 16:  # the cp.async ring (skinny_gemm's load="ring"): stages, runtime rounds, rt 2
        for rt, stages, unroll in RING_SWEEP:
            guarded(f"gemm {name} rt{rt} ring s{stages} u{unroll}", ctx,
                    lambda rt=rt, s=stages, u=unroll: variant(rt, 8, "ring", s, u))  # fmt: skip
    if K % sk.KGRAIN == 0:
        g = K // sk.KGRAIN
        p0 = sk.SplitKPlan(m=M, k=K, segments=(N,))
        near = sorted((d for d in range(1, g + 1) if g % d == 0 and d != p0.splits
                       and p0.smem_for(d) <= 200 * 1024),
                      key=lambda d: abs(math.log(d / p0.splits)))  # fmt: skip
        for S in [0] + near[:2]:
            guarded(f"gemm {name} splitK S{S}", ctx, lambda S=S: splitk(S))
            guarded(f"gemm {name} splitK partial S{S}", ctx, lambda S=S: splitk(S, "partial"))
    if norm and M > 8:
        guarded(f"gemm {name} split rt1", ctx, lambda: split(1))
    guarded(f"gemm {name} cublas", ctx, lambda: timed("cuBLAS (no norm/epilogue)", [
        (lambda i=i: torch.mm(x, ws[i].t(), out=outs[i])) for i in range(n)]))  # fmt: skip


# -- streaming GEMV sweep (1..4 tokens) ----------------------------------------------------------

# (warps, rows per warp, pieces per group, groups ahead) of gemv_stream, at M = 1; M 2 / 4 run
# the first two. "auto": gemv_stream.auto_cfg (what DECODESCOPE_SKINNY_GEMV runs when
# DECODESCOPE_GEMV_CFG is unset); r3 / w16r3: fewer CTAs (in_proj TP8: 262 / 131); g4 / d4:
# more loads in flight per lane; suffix "n": weights by ld.global.nc.L1::no_allocate.L2::256B;
# "x": the prologue's x / r by register loads (the default copies them by cp.async).
GEMV_SWEEP = ["auto", "auton", "autox", "w8r2g2d2", "w8r3g1d4", "w8r3g2d2", "w8r2g2d4",
              "w16r3g1d2", "w16r1g4d2", "w4r4g2d2"]  # fmt: skip
GEMV_SHAPES = ("in_proj", "qkv_a_g", "q_b", "o_proj")
# the dense MLP's two 1-token GEMMs (layer 0; --gemv-shapes): gate_up with the RMSNorm prologue
# and the SiTU epilogue, down with K = 33792 / tp (a tail past the last multiple of 256)
DENSE_SHAPES = ("dense_gate_up", "dense_down")


def gemv_cases(cfg) -> dict[str, dict]:
    """The GEMV sweep's projections: :func:`.tile_gemm.attention_cases` and the dense MLP's
    (``situ``: the (beta, linear beta) of the SiTU epilogue)."""
    from decodescope.kernels.specialized import dense_mlp

    beta = dense_mlp._betas(cfg)
    return {
        **tg.attention_cases(cfg),
        "dense_gate_up": dict(k=cfg.hidden, segments=(2 * cfg.dense_inter,), norm=True,
                              eps=cfg.eps, situ=beta),
        "dense_down": dict(k=cfg.dense_inter, segments=(cfg.hidden,)),
    }  # fmt: skip


def shape_cfgs(cfgs: list[str] | None, name: str) -> list[str]:
    """The knob sets swept on projection ``name``: entries ``cfg`` (every shape) and
    ``name:cfg`` (that shape only), in order; None: ``GEMV_SWEEP``."""
    if not cfgs:
        return list(GEMV_SWEEP)
    out = []
    for c in cfgs:
        shape, _, v = c.rpartition(":")
        if shape and shape not in GEMV_SHAPES + DENSE_SHAPES:
            raise ValueError(f"--gemv-cfgs {c!r}: unknown projection {shape!r} "
                             f"(expected one of {GEMV_SHAPES + DENSE_SHAPES})")  # fmt: skip
        try:  # a bad knob string: its one-line error before any GPU work
            gs.parse_cfg(v)
        except ValueError:
            raise ValueError(f"--gemv-cfgs {c!r}: expected [PROJECTION:]auto or wWrRgGdD, "
                             "optional suffixes n / x") from None  # fmt: skip
        if shape in ("", name):
            out.append(v)
    return out


def cfg_str(cf: tuple[int, int, int, int]) -> str:
    return "w{}r{}g{}d{}".format(*cf)


def gemv_sweep(cfg, tp: int, bw_tbs: float, replays: int, ms=(1, 2, 4), cfgs=None,
               write_tuned: str | None = None, shapes=GEMV_SHAPES) -> None:  # fmt: skip
    """The attention projections at 1..4 tokens, each alone (weights rotated past L2): the
    skinny GEMM (registers; the default before s10), the streaming GEMV per knob set ("auto":
    gemv_stream.tuned_cfg, the default at 1 token), the GEMV and the
    skinny kernel with the whole-slice L2 prefetch (o_proj, q_b: back to back there is no light
    kernel in front, so this is the prefetch's cost, not its gain), cuBLAS (no norm/epilogue,
    one torch.mm per segment); each checked (NaN-poisoned outputs) before it is timed.
    ``write_tuned``: the fastest plain knob set per (projection, M) into that JSON file (the
    format ``DECODESCOPE_GEMV_TUNED`` reads), rewritten after every shape; entries of other
    shapes already in the file are kept (one file for several TP shapes' sweeps). ``shapes``:
    the projections (``GEMV_SHAPES``, ``DENSE_SHAPES``)."""
    cases = gemv_cases(cfg)
    for name in shapes:
        shape_cfgs(cfgs, name)  # every entry checked before the first kernel runs
    tuned: list[dict] = []
    if write_tuned and Path(write_tuned).exists():
        tuned = json.loads(Path(write_tuned).read_text())
    for name in shapes:
        kw = cases[name]
        K, segs = kw["k"], kw["segments"]
        wb = sum(segs) * K * 2
        n = max(2, math.ceil(3 * L2_BYTES / wb))
        ws = [[rnd(N, K, std=K**-0.5) for N in segs] for _ in range(n)]
        for M in ms:
            if not gs.shape_ok(M, K):
                continue
            ctx = {"preset": cfg.preset, "tp": tp, "kind": f"gemv:{name}", "point": f"M{M}"}
            got = guarded(f"gemv {name}", ctx, lambda M=M, ctx=ctx, kw=kw, ws=ws, name=name:
                          gemv_point(name, kw, M, ws, ctx, bw_tbs, replays,
                                     shape_cfgs(cfgs, name)))  # fmt: skip
            if got:
                best = min(got, key=lambda t: t[0])
                default = cfg_str(gs.tuned_cfg(M, K, segs))
                tuned = [e for e in tuned
                         if (e["m"], e["k"], list(e["segments"])) != (M, K, list(segs))]  # fmt: skip
                tuned.append({"m": M, "k": K, "segments": list(segs), "cfg": best[1],
                              "us": round(best[0], 2), "projection": name, "tp": tp,
                              "default_cfg": default,
                              "default_us": next((round(u, 2) for u, c in got if c == default),
                                                 None)})  # fmt: skip
                if write_tuned:
                    Path(write_tuned).write_text(json.dumps(tuned, indent=1) + "\n")
        del ws
        torch.cuda.empty_cache()


def gemv_point(name, kw, M, ws, ctx, bw, replays, cfgs) -> None:
    K, segs = kw["k"], kw["segments"]
    n = len(ws)
    ldx = kw.get("x_stride") or K
    x = rnd(M, ldx)[:, :K]
    r, nw = rnd(M, K), (1 + 0.1 * torch.randn(K, device=DEV)).to(BF16)
    e = rnd(M, segs[0])
    situ = kw.get("situ")
    widths = [N // 2 if situ else N for N in segs]
    outs = [[torch.empty(M, N, dtype=BF16, device=DEV) for N in widths] for _ in range(n)]
    rout = torch.empty(M, K, dtype=BF16, device=DEV)
    f = dict(residual=r if kw.get("add_residual") else None,
             norm_weight=nw if kw.get("norm") else None,
             epilogue_residual=e if kw.get("residual_epilogue") else None,
             eps=kw.get("eps", 1e-5), situ=situ)  # fmt: skip
    rkw = {"residual_out": rout} if kw.get("add_residual") else {}
    ref, ref_r = sg.skinny_gemm_ref(x, ws[0], **f)
    nbytes = sum(segs) * K * 2 + M * K * 2 * (1 + 2 * bool(kw.get("add_residual")))
    nbytes += M * sum(widths) * 2 * (1 + bool(kw.get("residual_epilogue")))
    floor = nbytes / (bw * 1e6)

    def run(tag: str, one) -> float | None:
        poison(*outs[0], rout)
        one(0)
        torch.cuda.synchronize()
        ok = all([check(f"gemv {name} {tag} out{j}", ctx, o, ro, TOL["out"])
                  for j, (o, ro) in enumerate(zip(outs[0], ref, strict=True))])  # fmt: skip
        if ref_r is not None and tag != "cuBLAS":
            ok = check(f"gemv {name} {tag} r_out", ctx, rout, ref_r, 1e-6) and ok
        if not ok:
            return None
        med, lo, hi = graph_time_us([(lambda i=i: one(i)) for i in range(n)], replays)
        record(time=f"{name} {tag}", **ctx, kernels=1, us=f"{med:.1f}", us_min=f"{lo:.1f}",
               us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}", eff=f"{med / floor:.2f}",
               tbs=f"{nbytes / med / 1e6:.2f}", status="time")  # fmt: skip
        return med

    small = sum(segs) * K * 2 <= sg.L2_PREFETCH_MAX_MB * 2**20
    guarded(f"gemv {name} skinny", ctx, lambda: run("skinny regs (old default)", lambda i: sg.skinny_gemm(
        x, ws[i], outs[i], load="regs", gemv=False, l2_all=False, **rkw, **f)))  # fmt: skip
    if small:
        guarded(f"gemv {name} skinny l2pf", ctx, lambda: run("skinny regs + L2 prefetch",
                lambda i: sg.skinny_gemm(x, ws[i], outs[i], load="regs", gemv=False,
                                         l2_all=True, **rkw, **f)))  # fmt: skip
    got = []  # (us, knob set) of the plain sets that passed: what --write-tuned picks from
    for c in (cfgs or GEMV_SWEEP)[: (None if M == 1 else 2)]:
        cf, ld, xl = gs.parse_cfg(c), gs.parse_ld(c), gs.parse_xload(c)
        plain = ld == "plain" and xl == "async"
        label = c if cf else f"{c} ({cfg_str(gs.tuned_cfg(M, K, tuple(segs)))})"
        us = guarded(f"gemv {name} {c}", ctx, lambda c=c, cf=cf, ld=ld, xl=xl, label=label: run(
            f"gemv {label}", lambda i: gs.gemv(x, ws[i], outs[i], cfg=cf, ld=ld, xload=xl,
                                               **rkw, **f)))  # fmt: skip
        if us is not None and plain:
            got.append((us, cfg_str(cf or gs.tuned_cfg(M, K, tuple(segs)))))
        if small and c == GEMV_SWEEP[0]:
            guarded(f"gemv {name} {c} l2pf", ctx, lambda c=c, cf=cf, ld=ld: run(
                f"gemv {c} + L2 prefetch", lambda i: gs.gemv(x, ws[i], outs[i], cfg=cf, ld=ld,
                                                              l2_all=True, **rkw, **f)))  # fmt: skip
    if situ:  # cuBLAS has no SiTU epilogue to compare with
        return got

    def cublas(i: int) -> None:
        for w_, o in zip(ws[i], outs[i], strict=True):
            torch.mm(x, w_.t(), out=o)

    cref = [(x.float() @ w_.float().t()).to(BF16) for w_ in ws[0]]
    poison(*outs[0])
    cublas(0)
    torch.cuda.synchronize()
    for j, (o, ro) in enumerate(zip(outs[0], cref, strict=True)):
        check(f"gemv {name} cuBLAS out{j}", ctx, o, ro, TOL["out"])
    med, lo, hi = graph_time_us([(lambda i=i: cublas(i)) for i in range(n)], replays)
    record(time=f"{name} cuBLAS (no norm/epilogue, {len(segs)} mm)", **ctx, kernels=len(segs),
           us=f"{med:.1f}", us_min=f"{lo:.1f}", us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}",
           eff=f"{med / floor:.2f}", tbs=f"{nbytes / med / 1e6:.2f}", status="time")  # fmt: skip
    return got


# -- driver ------------------------------------------------------------------------------------


def table_md() -> str:
    lines = [
        "| tp | kind | point | what | kernels | us | min | max | floor us | span/floor | speedup "
        "| TB/s |",
        "|" + "---|" * 12,
    ]
    for r in RESULTS:
        if r.get("status") != "time":
            continue
        lines.append(
            f"| {r['tp']} | {r['kind']} | {r['point']} | {r['time']} | {r.get('kernels', '')} "
            f"| {r['us']} | {r['us_min']} | {r['us_max']} | {r.get('floor_us', '')} "
            f"| {r.get('eff', '')} | {r.get('speedup', '')} | {r.get('tbs', '')} |"
        )
    skipped = [r for r in RESULTS if r.get("status") == "skipped"]
    for r in skipped:
        lines.append(f"| {r.get('tp', '')} | {r.get('kind', '')} | {r.get('point', '')} "
                     "| skipped (--budget) | | | | | | | | |")  # fmt: skip
    fails = [r for r in RESULTS if r.get("status") in ("FAIL", "error")]
    oks = sum(1 for r in RESULTS if r.get("status") == "ok")
    lines.append("")
    lines.append(f"checks: {oks} ok, {len(fails)} failed or errored")
    for r in fails:
        what = r.get("check", r.get("time"))
        lines.append(f"- {r.get('status')} {r['tp']} {r['kind']} {r['point']} {what} "
                     f"{r.get('rel_l2', '')} {r.get('error', '')}")  # fmt: skip
    return "\n".join(lines)


def run_point(a, cfg, preset, tp, spec, w, pt: str, bw: float, t0: float, label: str) -> None:
    kind = spec.attn
    B, T = (int(v) for v in pt.split("x"))
    ctx = {"preset": preset, "tp": tp, "kind": label, "point": pt}
    state = make_state(cfg, spec, B, T, seed=B * 10 + T, device=DEV)
    t1 = time.time()
    guarded("kernels", ctx, lambda: check_kernels(cfg, kind, w, state, B, T, ctx))
    guarded("layer", ctx, lambda: check_layer(cfg, spec, w, state, B, T, ctx, not a.no_standard))
    if not a.no_timing and preset != "tiny":
        guarded("timing", ctx, lambda: run_timing(cfg, spec, w, state, B, T, ctx, bw, a.copies,
                                                  a.replays, not a.no_standard))  # fmt: skip
    record(what="point done", **ctx, seconds=f"{time.time() - t1:.0f}",
           total_s=f"{time.time() - t0:.0f}", status="info")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/specialized_attn")
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=["kda", "mla", "mla-fp8"],
        help="kda, mla (BF16 latent cache), mla-fp8 (FP8 e4m3 latent cache)",
    )
    ap.add_argument("--points", nargs="+", default=["1x1", "8x1", "32x1", "64x1", "1x8", "8x8"])
    ap.add_argument("--copies", type=int, default=0, help="layers rotated past L2 (0: auto)")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-standard", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="also check the tiny preset")
    ap.add_argument("--no-sweep", action="store_true", help="skip the GEMM tiling sweep")
    ap.add_argument("--sweep-only", action="store_true", help="only the GEMM tiling sweep")
    ap.add_argument("--gemv-only", action="store_true",
                    help="only the streaming-GEMV sweep of the 4 attention projections (first "
                         "--tp, --sweep-ms up to 4; --gemv-cfgs)")  # fmt: skip
    ap.add_argument("--gemv-shapes", nargs="+", default=list(GEMV_SHAPES),
                    choices=GEMV_SHAPES + DENSE_SHAPES,
                    help="with --gemv-only: the projections swept (default the attention ones)")  # fmt: skip
    ap.add_argument(
        "--gemv-cfgs",
        nargs="+",
        default=None,
        help=f"GEMV knob sets wWrRgGdD, or PROJECTION:wWrRgGdD for one of "
        f"{GEMV_SHAPES + DENSE_SHAPES} "
        f"(default {' '.join(GEMV_SWEEP)})",
    )
    ap.add_argument("--write-tuned", default=None, metavar="PATH",
                    help="with --gemv-only: the fastest plain knob set per projection and M into "
                         "this JSON file (what DECODESCOPE_GEMV_TUNED reads)")  # fmt: skip
    ap.add_argument("--sweep-ms", type=int, nargs="+", default=[1, 8, 32, 64],
                    help="token counts of the GEMM sweep")  # fmt: skip
    ap.add_argument("--budget", type=float, default=540,
                    help="seconds: later points / the sweep are skipped (and listed) past it")  # fmt: skip
    a = ap.parse_args()
    try:
        for name in a.gemv_shapes:
            shape_cfgs(a.gemv_cfgs, name)
    except ValueError as e:
        ap.error(str(e))
    if a.write_tuned and not a.gemv_only:
        ap.error("--write-tuned needs --gemv-only")
    TIMING.update(on=not a.no_timing, replays=a.replays)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(1234)
    bw = guarded("copy_bw", {}, copy_bandwidth_tbs) or 4.22
    record(what="copy_bw_tbs", value=f"{bw:.3f}", gpu=torch.cuda.get_device_name(), status="info")
    shapes = [("kimi-k3", tp) for tp in a.tp] + ([("tiny", 1)] if a.tiny else [])
    if a.gemv_only:
        cfg = get_config("kimi-k3", a.tp[0])
        ms = tuple(m for m in a.sweep_ms if m <= gs.MAX_M) or (1,)
        guarded("gemv_sweep", {"tp": a.tp[0]},
                lambda: gemv_sweep(cfg, a.tp[0], bw, a.replays, ms, a.gemv_cfgs,
                                   a.write_tuned, tuple(a.gemv_shapes)))  # fmt: skip
        table = table_md()
        (out / "results.json").write_text(json.dumps(RESULTS, indent=1))
        (out / "table.md").write_text(table + "\n")
        print(table)
        return 0
    if a.sweep_only:
        shapes = []
    t0 = time.time()
    for preset, tp in shapes:
        cfg = get_config(preset, tp)
        for label in a.kinds:
            kind = "kda" if label == "kda" else "mla"
            kcfg = get_config(preset, tp, kv_cache_dtype="fp8_e4m3") if label == "mla-fp8" else cfg
            spec = LayerSpec(3 if kind == "kda" else 7, kind, "moe")
            w = guarded("weights", {"tp": tp, "kind": label},
                        lambda cfg=cfg, spec=spec: make_layer_weights(cfg, spec, 0, DEV))  # fmt: skip
            if w is None:
                continue
            for pt in a.points:
                if time.time() - t0 > a.budget:
                    record(what="skipped (budget)", preset=preset, tp=tp, kind=label, point=pt,
                           status="skipped")  # fmt: skip
                    continue
                run_point(a, kcfg, preset, tp, spec, w, pt, bw, t0, label)
                (out / "results.json").write_text(json.dumps(RESULTS, indent=1))
            del w
            torch.cuda.empty_cache()
    if not a.no_sweep and not a.no_timing and time.time() - t0 > a.budget:
        record(what="skipped (budget)", tp=a.tp[0], kind="gemm sweep", status="skipped")
    elif not a.no_sweep and not a.no_timing:
        cfg = get_config("kimi-k3", a.tp[0])
        guarded("gemm_sweep", {"tp": a.tp[0]},
                lambda: gemm_sweep(cfg, a.tp[0], bw, a.replays, tuple(a.sweep_ms)))  # fmt: skip
    table = table_md()
    (out / "results.json").write_text(json.dumps(RESULTS, indent=1))
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
