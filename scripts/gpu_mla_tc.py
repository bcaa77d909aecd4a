"""The tensor-core MLA decode on the H200: its variants checked, then timed against the current
default and the standard path's kernels for the same ops (issue #5, 32-64 sequences).

    python scripts/gpu_mla_tc.py --out $OUT/mla_tc [--tp 8 16] [--points 8x1 16x1 32x1 64x1 8x8]
        [--variants default ldsm ...] [--no-sweep] [--no-diag] [--diag-points 32x1 64x1]
        [--replays 30] [--budget 480]

A point ``BxT`` is B sequences of T tokens, ``context_len`` (1024) cached positions each. Per
(TP shape, point), with fresh random inputs (a, q, g, the cache, the layer's weights):

1. correctness, each variant: output and the T new cache rows poisoned with NaN, one launch,
   vs ``mla_decode_ref`` (FP32 torch, the kernel's rounding points): rel. L2 < 2e-2 (output),
   < 1e-2 (new rows), every element written, the old cache rows untouched; then two more
   launches (the split counters reset themselves) and the same check;
2. timing, each variant that passed: the kernel alone in a CUDA graph (median, min, max of
   ``--replays`` replays), cache, inputs and weights rotated over enough copies to pass 3x the
   L2; the standard path's kernels for the same ops (``StandardLayer``'s w_uk bmm, cache insert,
   decode, w_uv bmm, gate multiply) timed the same way; the bytes floor (cache + w_uk + w_uv +
   inputs / outputs at the copy bandwidth measured in this process);
3. diagnostics (timing only, wrong results by design): ``DECODESCOPE_MLA_TC_DIAG=1`` (no w_uk /
   w_uv reads) for the default and cluster variants: the time the absorption and
   W_UV cost.

Variants (environment read at each launch, so each graph holds the variant set at capture):
``default`` (every knob unset: the ldmatrix fragments since s9/r2), ``noldsm``
(``DECODESCOPE_MLA_TC_LDSM=0``: the kernel before session 9), ``cluster`` (ldmatrix + the
splits of a pair in one cluster sharing the absorption, merge and W_UV), ``cluster-noldsm``, ``simt`` (the old CUDA-core
kernel, at <= 16 sequences), ``auto`` (what ``mla_decode`` runs by default at the point),
``split`` (:mod:`.mla_decode_split`, the three-phase kernel of session 10; heads x tokens <= 16)
and its knobs ``split sS`` (splits), ``nbuf1`` / ``nbuf2`` (key buffers), ``aA`` (absorption
column chunks), ``vrR`` (rows per W_UV item); a split check also fails if a wait gave up (the
kernel's error word), and per point the sweep ``ldsm hgH sS`` (heads per CTA, splits;
0 = the plan's; at the first ``--tp`` only).

One failing piece is recorded and the run goes on; ``results.json`` is rewritten after every
record. Writes ``results.json`` and ``table.md`` under ``--out``; prints the table (timings, then
PASS / FAIL per check) last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

from decodescope.kernels import reference as R
from decodescope.kernels.bandwidth import copy_bandwidth_tbs
from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.specialized import mla_decode as mla
from decodescope.kernels.specialized import mla_decode_split as msp
from decodescope.kernels.specialized import mla_decode_tc as mtc
from decodescope.kernels.timing import graph_time_us
from decodescope.kernels.weights import make_layer_weights, make_state

DEV = torch.device("cuda")
BF16 = torch.bfloat16
L2_BYTES = 50 * 2**20
RESULTS: list[dict] = []
OUT: dict = {"dir": None}
# every knob unset: the kernel's defaults
BASE = {"DECODESCOPE_MLA_TC_LDSM": "", "DECODESCOPE_MLA_TC_DIAG": "",
        "DECODESCOPE_MLA_TC_CLUSTER": "", "DECODESCOPE_MLA_TC_CLUSTER_SEQS": "",
        "DECODESCOPE_MLA_TC_SPLITS": "", "DECODESCOPE_MLA_TC_UNROLL": "",
        "DECODESCOPE_MLA_TC_NBUF": "", "DECODESCOPE_MLA_KERNEL": "",
        "DECODESCOPE_MLA_SPLIT_SPLITS": "", "DECODESCOPE_MLA_SPLIT_ACHUNKS": "",
        "DECODESCOPE_MLA_SPLIT_VROWS": "", "DECODESCOPE_MLA_SPLIT_NBUF": "",
        "DECODESCOPE_MLA_SPLIT_TRACE": "", "DECODESCOPE_MLA_SPLIT_DIAG": "",
        "DECODESCOPE_MLA_SPLIT_FUSE": "", "DECODESCOPE_MLA_SPLIT_L2PRE": "",
        "DECODESCOPE_MLA_SPLIT_UVFAST": "", "DECODESCOPE_MLA_SPLIT_TAIL": "",
        "DECODESCOPE_MLA_SPLIT_LL": "",
        "DECODESCOPE_MLA_HEADS_PER_CTA": ""}  # fmt: skip
LDSM = {"DECODESCOPE_MLA_TC_LDSM": "1"}
CLUSTER = {"DECODESCOPE_MLA_TC_LDSM": "1", "DECODESCOPE_MLA_TC_CLUSTER": "1"}
# name -> (kernel, env, heads per CTA, splits)
VARIANTS = {
    "default": ("tc", {}, 0, 0),  # ldmatrix since s9/r2; clusters of 2 from 64 rows since s9/r4
    "plain": ("tc", {"DECODESCOPE_MLA_TC_CLUSTER": "0"}, 0, 0),  # ldmatrix, never a cluster
    "noldsm": ("tc", {"DECODESCOPE_MLA_TC_LDSM": "0"}, 0, 0),  # the kernel before session 9
    "cluster": ("tc", CLUSTER, 0, 0),  # with the ldmatrix loads
    "cluster-noldsm": ("tc", {"DECODESCOPE_MLA_TC_CLUSTER": "1"}, 0, 0),
    # clusters over 2 / 4 sequences too: w_uk / w_uv read once per cluster
    "cluster-seq2": ("tc", {**CLUSTER, "DECODESCOPE_MLA_TC_CLUSTER_SEQS": "2"}, 0, 0),
    "cluster-seq4": ("tc", {**CLUSTER, "DECODESCOPE_MLA_TC_CLUSTER_SEQS": "4"}, 0, 0),
    # twice the w_uk / w_uv loads in flight per thread: latency or L2 bandwidth?
    "unroll32": ("tc", {"DECODESCOPE_MLA_TC_UNROLL": "32"}, 0, 0),
    "cluster-seq4 unroll32": (
        "tc",
        {**CLUSTER, "DECODESCOPE_MLA_TC_CLUSTER_SEQS": "4", "DECODESCOPE_MLA_TC_UNROLL": "32"},
        0,
        0,
    ),
    # one key buffer, two CTAs per SM (twice the splits)
    "nbuf1": ("tc", {"DECODESCOPE_MLA_TC_NBUF": "1"}, 0, 0),
    "cluster nbuf1": ("tc", {**CLUSTER, "DECODESCOPE_MLA_TC_NBUF": "1"}, 0, 0),
    "simt": ("simt", {}, 1, 0),
    # what the layer runs at this point (mla_decode's kernel_choice: since s10/r2 split with
    # one token per sequence, tc with several)
    "auto": ("auto", {}, 0, 0),
    # the three-phase kernel (mla_decode_split, session 10): its defaults, then knobs
    "split": ("split", {}, 0, 0),
    "split s4": ("split", {"DECODESCOPE_MLA_SPLIT_SPLITS": "4"}, 0, 0),
    "split s17": ("split", {"DECODESCOPE_MLA_SPLIT_SPLITS": "17"}, 0, 0),  # first plan at 8x1
    "split nofuse": ("split", {"DECODESCOPE_MLA_SPLIT_FUSE": "0"}, 0, 0),
    "split s8": ("split", {"DECODESCOPE_MLA_SPLIT_SPLITS": "8"}, 0, 0),
    "split s9": ("split", {"DECODESCOPE_MLA_SPLIT_SPLITS": "9"}, 0, 0),
    "split s8 nbuf1": (
        "split",
        {"DECODESCOPE_MLA_SPLIT_SPLITS": "8", "DECODESCOPE_MLA_SPLIT_NBUF": "1"},
        0,
        0,
    ),
    "split s17 nbuf2": (
        "split",
        {"DECODESCOPE_MLA_SPLIT_SPLITS": "17", "DECODESCOPE_MLA_SPLIT_NBUF": "2"},
        0,
        0,
    ),
    "split fuse": ("split", {"DECODESCOPE_MLA_SPLIT_FUSE": "1"}, 0, 0),
    "split s8 nbuf1 fuse": (
        "split",
        {
            "DECODESCOPE_MLA_SPLIT_SPLITS": "8",
            "DECODESCOPE_MLA_SPLIT_NBUF": "1",
            "DECODESCOPE_MLA_SPLIT_FUSE": "1",
        },
        0,
        0,
    ),  # fmt: skip
    "split a1": ("split", {"DECODESCOPE_MLA_SPLIT_ACHUNKS": "1"}, 0, 0),
    "split a4": ("split", {"DECODESCOPE_MLA_SPLIT_ACHUNKS": "4"}, 0, 0),
    "split vr1": ("split", {"DECODESCOPE_MLA_SPLIT_VROWS": "1"}, 0, 0),
    "split vr8": ("split", {"DECODESCOPE_MLA_SPLIT_VROWS": "8"}, 0, 0),
    # the phases' timeline (%globaltimer per CTA: start, end of wait, end), recorded after the
    # check; then timed (the trace stores cost ~nothing)
    "split trace": ("split", {"DECODESCOPE_MLA_SPLIT_TRACE": "1"}, 0, 0),
    # timing only (wrong results by design, no check): the waits skipped
    "split diag": ("split", {"DECODESCOPE_MLA_SPLIT_DIAG": "1"}, 0, 0),
    # w_uk / w_uv L2 prefetch before the PDL wait (checked; alone, the weights stay in L2
    # between launches anyway: the gain shows in the layer)
    "split l2pre": ("split", {"DECODESCOPE_MLA_SPLIT_L2PRE": "1"}, 0, 0),
    # the W_UV phase's chain after its wait shortened (session 16)
    "split uvfast": ("split", {"DECODESCOPE_MLA_SPLIT_UVFAST": "1"}, 0, 0),
    "split uvfast trace": (
        "split",
        {"DECODESCOPE_MLA_SPLIT_UVFAST": "1", "DECODESCOPE_MLA_SPLIT_TRACE": "1"},
        0,
        0,
    ),
    "auto uvfast": ("auto", {"DECODESCOPE_MLA_SPLIT_UVFAST": "1"}, 0, 0),
    "split uv0": ("split", {"DECODESCOPE_MLA_SPLIT_UVFAST": "0"}, 0, 0),  # before session 16
    "split uvfast4": ("split", {"DECODESCOPE_MLA_SPLIT_UVFAST": "2"}, 0, 0),  # 4 MMA chains
    # the new rows' block on the split with the fewest cached blocks, filled before the wait
    "split tail": ("split", {"DECODESCOPE_MLA_SPLIT_TAIL": "1"}, 0, 0),
    "split tail trace": (
        "split",
        {"DECODESCOPE_MLA_SPLIT_TAIL": "1", "DECODESCOPE_MLA_SPLIT_TRACE": "1"},
        0,
        0,
    ),
    "split tail s8": (
        "split",
        {"DECODESCOPE_MLA_SPLIT_TAIL": "1", "DECODESCOPE_MLA_SPLIT_SPLITS": "8"},
        0,
        0,
    ),
    "auto tail": ("auto", {"DECODESCOPE_MLA_SPLIT_TAIL": "1"}, 0, 0),
    # the partials as (value, epoch) pairs, no fence after the attention phase
    "split ll": ("split", {"DECODESCOPE_MLA_SPLIT_LL": "1"}, 0, 0),
    "split tail ll": (
        "split",
        {"DECODESCOPE_MLA_SPLIT_LL": "1", "DECODESCOPE_MLA_SPLIT_TAIL": "1"},
        0,
        0,
    ),
    "split tail ll trace": (
        "split",
        {
            "DECODESCOPE_MLA_SPLIT_LL": "1",
            "DECODESCOPE_MLA_SPLIT_TAIL": "1",
            "DECODESCOPE_MLA_SPLIT_TRACE": "1",
        },
        0,
        0,
    ),
}
SWEEP = {  # point -> (heads per CTA, splits) of the ldsm variant
    "8x1": [(2, 0), (2, 3), (4, 4)],
    "16x1": [(2, 0), (3, 2), (6, 4)],
    "32x1": [(3, 2), (6, 0), (6, 2), (12, 4)],
    "64x1": [(3, 0), (6, 2), (12, 2), (12, 3)],
    "8x8": [(1, 4), (2, 2)],
}
DIAG = {"default diag": ("tc", {"DECODESCOPE_MLA_TC_DIAG": "1"}, 0, 0),
        "cluster diag": ("tc", {**CLUSTER, "DECODESCOPE_MLA_TC_DIAG": "1"}, 0, 0),
        "cluster-seq4 diag": ("tc", {**CLUSTER, "DECODESCOPE_MLA_TC_CLUSTER_SEQS": "4",
                                     "DECODESCOPE_MLA_TC_DIAG": "1"}, 0, 0)}  # fmt: skip


def save() -> None:
    if OUT["dir"] is not None:
        (OUT["dir"] / "results.json").write_text(json.dumps(RESULTS, indent=1))


def record(**kw) -> dict:
    RESULTS.append(kw)
    print(" ".join(f"{k}={v}" for k, v in kw.items() if k != "trace"), flush=True)
    if kw.get("status") == "error" and "trace" in kw:
        print(kw["trace"], file=sys.stderr, flush=True)
    save()
    return kw


def guarded(what: str, ctx: dict, fn):
    try:
        return fn()
    except Exception as e:  # one failure never stops the run
        record(check=what, **ctx, status="error", error=f"{type(e).__name__}: {e}"[:300],
               trace=traceback.format_exc())  # fmt: skip
        return None


class env:
    """Set environment variables for a block (restored after; "" removes one)."""

    def __init__(self, kv: dict):
        self.kv, self.old = kv, {}

    def __enter__(self):
        for k, v in self.kv.items():
            self.old[k] = os.environ.get(k)
            if v == "":
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __exit__(self, *exc):
        for k, v in self.old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rnd(*shape) -> torch.Tensor:
    return torch.randn(*shape, device=DEV).to(BF16)


def mla_weights(cfg, base: dict | None = None) -> dict:
    """Fresh ``kv_a_norm``, ``w_uk``, ``w_uv`` (``make_layer_weights``' distributions) on top of
    ``base`` (a whole layer's weights, shared: the standard layer needs the rest)."""
    m, nh = cfg.mla, cfg.mla_heads
    s = 1.0 / math.sqrt(m.kv_lora_rank)
    w = dict(base or {})
    w["kv_a_norm"] = (1 + 0.1 * torch.randn(m.kv_lora_rank, device=DEV)).to(BF16)
    w["w_uk"] = (torch.randn(nh, m.qk_nope_head_dim, m.kv_lora_rank, device=DEV) * s).to(BF16)
    w["w_uv"] = (torch.randn(nh, m.kv_lora_rank, m.v_head_dim, device=DEV) * s).to(BF16)
    return w


class Point:
    """Inputs of one (TP, BxT) point: ``n`` independent copies (cache, a, q, g, out, weights)."""

    def __init__(self, cfg, B: int, T: int, n: int, seed: int, base: dict | None):
        spec = LayerSpec(7, "mla", "moe")
        self.cfg, self.B, self.T, self.N = cfg, B, T, B * T
        self.ws, self.caches, self.ins, self.outs = [], [], [], []
        for i in range(n):
            self.ws.append(mla_weights(cfg, base))
            st = make_state(cfg, spec, B, T, seed=seed + i, device=DEV)
            self.caches.append(st["kv_cache"])
            self.ins.append((rnd(self.N, cfg.mla_qkv_a_out), rnd(self.N, cfg.mla_q_b_out),
                             rnd(self.N, cfg.mla_v_dim)))  # fmt: skip
            self.outs.append(torch.empty(self.N, cfg.mla_v_dim, dtype=BF16, device=DEV))
        self.cache0 = self.caches[0].clone()
        a, q, g = self.ins[0]
        self.ref, self.rcache = mla.mla_decode_ref(cfg, self.ws[0], a, q, g, self.cache0, T)

    def bytes(self) -> int:
        c = self.caches[0]
        w = sum(self.ws[0][k].numel() * 2 for k in ("w_uk", "w_uv"))
        io = sum(t.numel() * 2 for t in self.ins[0]) + self.outs[0].numel() * 2
        return c.numel() * c.element_size() + w + io

    def launch(self, i: int, kernel: str, hg: int, splits: int) -> None:
        a, q, g = self.ins[i]
        if kernel == "tc":
            mtc.mla_decode_tc(self.cfg, self.ws[i], a, q, g, self.caches[i], self.outs[i],
                              self.T, heads_per_cta=hg, splits=splits)  # fmt: skip
        elif kernel == "split":
            msp.mla_decode_split(self.cfg, self.ws[i], a, q, g, self.caches[i], self.outs[i],
                                 self.T)  # fmt: skip
        elif kernel == "auto":
            mla.mla_decode(self.cfg, self.ws[i], a, q, g, self.caches[i], self.outs[i], self.T)
        else:
            mla.mla_decode(self.cfg, self.ws[i], a, q, g, self.caches[i], self.outs[i], self.T,
                           heads_per_cta=hg, kernel="simt")  # fmt: skip


def check_variant(pt: Point, name: str, kernel: str, hg: int, splits: int, ctx: dict) -> bool:
    ctx_len = pt.cfg.context_len
    ok = True
    for rep in range(2):  # 1 launch, then 2 more (counters reset between launches)
        pt.caches[0].copy_(pt.cache0)
        pt.caches[0][:, ctx_len:].fill_(float("nan"))
        pt.outs[0].fill_(float("nan"))
        for _ in range(1 if rep == 0 else 2):
            pt.launch(0, kernel, hg, splits)
        torch.cuda.synchronize()
        out, rows = pt.outs[0], pt.caches[0][:, ctx_len:]
        written = bool(torch.isfinite(out.float()).all()) and bool(
            torch.isfinite(rows.float()).all()
        )
        e_out = R.rel_l2(out, pt.ref)
        e_rows = R.rel_l2(rows, pt.rcache[:, ctx_len:])
        old_ok = bool(torch.equal(pt.caches[0][:, :ctx_len], pt.cache0[:, :ctx_len]))
        extra = {}
        if kernel == "split":  # a wait that gave up (0.2 s) leaves its counter in the error word
            err = msp.error_word(msp.plan_for(pt.cfg, pt.B, pt.T), out.device)
            extra = {"error_word": err}
            try:  # diagnostics only: never the reason a check fails
                extra.update(split_phases(pt))
            except Exception as e:
                extra["phases_error"] = f"{type(e).__name__}: {e}"[:200]
            written = written and err == 0
        good = written and e_out < 2e-2 and e_rows < 1e-2 and old_ok
        ok = ok and good
        record(check=f"mla {name}" + (" (3 launches)" if rep else ""), **ctx,
               rel_l2=f"{e_out:.2e}", rows_rel_l2=f"{e_rows:.2e}", all_written=written,
               old_rows_kept=old_ok, **extra, status="ok" if good else "FAIL")  # fmt: skip
        if kernel == "split" and rep == 1:
            p = msp.plan_for(pt.cfg, pt.B, pt.T)
            if p.trace:  # the last launch's timeline, us from its first CTA's start
                record(what=f"mla {name} timeline", **ctx, **msp.trace_summary(p, out.device),
                       status="info")  # fmt: skip
    return ok


def split_phases(pt: Point) -> dict:
    """Where a wrong split result comes from (the last launch of copy 0, from its workspace):
    ``q_lat`` (phase 1) vs ``q_nope @ w_uk`` scaled; the partials merged in torch (phase 2) vs
    the softmax over the cache with the kernel's own ``q_lat`` (so each phase is judged from its
    inputs); the output (phase 3) is the check's ``rel_l2``."""
    cfg, m, T, B = pt.cfg, pt.cfg.mla, pt.T, pt.B
    nh, kvl, ctx = cfg.mla_heads, m.kv_lora_rank, cfg.context_len
    p = msp.plan_for(cfg, B, T)
    ql, part = msp.workspace(p, DEV)[:2]
    a, q, g = pt.ins[0]
    qf = q.float().view(pt.N, nh, m.qk_head_dim)
    scale = 1.0 / math.sqrt(m.qk_head_dim)
    ql_ref = torch.einsum("nhd,hdl->nhl", qf[..., : m.qk_nope_head_dim], pt.ws[0]["w_uk"].float())
    e_ql = R.rel_l2(ql.float(), ql_ref * scale)
    G, S, Rg = p.groups, p.splits, p.rows  # head groups: partials [B, G*S, 16, kvl + 4]
    P = part.view(B, G, S, part.shape[2], -1)[:, :, :, :Rg].double()
    P = P.permute(0, 2, 1, 3, 4).reshape(B, S, G * Rg, -1)  # [B, S, R, kvl + 4], row h*T + t
    mm, ll = P[..., kvl], P[..., kvl + 1]
    wts = torch.exp(mm - mm.max(1, keepdim=True).values)
    o_part = (P[..., :kvl] * wts[..., None]).sum(1) / (ll * wts).sum(1)[..., None]  # [B, R, kvl]
    keys = pt.caches[0].double()  # with the new rows (the check's launch wrote them)
    q576 = torch.cat([ql.double().view(B, T, nh, kvl),
                      (qf[..., m.qk_nope_head_dim :].double() * scale).view(B, T, nh, -1)], -1)  # fmt: skip
    o_ref = torch.empty(B, nh * T, kvl, dtype=torch.float64, device=DEV)
    for t in range(T):
        k = keys[:, : ctx + t + 1]
        sc = torch.einsum("bhl,bsl->bhs", q576[:, t], k)
        o_ref[:, t::T] = torch.einsum("bhs,bsl->bhl", torch.softmax(sc, -1), k[..., :kvl])
    return {"q_lat_rel_l2": f"{e_ql:.2e}", "o_lat_rel_l2": f"{R.rel_l2(o_part, o_ref):.2e}"}


def time_variant(pt: Point, name: str, kernel: str, hg: int, splits: int, ctx: dict,
                 replays: int, floor: float, base_us: dict) -> None:  # fmt: skip
    n = len(pt.caches)
    med, lo, hi = graph_time_us([(lambda i=i: pt.launch(i, kernel, hg, splits))
                                 for i in range(n)], replays)  # fmt: skip
    extra = {}
    if kernel == "tc":
        p = mtc.plan_for(pt.cfg, pt.B, pt.T, hg, splits)
        extra = {"hg": p.hg, "splits": p.splits, "ctas": p.groups * p.batch * p.splits,
                 "ldsm": int(p.ldsm), "cluster": p.csize if p.clustered else 0}  # fmt: skip
    elif kernel == "split":
        p = msp.plan_for(pt.cfg, pt.B, pt.T)
        extra = {"splits": p.splits, "groups": p.groups, "ctas": p.grid,
                 "items": f"{p.n_abs}+{p.n_att}+{p.n_uv}",
                 "fused": int(p.fused),
                 "nbuf": p.nbuf, "achunks": p.achunks, "vrows": p.vrows,
                 "ctas_per_sm": p.ctas_per_sm, "uvfast": p.uvfast, "tail": p.tail,
                 "ll": int(p.ll_parts),
                 "blk_max": p.blk_max}  # fmt: skip
    elif kernel == "auto":
        extra = {"kernel": mla.kernel_choice(pt.caches[0].dtype, "", pt.B, pt.T, pt.cfg)}
    base_us[name] = med
    ref = base_us.get("default")
    record(time=f"mla {name}", **ctx, **extra, us=f"{med:.1f}", us_min=f"{lo:.1f}",
           us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}", eff=f"{med / floor:.2f}",
           vs_default=f"{ref / med:.2f}" if ref else "", copies=n, status="time")  # fmt: skip


def std_ops(layer) -> None:
    """The standard path's kernels for the fused kernel's ops (``StandardLayer._mla_forward``
    from the w_uk bmm to the gate multiply, without its ranges)."""
    from decodescope.kernels.standard import layers as SL

    cfg, w, m = layer.cfg, layer.w, layer.cfg.mla
    q3 = layer.mla_q.view(layer.N, cfg.mla_heads, m.qk_head_dim)
    torch.bmm(q3[:, :, : m.qk_nope_head_dim].transpose(0, 1), w["w_uk"], out=layer.q_lat_h)
    k_pe = layer.mla_a[:, m.q_lora_rank + m.kv_lora_rank :]
    cache = layer.state["kv_cache"]
    key = "vllm" if layer._impl_ins.startswith("vllm:") else layer._impl_ins
    layer._ins[key](layer.kv_n, k_pe, cache)
    layer._dec[layer._impl_dec](layer.q_lat_h.transpose(0, 1), q3[:, :, m.qk_nope_head_dim :],
                                cache, layer.o_lat_h)  # fmt: skip
    torch.bmm(layer.o_lat_h, w["w_uv"], out=layer.o_v_h)
    if layer.mla_gate is not None:
        if layer._impl_gate == SL.TRITON:
            SL.tk.gate_mul(layer.o_v_h, layer.mla_gate, layer.o_gated)
        else:
            SL.O.gate_mul_torch(layer.o_v_h, layer.mla_gate, layer.o_gated)


def time_standard(pt: Point, ctx: dict, replays: int, floor: float, base_us: dict) -> None:
    from decodescope.kernels.standard.layers import StandardLayer
    from decodescope.kernels.standard.ops import Ops

    cfg, spec = pt.cfg, LayerSpec(7, "mla", "moe")
    ops = Ops(DEV)
    layers = []
    for i in range(len(pt.caches)):
        st = {"kv_cache": pt.caches[i]}
        lay = StandardLayer(cfg, spec, pt.ws[i], st, pt.B, pt.T, ops, torch.cuda.Stream(DEV), 1)
        a, q, g = pt.ins[i]
        lay.mla_a.copy_(a)
        lay.mla_q.copy_(q)
        if lay.mla_gate is not None:
            lay.mla_gate.copy_(g)
        lay.kv_n.copy_(a[:, cfg.mla.q_lora_rank : cfg.mla.q_lora_rank + cfg.mla.kv_lora_rank])
        layers.append(lay)
    impl = {"decode": layers[0]._impl_dec, "insert": layers[0]._impl_ins,
            "gate": layers[0]._impl_gate}  # fmt: skip
    med, lo, hi = graph_time_us([(lambda lay=lay: std_ops(lay)) for lay in layers], replays)
    ref = base_us.get("default")
    record(time="standard kernels (bmm, insert, decode, bmm, gate)", **ctx, impl=impl,
           us=f"{med:.1f}", us_min=f"{lo:.1f}", us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}",
           eff=f"{med / floor:.2f}", vs_default=f"{ref / med:.2f}" if ref else "",
           copies=len(layers), status="time")  # fmt: skip


def run_point(cfg, tp: int, pt_name: str, a, bw: float, base: dict | None) -> None:
    B, T = (int(v) for v in pt_name.split("x"))
    ctx = {"tp": tp, "point": pt_name}
    one = cfg.context_len * B * cfg.mla.latent_dim * 2 + 3 * 2**20
    n = max(2, math.ceil(3 * L2_BYTES / one))
    pt = Point(cfg, B, T, n, seed=1000 * tp + 10 * B + T, base=base)
    floor = pt.bytes() / (bw * 1e6)
    variants = {k: v for k, v in VARIANTS.items() if k in a.variants}
    if B * T > 16:
        variants.pop("simt", None)
    if not mla.split_fits(pt.cfg, B, T):  # the split kernel: 1..16 tokens, in head groups
        skipped = [k for k, v in variants.items() if v[0] == "split"]
        variants = {k: v for k, v in variants.items() if v[0] != "split"}
        if skipped:
            record(what="skipped (split does not fit)", **ctx, variants=",".join(skipped),
                   status="info")  # fmt: skip
    for k in [k for k in variants if k.startswith("cluster-seq")]:
        if T > 1 or B % int(k.split()[0].removeprefix("cluster-seq")):  # 1 token, whole clusters
            variants.pop(k)
    if not a.no_sweep and tp == a.tp[0]:  # the sweep at the first TP only
        for hg, sp in SWEEP.get(pt_name, ()):
            if cfg.mla_heads % hg == 0 and hg * T <= mtc.ROWS:
                variants[f"ldsm hg{hg} s{sp}"] = ("tc", LDSM, hg, sp)
    base_us: dict = {}
    for name, (kernel, venv, hg, sp) in variants.items():
        with env({**BASE, **venv}):
            if name.endswith("diag"):  # wrong results by design: timed only
                ok = True
            else:
                ok = guarded(
                    f"check {name}", ctx, partial(check_variant, pt, name, kernel, hg, sp, ctx)
                )
            if ok and not a.no_timing:
                guarded(f"time {name}", ctx, partial(time_variant, pt, name, kernel, hg, sp, ctx,
                                                     a.replays, floor, base_us))  # fmt: skip
    if not a.no_timing and not a.no_diag and pt_name in a.diag_points:
        for name, (kernel, venv, hg, sp) in DIAG.items():
            with env({**BASE, **venv}):
                guarded(f"time {name}", ctx, partial(time_variant, pt, name, kernel, hg, sp, ctx,
                                                     a.replays, floor, base_us))  # fmt: skip
    if not a.no_timing and not a.no_standard and base is not None:
        guarded("time standard", ctx, partial(time_standard, pt, ctx, a.replays, floor, base_us))
    del pt
    torch.cuda.empty_cache()


def table_md() -> str:
    lines = ["| tp | point | what | hg | splits | CTAs | us | min | max | floor | us/floor "
             "| default/us |", "|" + "---|" * 12]  # fmt: skip
    for r in RESULTS:
        if r.get("status") == "time":
            lines.append(
                f"| {r['tp']} | {r['point']} | {r['time']} | {r.get('hg', '')} "
                f"| {r.get('splits', '')} | {r.get('ctas', '')} | {r['us']} | {r['us_min']} "
                f"| {r['us_max']} | {r['floor_us']} | {r['eff']} | {r.get('vs_default', '')} |"
            )
    lines += [
        "",
        "| tp | point | check | rel_l2 out | rel_l2 rows | result |",
        "|---|---|---|---|---|---|",
    ]
    for r in RESULTS:
        if r.get("status") in ("ok", "FAIL", "error") and "check" in r:
            res = "PASS" if r["status"] == "ok" else r["status"]
            lines.append(f"| {r.get('tp', '')} | {r.get('point', '')} | {r['check']} "
                         f"| {r.get('rel_l2', '')} | {r.get('rows_rel_l2', '')} "
                         f"| {res} {r.get('error', '')} |")  # fmt: skip
    for r in RESULTS:
        if r.get("status") == "skipped":
            lines.append(f"| {r['tp']} | {r['point']} | skipped (--budget) | | | |")
    oks = sum(1 for r in RESULTS if r.get("status") == "ok")
    bad = sum(1 for r in RESULTS if r.get("status") in ("FAIL", "error"))
    lines += ["", f"checks: {oks} PASS, {bad} FAIL or error"]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/mla_tc")
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--points", nargs="+", default=["8x1", "16x1", "32x1", "64x1", "8x8"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-diag", action="store_true")
    ap.add_argument("--diag-points", nargs="+", default=["32x1", "64x1"],
                    help="points of the diag timings")  # fmt: skip
    ap.add_argument("--no-standard", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--budget", type=float, default=480,
                    help="seconds: later points are skipped (and listed) past it")  # fmt: skip
    a = ap.parse_args()
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known {list(VARIANTS)}")
    OUT["dir"] = Path(a.out)
    OUT["dir"].mkdir(parents=True, exist_ok=True)
    torch.manual_seed(4321)
    bw = guarded("copy_bw", {}, copy_bandwidth_tbs) or 4.22
    record(what="copy_bw_tbs", value=f"{bw:.3f}", gpu=torch.cuda.get_device_name(),
           status="info")  # fmt: skip
    t0 = time.time()
    for tp in a.tp:
        cfg = get_config("kimi-k3", tp)
        base = None  # the whole layer's weights, for the standard layer (shared by the copies)
        if not a.no_timing and not a.no_standard:
            base = guarded("weights", {"tp": tp}, lambda cfg=cfg: make_layer_weights(
                cfg, LayerSpec(7, "mla", "moe"), 0, DEV))  # fmt: skip
        for pt in a.points:
            if time.time() - t0 > a.budget:
                record(what="skipped", tp=tp, point=pt, status="skipped")
                continue
            t1 = time.time()
            guarded("point", {"tp": tp, "point": pt}, partial(run_point, cfg, tp, pt, a, bw, base))
            record(what="point done", tp=tp, point=pt, seconds=f"{time.time() - t1:.0f}",
                   total_s=f"{time.time() - t0:.0f}", status="info")  # fmt: skip
    table = table_md()
    (OUT["dir"] / "table.md").write_text(table + "\n")
    save()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
