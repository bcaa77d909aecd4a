"""Specialized LatentMoE on the H200: every correctness check, then a timing table.

    python scripts/gpu_specialized_moe.py --out results/specialized_moe [--tp 8 16]
        [--tokens 1 8 32 64] [--copies 3] [--replays 30] [--variants pipe old] [--quick]

``--variants``: the expert kernels to check and time side by side (``DECODESCOPE_MOE_EXPERTS``:
``pipe``, the bulk-copy pipeline, ``old``, weights into registers per tile, and ``grouped``,
the three non-persistent tensor-core launches of ``moe_grouped``, which get their own probe
child and a ``grouped_route_lists`` check; ``grouped_split``: the same with the route
kernel's top-k split over CTAs, ``DECODESCOPE_MOE_GROUPED_ROUTE=split``; ``grouped_ring``:
split, w13 and w2 weights streamed through per-lane cp.async rings; ``grouped_thresh``:
``grouped_ring`` with the route's threshold top-k, ``DECODESCOPE_MOE_GROUPED_ROUTE=thresh``,
plus ``route_thresh_identical_*`` checks: ids and weights bit for bit against ``split``); the
front and back kernels and the standard block are timed once. Each variant first runs once
under a hang watchdog (a hung kernel cannot be recovered in-process: the run writes what it has
and exits 3).
``--quick``: one draw, no front-norm checks or timings. On the grouped variants the ``tile``
front (``DECODESCOPE_MOE_FRONT=tile``: the tile GEMM with FP32 out, ``acc`` zeroed by the route
kernel) is probed, checked (``front_gemv_tile``, ``*_front_tile`` chain checks with ``acc``
poisoned, a graph replay) and timed (``front_tile``, ``block_front_tile``,
``grouped_route_zero_acc``) beside the others.

Checks (fresh random inputs, outputs poisoned with NaN first), per (TP shape, tokens):
front GEMV vs its ref; zeroing of acc/done; top-k ids/weights vs ``router_topk_ref`` on the
kernel's own logits; routed latent sum and shared output vs ``moe_experts_ref`` (the kernel's
ids); up-projection vs its ref; the block vs the float32 reference of the math
(``reference.moe_ref`` with the kernel's ids) and vs the standard path's MoE block (rows whose
routing agrees). Timing: CUDA-graph replay medians (per kernel and per block, standard block
beside), weights rotated past L2 over ``--copies`` independent layers, with the bytes floor at
the measured copy bandwidth. One failing piece is recorded and the run goes on. Results:
``results.json`` and ``table.md`` under ``--out``; the table is printed last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from decodescope.kernels.bandwidth import copy_bandwidth_tbs
from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.reference import moe_ref, rel_l2
from decodescope.kernels.specialized import moe_block as mb
from decodescope.kernels.specialized import moe_experts as me
from decodescope.kernels.specialized import moe_grouped as mg
from decodescope.kernels.specialized import router_topk as rt
from decodescope.kernels.specialized import up_proj_shared_add as up
from decodescope.kernels.timing import graph_time_us
from decodescope.kernels.weights import make_layer_weights, make_state

DEV = torch.device("cuda")
BF16 = torch.bfloat16
RESULTS: list[dict] = []
JSONL: list[Path] = []  # results.jsonl under --out: every record appended as it is made
START = time.time()
USER_FRONT = os.environ.get("DECODESCOPE_MOE_FRONT")  # the caller's choice, kept per point
FRONTS = ["simt", "mma"]  # front kernels checked and timed (mma dropped where its probe failed;
# "tile" added on the grouped variants where its probe passed)
BACKS = ["simt", "mma"]  # the same for the back kernels
# BackMma A/B variants beside the plain back kernels: (name, environment), checked and timed.
# s8/r1 (H200 TP8, 64 tokens): post 48.6 us (now the default), pre 62.6, post with 2 row tiles
# per CTA 70.8, pre with 2: 91.0
BACK_AB = [
    ("mma_pre", {"DECODESCOPE_MOE_BACK": "mma", "DECODESCOPE_MOE_BACK_NORM": "pre"}),
    # the cp.async ring from 17 tokens too (ptxas: 112 registers at 32 tokens against 138; 255
    # with spills at 64)
    ("mma_ring", {"DECODESCOPE_MOE_BACK": "mma", "DECODESCOPE_MOE_MMA_LOAD": "ring"}),
    # the back on the tile GEMM (back_tile; its own A/B script: scripts/gpu_back_tile.py)
    ("tile", {"DECODESCOPE_MOE_BACK": "tile"}),
]
USER_BACK = os.environ.get("DECODESCOPE_MOE_BACK")


def record(**kw) -> dict:
    RESULTS.append(kw)
    for path in JSONL:
        with open(path, "a") as f:
            f.write(json.dumps(kw, default=str) + "\n")
    status = kw.get("status", "")
    print(" ".join(f"{k}={v}" for k, v in kw.items() if k != "trace"), flush=True)
    if status == "error" and "trace" in kw:
        print(kw["trace"], file=sys.stderr, flush=True)
    return kw


def guarded(what: str, ctx: dict, fn):
    try:
        return fn()
    except Exception as e:  # never abort the run on one failure
        record(check=what, **ctx, status="error", error=f"{type(e).__name__}: {e}"[:300],
               trace=traceback.format_exc())  # fmt: skip
        return None


def under(f, **kv):
    """``f`` called with the environment variables ``kv`` set (also while a graph captures)."""

    def g():
        with env(**kv):
            return f()

    return g


@contextlib.contextmanager
def env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items()})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check(what: str, ctx: dict, err: float, tol: float) -> bool:
    ok = bool(err <= tol)  # NaN fails
    record(check=what, **ctx, err=f"{err:.3e}", tol=tol, status="pass" if ok else "FAIL")
    return ok


# -- correctness ------------------------------------------------------------------------------


def run_checks(cfg, w, blk: mb.SpecializedMoE, N: int, ctx: dict, seed: int,
               front_norm: bool = True, fronts: bool = True) -> None:  # fmt: skip
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = torch.randn(N, cfg.hidden, device=DEV, generator=g).to(BF16)

    # 1. front GEMV + zeroing
    blk.y_front.fill_(float("nan"))
    blk.acc.fill_(float("nan"))
    blk.done.fill_(12345)
    blk.front(h)
    torch.cuda.synchronize()
    yref = rt.front_gemv_ref(h, blk.w_front)
    check("front_gemv", ctx, rel_l2(front_logits(blk), yref), 1e-4)
    if blk.route_zeroes_acc():  # the tile front (auto from 32 tokens with grouped experts)
        record(check="front_zeroes_acc_done", **ctx, status="info",
               note="tile front: acc zeroed by the route kernel (the *_front_tile checks)")  # fmt: skip
    else:
        zero_ok = bool((blk.acc == 0).all()) and bool((blk.done == 0).all())
        record(check="front_zeroes_acc_done", **ctx, status="pass" if zero_ok else "FAIL")
    # every front kernel explicitly (the default picks one by token count); the tile front on
    # every grouped variant (its chain differs: the route kernel zeroes acc)
    fvs = FRONTS if fronts else [f for f in FRONTS if f == "tile"]
    if fvs:
        for fv in fvs:
            blk.y_front.fill_(float("nan"))
            blk.acc.fill_(float("nan"))
            blk.done.fill_(12345)
            with env(DECODESCOPE_MOE_FRONT=fv):
                blk.front(h)
            torch.cuda.synchronize()
            check(f"front_gemv_{fv}", ctx, rel_l2(blk.y_front, yref), 1e-4)
            if fv == "tile":  # zeroes nothing by design: check the chain it runs in instead
                guarded("front_tile_chain", ctx, lambda: _tile_chain_checks(cfg, w, blk, h, ctx))
                continue
            zero_ok = bool((blk.acc == 0).all()) and bool((blk.done == 0).all())
            record(check=f"front_zeroes_{fv}", **ctx, status="pass" if zero_ok else "FAIL")
        blk.front(h)
        torch.cuda.synchronize()

    # 1b. front kernel with the residual-add + RMSNorm prologue
    if front_norm:
        _front_norm_checks(cfg, w, blk, N, ctx, g)
        blk.front(h)  # back to the plain path for the checks below
        torch.cuda.synchronize()
    _expert_checks(cfg, w, blk, h, N, ctx, fronts)


def front_logits(blk) -> torch.Tensor:
    """The front's output as the checks compare it: ``y_front``, and where the front ran the
    one-token route early (``DECODESCOPE_MOE_T1_EARLY``: router logits in K parts, summed by the
    route kernel, which has not run yet) a copy with the parts added in the route's order."""
    early = getattr(blk, "_early_now", None)
    if early is None:
        return blk.y_front
    rks, part, _ = early
    y = blk.y_front.clone()
    E = part.numel() // (rks - 1)
    for p in part.view(rks - 1, E):
        y[0, :E] += p
    return y


def _tile_chain_checks(cfg, w, blk, h, ctx) -> None:
    """The tile front (``DECODESCOPE_MOE_FRONT=tile``) in its chain: with ``acc`` poisoned (NaN)
    before the front, the grouped route kernel must zero it (``zero_acc``) before GroupedW2
    adds into it: routed sum and shared output vs ``moe_experts_ref`` on the tile front's own
    ``y`` and the kernel's ids; then the whole block (``acc`` now holding the last sum: zeroed
    again?) vs the float32 reference, eager and as a CUDA graph replayed twice."""
    with env(DECODESCOPE_MOE_FRONT="tile"):
        blk.y_front.fill_(float("nan"))
        blk.acc.fill_(float("nan"))
        blk.shared_out.fill_(float("nan"))
        blk.front(h)
        blk.experts()
        torch.cuda.synchronize()
        y = blk.y_front.clone()
        acc_r, sh_r = _experts_ref(cfg, w, blk, y)
        check("routed_latent_sum_front_tile", ctx, rel_l2(blk.acc, acc_r), 5e-3)
        check("shared_out_front_tile", ctx, rel_l2(blk.shared_out, sh_r), 5e-3)
        out = torch.full((h.shape[0], cfg.hidden), float("nan"), dtype=BF16, device=DEV)
        blk.forward(h, out)
        torch.cuda.synchronize()
        ref, _ = moe_ref(cfg, w, h, topk_ids=blk.topk_ids, dtype=torch.float32)
        check("block_vs_reference_front_tile", ctx, rel_l2(out, ref), 2e-2)
        out_g = torch.full_like(out, float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            blk.forward(h, out_g)
        for _ in range(2):
            graph.replay()
        torch.cuda.synchronize()
        check("block_graph_front_tile", ctx, rel_l2(out_g, out), 1e-3)


def _front_norm_checks(cfg, w, blk, N, ctx, g) -> None:
    xa = torch.randn(N, cfg.hidden, device=DEV, generator=g).to(BF16)
    ra = torch.randn(N, cfg.hidden, device=DEV, generator=g).to(BF16)
    r_out = torch.full_like(xa, float("nan"))
    blk.y_front.fill_(float("nan"))
    blk.front_residual(xa, ra, r_out)
    torch.cuda.synchronize()
    h_ref, r_ref = rt.residual_norm_ref(xa, ra, w["mlp_norm"], cfg.eps)
    check("front_residual_norm", ctx, rel_l2(blk.y_front, rt.front_gemv_ref(h_ref, blk.w_front)),
          5e-3)  # fmt: skip
    check("front_residual_out", ctx, rel_l2(r_out, r_ref), 1e-6)
    blk.y_front.fill_(float("nan"))
    blk.front_norm(ra)  # norm only (the residual already added upstream)
    torch.cuda.synchronize()
    h_ref, _ = rt.residual_norm_ref(ra, torch.zeros_like(ra), w["mlp_norm"], cfg.eps)
    check("front_norm", ctx, rel_l2(blk.y_front, rt.front_gemv_ref(h_ref, blk.w_front)), 5e-3)


def _expert_checks(cfg, w, blk, h, N, ctx, fronts: bool = True) -> None:
    e = cfg.moe
    E, k = e.num_experts, e.top_k
    # 2. experts (routing in its prologue)
    y = front_logits(blk).clone()
    blk.h.fill_(float("nan"))
    blk.shared_out.fill_(float("nan"))
    blk.topk_ids.fill_(-1)
    blk.topk_weights.fill_(float("nan"))
    gb = getattr(blk, "_grouped_bufs", None) if blk._grouped() else None
    if gb is not None:  # the grouped kernels' lists and shared SiTU, poisoned too
        for t in (gb.pairs, gb.slot_e, gb.slot_off, gb.slot_n, gb.nact):
            t.fill_(-7)
        gb.hs.fill_(float("nan"))
    blk.experts()
    torch.cuda.synchronize()
    if gb is not None:
        _grouped_route_check(blk, gb, E, ctx)
        guarded("grouped_h", ctx, lambda: _grouped_h_check(cfg, w, blk, y, ctx))
        if mg.route_mode() == "thresh":
            guarded("route_thresh_identical", ctx,
                    lambda: _route_thresh_identical(blk, y, E, ctx))  # fmt: skip
    ids_r, tw_r = rt.router_topk_ref(y[:, :E], w["router_bias"], k, e.routed_scaling)
    ids = blk.topk_ids.long()
    same = (ids.sort(1).values == ids_r.long().sort(1).values).all(1)
    record(check="topk_ids", **ctx, agree=f"{int(same.sum())}/{N}",
           status="pass" if bool(same.float().mean() >= 0.95) else "FAIL")  # fmt: skip
    tw_k = torch.sigmoid(y[:, :E].double()).gather(1, ids)
    tw_k = (tw_k / tw_k.sum(-1, keepdim=True) * e.routed_scaling).float()
    check("topk_weights", ctx, rel_l2(blk.topk_weights, tw_k), 1e-5)
    acc_r, sh_r = _experts_ref(cfg, w, blk, y)
    check("routed_latent_sum", ctx, rel_l2(blk.acc, acc_r), 5e-3)
    check("shared_out", ctx, rel_l2(blk.shared_out, sh_r), 5e-3)

    # 3. up-projection + shared add
    out = torch.full((N, cfg.hidden), float("nan"), dtype=BF16, device=DEV)
    acc = blk.acc.clone()
    blk.back(out)
    torch.cuda.synchronize()
    ref3 = up.up_proj_shared_add_ref(acc, w["latent_norm"], w["latent_up"], blk.shared_out, cfg.eps)
    check("up_proj_shared_add", ctx, rel_l2(out, ref3), 1e-2)
    for bv in BACKS if fronts else []:  # both back kernels explicitly
        out.fill_(float("nan"))
        with env(DECODESCOPE_MOE_BACK=bv):
            blk.back(out)
        torch.cuda.synchronize()
        check(f"up_proj_shared_add_{bv}", ctx, rel_l2(out, ref3), 1e-2)
    for name, kv in BACK_AB if "mma" in BACKS and fronts else []:
        out.fill_(float("nan"))
        with env(**kv):
            guarded(f"back_{name}", ctx, lambda: blk.back(out))
        torch.cuda.synchronize()
        check(f"up_proj_shared_add_{name}", ctx, rel_l2(out, ref3), 1e-2)

    # 4. whole block vs the float32 reference of the math, and vs the standard path
    out.fill_(float("nan"))
    blk.forward(h, out)
    torch.cuda.synchronize()
    ref, _ = moe_ref(cfg, w, h, topk_ids=blk.topk_ids, dtype=torch.float32)
    check("block_vs_reference", ctx, rel_l2(out, ref), 2e-2)
    guarded("block_vs_standard", ctx, lambda: _vs_standard(cfg, w, h, blk, out, N, ctx))


def _experts_ref(cfg, w, blk, y):
    """``moe_experts_ref`` of the block's own routing and front output ``y``: (routed latent
    sum, shared output)."""
    E, L = cfg.moe.num_experts, cfg.expert_dim
    return me.moe_experts_ref(
        y[:, E : E + L], y[:, E + L :], blk.topk_ids, blk.topk_weights, w["w13"], w["w2"],
        w["shared_w2"], cfg.model.situ_beta, cfg.model.situ_linear_beta,
    )  # fmt: skip


def _grouped_h_check(cfg, w, blk, y, ctx: dict) -> None:
    """The w13 kernel's output alone: ``h [T*k, Ie]`` (poisoned with NaN before the experts ran)
    against ``bf16(SiTU(w13[e] @ bf16(z_t)))`` per pair, on the kernel's own ids; with
    ``DECODESCOPE_MOE_GROUPED_W13=tile`` also named ``grouped_h_w13tile``."""
    E, L, Ie = cfg.moe.num_experts, cfg.expert_dim, cfg.expert_inter
    from decodescope.kernels.reference import situ_ref

    k = blk.top_k
    zb = y[:, E : E + L].to(BF16).float()
    ids = blk.topk_ids.long().reshape(-1)
    ref = torch.empty(ids.numel(), Ie, dtype=torch.float32, device=DEV)
    for e in torch.unique(ids).tolist():
        p = torch.nonzero(ids == e).flatten()
        gu = zb[p // k] @ w["w13"][e].float().T
        ref[p] = situ_ref(gu[:, :Ie], gu[:, Ie:], cfg.model.situ_beta,
                          cfg.model.situ_linear_beta).to(BF16).float()  # fmt: skip
    name = "grouped_h_w13tile" if mg.w13_mode() == "tile" else "grouped_h"
    check(name, ctx, rel_l2(blk.h.float(), ref), 5e-3)


def _grouped_route_check(blk, gb, E: int, ctx: dict) -> None:
    """The grouped route kernel's lists equal those of its own ids (order inside an expert
    free): active count, experts, offsets, counts, pairs."""
    se, so, sn, nact, pairs = mg.lists_from_ids(blk.topk_ids, E)
    got_n = int(gb.nact[0])
    ok = got_n == nact
    if ok:
        gse, gso, gsn = (t[:nact].cpu() for t in (gb.slot_e, gb.slot_off, gb.slot_n))
        gp = mg.canonical_pairs(gb.pairs.cpu(), gso, gsn)
        ok = all(torch.equal(a, b) for a, b in ((gse, se), (gso, so), (gsn, sn), (gp, pairs)))
    record(check="grouped_route_lists", **ctx, nact=f"{got_n}/{nact}",
           status="pass" if ok else "FAIL")  # fmt: skip


def _route_thresh_identical(blk, y: torch.Tensor, E: int, ctx: dict) -> None:
    """The threshold top-k (``DECODESCOPE_MOE_GROUPED_ROUTE=thresh``) against the rounds of the
    ``split`` route kernel on the same logits: ids and weights bit for bit, lists equal to
    those of the ids. Inputs: the block's own logits and bias; the logits quantized to quarters
    with a zero bias (many exact ties across the threshold); and with row 0 all zero as well
    (every expert tied: more than ``route_topk.CAP`` candidates, the fallback to the rounds)."""
    k = blk.top_k
    yq = y.clone()
    yq[:, :E] = torch.round(yq[:, :E] * 4) / 4
    yz = yq.clone()
    yz[0, :E] = 0.0
    b0 = torch.zeros_like(blk.bias)
    from decodescope.kernels.specialized import experts_t1 as et1

    # DECODESCOPE_MOE_T1_ROUTE=w13: the w13 kernel (part 1) ranks the token, no route kernel
    rparts = (0, 1) if blk.N == 1 and et1.route_where() == "w13" else (0,)
    for name, yin, bias in (("logits", y, blk.bias), ("quantized", yq, b0), ("row0_tied", yz, b0)):
        got = {}
        for mode in ("split", "thresh"):
            # split: the grouped route kernel's rounds even where DECODESCOPE_MOE_T1_ROUTE=t1
            # (experts_t1.RouteT1) or w13 (experts_t1.W13T1Route) runs the thresh side
            t1r = {"DECODESCOPE_MOE_T1_ROUTE": ""} if mode == "split" else {}
            parts = (0,) if mode == "split" else rparts
            with env(DECODESCOPE_MOE_GROUPED_ROUTE=mode, **t1r):
                gb = mg.GroupedBuffers(blk.N, E, k, blk.cfg.shared_inter, DEV)
                ids = torch.full((blk.N, k), -1, dtype=torch.int32, device=DEV)
                tw = torch.full((blk.N, k), float("nan"), dtype=torch.float32, device=DEV)
                mg.moe_grouped(
                    yin, bias, blk.w13, blk.w2, blk.shared_w2, blk.h, blk.acc,
                    blk.shared_out, ids, tw, gb, top_k=k, scaling=blk.scaling, beta=blk.beta,
                    lbeta=blk.lbeta, parts=parts,
                )  # fmt: skip
                for _ in range(2):  # again: the arrival counter must have reset itself
                    mg.moe_grouped(
                        yin, bias, blk.w13, blk.w2, blk.shared_w2, blk.h, blk.acc,
                        blk.shared_out, ids, tw, gb, top_k=k, scaling=blk.scaling,
                        beta=blk.beta, lbeta=blk.lbeta, parts=parts,
                    )  # fmt: skip
                torch.cuda.synchronize()
                got[mode] = (ids.cpu(), tw.cpu(), gb)
        (ia, wa, _), (ib, wb, gbt) = got["split"], got["thresh"]
        se, so, sn, nact, pairs = mg.lists_from_ids(ib, E)
        lists_ok = int(gbt.nact[0]) == nact
        if lists_ok:
            gse, gso, gsn = (t[:nact].cpu() for t in (gbt.slot_e, gbt.slot_off, gbt.slot_n))
            gp = mg.canonical_pairs(gbt.pairs.cpu(), gso, gsn)
            lists_ok = all(torch.equal(a, b) for a, b in
                           ((gse, se), (gso, so), (gsn, sn), (gp, pairs)))  # fmt: skip
        same_ids = torch.equal(ia, ib)
        same_w = torch.equal(wa.view(torch.int32), wb.view(torch.int32))
        rows = int((ia == ib).all(1).sum())
        record(check=f"route_thresh_identical_{name}", **ctx, rows_same_ids=f"{rows}/{blk.N}",
               same_weights_bits=same_w, lists=lists_ok,
               status="pass" if (same_ids and same_w and lists_ok) else "FAIL")  # fmt: skip


def _standard_layer(cfg, w, N: int):
    from decodescope.kernels.standard.layers import StandardLayer
    from decodescope.kernels.standard.ops import Ops

    spec = LayerSpec(1, "kda", "moe")
    state = make_state(cfg, spec, N, 1, 0, DEV)
    return StandardLayer(cfg, spec, w, state, N, 1, Ops(DEV), side_stream=torch.cuda.Stream())


def _vs_standard(cfg, w, h, blk, out, N, ctx) -> None:
    std = _standard_layer(cfg, w, N)
    std.h.copy_(h)
    o_std = torch.full_like(out, float("nan"))
    std._moe_forward(o_std)
    torch.cuda.synchronize()
    a = blk.topk_ids.long().sort(1).values
    b = std.topk_ids.long().sort(1).values
    rows = (a == b).all(1)
    n = int(rows.sum())
    err = rel_l2(out[rows], o_std[rows]) if n else float("nan")
    record(check="block_vs_standard", **ctx, rows_same_routing=f"{n}/{N}", err=f"{err:.3e}",
           tol=3e-2, status="pass" if (n >= 0.9 * N and err <= 3e-2) else "FAIL",
           std_impl=json.dumps(std.ops.impl)[:400])  # fmt: skip


# -- timing ------------------------------------------------------------------------------------


def floor_bytes(cfg, ids: torch.Tensor, N: int) -> dict[str, int]:
    e = cfg.moe
    H, L, Ie, S, E = cfg.hidden, cfg.expert_dim, cfg.expert_inter, cfg.shared_inter, e.num_experts
    n_exp = int(torch.unique(ids).numel())
    front = (E + L + 2 * S) * H * 2 + N * H * 2 + N * (E + L + 2 * S) * 4
    experts = n_exp * 3 * Ie * L * 2 + S * H * 2 + N * H * 4 + N * L * 4
    back = H * L * 2 + L * 2 + N * L * 4 + N * H * 4 + N * H * 2
    weights = (E + L + 2 * S) * H * 2 + n_exp * 3 * Ie * L * 2 + S * H * 2 + H * L * 2 + L * 2
    return {"front": front, "experts": experts, "back": back,
            "block": weights + 2 * N * H * 2, "block_norm": weights + 2 * N * H * 2,
            "block_residual_norm": weights + 4 * N * H * 2,
            "n_experts": n_exp}  # fmt: skip


def run_timing(cfg, ws, blks, N, ctx, bw_tbs, replays, block_only: bool = False,
               experts_only: bool = False, front_norm: bool = True) -> None:  # fmt: skip
    hs = [torch.randn(N, cfg.hidden, device=DEV).to(BF16) for _ in blks]
    outs = [torch.empty(N, cfg.hidden, dtype=BF16, device=DEV) for _ in blks]
    for b, h in zip(blks, hs, strict=True):
        b.forward(h, torch.empty_like(h))
    torch.cuda.synchronize()
    fb = floor_bytes(cfg, blks[0].topk_ids, N)
    trip = list(zip(blks, hs, outs, strict=True))
    r_outs = [torch.empty_like(o) for o in outs]
    pieces = {
        "front": [(lambda b=b, h=h: b.front(h)) for b, h, _ in trip],
        "experts": [(lambda b=b, h=h: (b.front(h), b.experts())) for b, h, _ in trip],
        "back": [(lambda b=b, o=o: b.back(o)) for b, _, o in trip],
        "block": [(lambda b=b, h=h, o=o: b.forward(h, o)) for b, h, o in trip],
        "block_norm": [(lambda b=b, h=h, o=o: b.forward_norm(h, o)) for b, h, o in trip],
        "block_residual_norm": [
            (lambda b=b, h=h, o=o, ro=ro: b.forward_residual(h, h, ro, o))
            for (b, h, o), ro in zip(trip, r_outs, strict=True)
        ],
    }
    for fv in FRONTS:  # both front kernels (the default picks one by token count)
        pieces[f"front_{fv}"] = [under(f, DECODESCOPE_MOE_FRONT=fv) for f in pieces["front"]]
    if "tile" in FRONTS:  # its route kernel zeroes acc: the block is the fair comparison
        pieces["block_front_tile"] = [under(f, DECODESCOPE_MOE_FRONT="tile")
                                      for f in pieces["block"]]  # fmt: skip
    for bv in BACKS:  # both back kernels
        pieces[f"back_{bv}"] = [under(f, DECODESCOPE_MOE_BACK=bv) for f in pieces["back"]]
    for name, kv in BACK_AB if "mma" in BACKS else []:
        pieces[f"back_{name}"] = [under(f, **kv) for f in pieces["back"]]
    if not front_norm:
        del pieces["block_norm"], pieces["block_residual_norm"]
    if block_only:
        pieces = {"block": pieces["block"]}
    elif experts_only:  # another expert kernel beside the full set: front (to subtract) too
        keep = ("front", "experts", "block", "front_tile", "block_front_tile")
        pieces = {k: pieces[k] for k in keep if k in pieces}
    times = {}
    for name, fns in pieces.items():
        r = guarded(f"time_{name}", ctx, lambda fns=fns: graph_time_us(fns, replays))
        if r is None:
            continue
        med, lo, hi = r
        if name == "experts":  # measured with the front kernel before it: subtract its median
            med, lo, hi = (x - times.get("front", 0.0) for x in (med, lo, hi))
        times[name] = med
        fkey = name.split("_")[0] if name.startswith(("front", "back")) else name
        floor = fb["block" if name == "block_front_tile" else fkey]
        floor = floor / (bw_tbs * 1e6)
        record(time=name, **ctx, kernels=3 if name.startswith("block") else 1, us=f"{med:.1f}",
               us_min=f"{lo:.1f}", us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}",
               eff=f"{med / floor:.2f}", n_experts=fb["n_experts"], status="time")  # fmt: skip

    def std_time():
        stds = [_standard_layer(cfg, w, N) for w in ws]
        for s, h in zip(stds, hs, strict=True):
            s.h.copy_(h)
        fns = [(lambda s=s, o=o: s._moe_forward(o)) for s, o in zip(stds, outs, strict=True)]
        return graph_time_us(fns, replays)

    if block_only or experts_only:
        return
    r = guarded("time_standard_block", ctx, std_time)
    if r is not None:
        med, lo, hi = r
        floor = fb["block"] / (bw_tbs * 1e6)
        sp = med / times["block"] if "block" in times else float("nan")
        record(time="standard_block", **ctx, us=f"{med:.1f}", us_min=f"{lo:.1f}",
               us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}", eff=f"{med / floor:.2f}",
               speedup_specialized=f"{sp:.2f}", status="time")  # fmt: skip


def time_grouped_parts(cfg, blks, N, ctx, bw_tbs, replays) -> None:
    """Each grouped kernel alone (CUDA-graph medians over the weight copies, after one full
    forward so that the routing lists are in place): route, w13 + SiTU, w2 + weighted sum.
    Floors: w13 = selected experts' gate/up rows, w2 = their down rows + the shared down."""
    e = cfg.moe
    L, Ie, S, H = cfg.expert_dim, cfg.expert_inter, cfg.shared_inter, cfg.hidden
    for b in blks:
        b.forward(torch.randn(N, cfg.hidden, device=DEV).to(BF16),
                  torch.empty(N, cfg.hidden, dtype=BF16, device=DEV))  # fmt: skip
    torch.cuda.synchronize()
    n_exp = int(torch.unique(blks[0].topk_ids).numel())
    floors = {"grouped_route": N * (e.num_experts + 2 * S) * 4,
              "grouped_w13": n_exp * 2 * Ie * L * 2,
              "grouped_w2": n_exp * Ie * L * 2 + S * H * 2}  # fmt: skip
    from decodescope.kernels.specialized import experts_t1 as t1

    base = dict(floors)  # the Triton rows: their own kernels' bytes
    dims = (e.num_experts, e.top_k, L, Ie, H, S)
    if t1.use_t1(N, dims) and t1.shared_where() == "w13":  # the shared down runs in kernel 2
        floors["grouped_w13"] += S * H * 2
        floors["grouped_w2"] -= S * H * 2
    for i, name in enumerate(floors):
        fns = [(lambda b=b, i=i: mg.run_block_parts(b, (i,))) for b in blks]
        r = guarded(f"time_{name}", ctx, lambda fns=fns: graph_time_us(fns, replays))
        if r is None:
            continue
        med, lo, hi = r
        floor = floors[name] / (bw_tbs * 1e6)
        record(time=name, **ctx, kernels=1, us=f"{med:.1f}", us_min=f"{lo:.1f}",
               us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}", eff=f"{med / floor:.2f}",
               n_experts=n_exp, status="time")  # fmt: skip
    guarded("time_triton_w13", ctx,
            lambda: _time_triton_w13(cfg, blks, N, ctx, bw_tbs, replays, base, n_exp))  # fmt: skip
    guarded("time_triton_w2", ctx,
            lambda: _time_triton_w2(cfg, blks, N, ctx, bw_tbs, replays, base, n_exp))  # fmt: skip
    if "tile" in FRONTS:  # the route kernel as the tile front has it: zeroing acc too
        fns = [under(lambda b=b: mg.run_block_parts(b, (0,)), DECODESCOPE_MOE_FRONT="tile")
               for b in blks]  # fmt: skip
        r = guarded("time_grouped_route_zero_acc", ctx, lambda: graph_time_us(fns, replays))
        if r is not None:
            med, lo, hi = r
            floor = (floors["grouped_route"] + N * L * 4) / (bw_tbs * 1e6)
            record(time="grouped_route_zero_acc", **ctx, kernels=1, us=f"{med:.1f}",
                   us_min=f"{lo:.1f}", us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}",
                   eff=f"{med / floor:.2f}", n_experts=n_exp, status="time")  # fmt: skip


def _time_triton_w13(cfg, blks, N, ctx, bw_tbs, replays, floors, n_exp) -> None:
    """The standard path's Triton fused-MoE w13 (``triton_kernels.fused_moe``, vLLM's block
    sizes) alone on the same routing and weights as ``grouped_w13`` (each block's ``topk_ids``
    after the forwards above; z = bf16 of the same front output), CUDA-graph median: the rate
    to match. Its inputs (align lists, BF16 z) are prepared outside the timed graph."""
    from decodescope.kernels.standard import ops as sops
    from decodescope.kernels.standard import triton_kernels as tk
    from decodescope.kernels.standard.layers import BLOCK_M

    e = cfg.moe
    E, k, L, Ie = e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter
    numel = N * k
    max_padded = -(-(numel + E * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    m_blocks = min(max_padded // BLOCK_M, numel)
    fns = []
    for b in blks:
        sid = torch.empty(max_padded, dtype=torch.int32, device=DEV)
        eid = torch.empty(max_padded // BLOCK_M, dtype=torch.int32, device=DEV)
        ntp = torch.empty(1, dtype=torch.int32, device=DEV)
        sops.moe_align_torch(b.topk_ids, E, BLOCK_M, sid, eid, ntp)
        z = b.y_front[:, E : E + L].to(BF16).contiguous()
        c = torch.empty(numel, 2 * Ie, dtype=BF16, device=DEV)
        tw = b.topk_weights
        fns.append(lambda b=b, z=z, c=c, sid=sid, eid=eid, ntp=ntp, tw=tw: tk.fused_moe(
            z, b.w13, c, tw, sid, eid, ntp, numel, k, False, m_blocks))  # fmt: skip
    med, lo, hi = graph_time_us(fns, replays)
    floor = floors["grouped_w13"] / (bw_tbs * 1e6)
    record(time="triton_w13", **ctx, kernels=1, us=f"{med:.1f}", us_min=f"{lo:.1f}",
           us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}", eff=f"{med / floor:.2f}",
           n_experts=n_exp, status="time")  # fmt: skip


def _time_triton_w2(cfg, blks, N, ctx, bw_tbs, replays, floors, n_exp) -> None:
    """The standard path's Triton fused-MoE w2 (``triton_kernels.fused_moe``, vLLM's block
    sizes, routing weights multiplied in, BF16 ``[T*k, L]`` out; the top-k sum is a separate
    launch not timed here) alone on the same routing, weights and ``h`` (by pair, as the
    standard path's activations) as ``grouped_w2``, CUDA-graph median. Its floor is
    ``grouped_w2``'s less the shared expert's weights (it does not run the shared down)."""
    from decodescope.kernels.standard import ops as sops
    from decodescope.kernels.standard import triton_kernels as tk
    from decodescope.kernels.standard.layers import BLOCK_M

    e = cfg.moe
    E, k, L = e.num_experts, e.top_k, cfg.expert_dim
    numel = N * k
    max_padded = -(-(numel + E * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    m_blocks = min(max_padded // BLOCK_M, numel)
    fns = []
    for b in blks:
        sid = torch.empty(max_padded, dtype=torch.int32, device=DEV)
        eid = torch.empty(max_padded // BLOCK_M, dtype=torch.int32, device=DEV)
        ntp = torch.empty(1, dtype=torch.int32, device=DEV)
        sops.moe_align_torch(b.topk_ids, E, BLOCK_M, sid, eid, ntp)
        c = torch.empty(numel, L, dtype=BF16, device=DEV)
        tw = b.topk_weights.reshape(-1)
        fns.append(lambda b=b, c=c, sid=sid, eid=eid, ntp=ntp, tw=tw: tk.fused_moe(
            b.h, b.w2, c, tw, sid, eid, ntp, numel, 1, True, m_blocks))  # fmt: skip
    med, lo, hi = graph_time_us(fns, replays)
    floor = (floors["grouped_w2"] - cfg.shared_inter * cfg.hidden * 2) / (bw_tbs * 1e6)
    record(time="triton_w2", **ctx, kernels=1, us=f"{med:.1f}", us_min=f"{lo:.1f}",
           us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}", eff=f"{med / floor:.2f}",
           n_experts=n_exp, status="time")  # fmt: skip


def table_md() -> str:
    lines = ["| tp | tokens | pdl | expert kernel | what | kernels | us (median) | min | max "
             "| floor us | span/floor | experts sel. | speedup |", "|" + "---|" * 13]  # fmt: skip
    for r in RESULTS:
        if r.get("status") == "time":
            lines.append(
                f"| {r['tp']} | {r['tokens']} | {r.get('pdl', '')} | {r.get('experts', '')} "
                f"| {r['time']} "
                f"| {r.get('kernels', '')} | {r['us']} | {r['us_min']} | {r['us_max']} "
                f"| {r['floor_us']} | {r['eff']} | {r.get('n_experts', '')} "
                f"| {r.get('speedup_specialized', '')} |"
            )
    fails = [r for r in RESULTS if r.get("status") in ("FAIL", "error")]
    passes = sum(r.get("status") == "pass" for r in RESULTS)
    lines.append("")
    lines.append(f"checks: {passes} pass, {len(fails)} fail/error")
    for r in fails:
        lines.append(f"- {r.get('check')} tp={r.get('tp')} tokens={r.get('tokens')} "
                     f"pdl={r.get('pdl')} experts={r.get('experts')}: "
                     f"{r.get('err', r.get('error', ''))}")  # fmt: skip
    return "\n".join(lines)


def smoke(blk, N: int, ctx: dict, a, timeout_s: float = 30.0) -> bool:
    """One forward of the block (compiles first), watched: a kernel that never finishes
    (a deadlocked wait) cannot be recovered in-process, so say so, write what we have, exit 3."""
    h = torch.randn(N, blk.cfg.hidden, device=DEV).to(BF16)
    out = torch.empty_like(h)
    blk.forward(h, out)  # compiles on the host, then enqueues
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > timeout_s:
            record(
                check="no_hang",
                **ctx,
                status="FAIL",
                error=f"the block did not finish within {timeout_s:.0f} s (kernel hang)",
            )
            finish(a, None)
            os._exit(3)
        time.sleep(0.005)
    record(check="no_hang", **ctx, status="pass")
    return True


def run_point(a, cfg, preset: str, tp: int, ws: list, N: int, bw: float) -> None:
    pdl = rt.pdl_enabled()
    ctx0 = {"preset": preset, "tp": tp, "tokens": N, "pdl": int(pdl)}
    blks = guarded("build", ctx0, lambda: [mb.SpecializedMoE(cfg, w, N) for w in ws])
    if not blks:
        return
    mma_ok = (preset, tp, N) in a.front_ok
    FRONTS[:] = BACKS[:] = ["simt", "mma"] if mma_ok else ["simt"]
    for var, user in (("DECODESCOPE_MOE_FRONT", USER_FRONT), ("DECODESCOPE_MOE_BACK", USER_BACK)):
        if not mma_ok:  # the default would pick the MMA kernels from 8 tokens on
            os.environ[var] = "simt"
        elif user is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = user
    if not mma_ok:
        record(check="front_back_mma_skipped", **ctx0, status="FAIL",
               error="their probe did not finish")  # fmt: skip
    for iv, var in enumerate(a.variants):
        ctx = {**ctx0, "experts": var}
        if var == "pipe" and (preset, tp, N) not in a.pipe_ok:
            record(check="pipe_skipped", **ctx, status="FAIL", error="the probe did not finish")
            continue
        if var.startswith("grouped") and (var, preset, tp, N) not in a.grouped_ok:
            record(check="grouped_skipped", **ctx, status="FAIL",
                   error="the grouped probe did not finish")  # fmt: skip
            continue
        FRONTS[:] = [f for f in FRONTS if f != "tile"]
        if var.startswith("grouped") and (var, preset, tp, N) in a.tile_ok:
            FRONTS.append("tile")
        elif var.startswith("grouped"):
            record(check="front_tile_skipped", **ctx, status="FAIL",
                   error="the tile front's probe did not finish")  # fmt: skip
        with env(**variant_env(var)):
            if guarded("smoke", ctx, lambda ctx=ctx: smoke(blks[0], N, ctx, a)) is None:
                continue
            n0 = len(RESULTS)

            def checks(ctx_p: dict, fn: bool = not a.quick and iv == 0, first: bool = iv == 0):
                for rep in range(1 if a.quick else 2):  # fresh draws
                    ctx_r = {**ctx_p, "draw": rep}
                    guarded("checks", ctx_r, lambda ctx_r=ctx_r, rep=rep: run_checks(
                        cfg, ws[0], blks[0], N, ctx_r, 1000 * N + rep, front_norm=fn,
                        fronts=first))  # fmt: skip

            checks(ctx)
            failed = any(r.get("status") in ("FAIL", "error") for r in RESULTS[n0:])
            if failed and pdl:  # tell a PDL problem from a kernel problem
                with env(DECODESCOPE_MOE_PDL=0):
                    checks({**ctx, "pdl": 0})
            if not a.no_timing and preset != "tiny":
                run_timing(cfg, ws, blks, N, ctx, bw, a.replays, experts_only=iv > 0,
                           front_norm=not a.quick)  # fmt: skip
                if var.startswith("grouped"):
                    guarded("time_grouped_parts", ctx,
                            lambda c=ctx: time_grouped_parts(cfg, blks, N, c, bw, a.replays))  # fmt: skip
                if a.compare_pdl and pdl and iv == 0:
                    with env(DECODESCOPE_MOE_PDL=0):
                        run_timing(cfg, ws, blks, N, {**ctx, "pdl": 0}, bw, a.replays,
                                   block_only=True)  # fmt: skip
    torch.cuda.empty_cache()


def shapes_of(a) -> list[tuple[str, int]]:
    return ([("tiny", 1)] if a.tiny else []) + [("kimi-k3", tp) for tp in a.tp]


def probe_pipe(a) -> tuple[set, set]:
    """Run the pipe expert kernel (with the SIMT front), then the tensor-core front alone, once
    per (TP, tokens) in a child process with a deadline: a deadlocked kernel or a sticky CUDA
    error cannot be recovered in-process, so the child takes it (and is killed), and this run
    uses the pipe / the MMA front only where the child finished them."""
    cmd = [sys.executable, __file__, "--probe-child", "--out", a.out, "--tp", *map(str, a.tp),
           "--tokens", *map(str, a.tokens), "--variants", *a.variants] + (
           ["--tiny"] if a.tiny else [])  # fmt: skip
    limit = 120  # s without progress: the first point builds weights and compiles
    ok: set[tuple[str, int, int]] = set()
    front_ok: set[tuple[str, int, int]] = set()
    log = Path(a.out) / "pipe_probe.log"
    with open(log, "w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
        last, seen = time.time(), 0
        while child.poll() is None:
            time.sleep(0.5)
            n = log.read_text().count("_OK ")
            if n > seen:
                last, seen = time.time(), n
            elif time.time() - last > limit:
                child.kill()
                child.wait()
                break
    text = log.read_text()
    why = (f"exit {child.returncode}; see pipe_probe.log: {text.strip()[-300:]}"
           if child.returncode is not None and child.returncode >= 0
           else f"no progress within {limit} s (kernel hang: the child was killed)")  # fmt: skip
    for line in text.splitlines():
        if line.startswith(("PROBE_OK ", "FRONT_OK ")):
            what, preset, tp, n = line.split()
            (ok if what == "PROBE_OK" else front_ok).add((preset, int(tp), int(n)))
    want = {(p, tp, n) for p, tp in shapes_of(a) for n in a.tokens}
    want_pipe = want if "pipe" in a.variants else set()
    record(check="pipe_probe", ok=sorted(ok), status="pass" if ok == want_pipe else "FAIL",
           **({} if ok == want_pipe else {"error": why}))  # fmt: skip
    record(check="front_back_mma_probe", ok=sorted(front_ok),
           status="pass" if front_ok == want else "FAIL",
           **({} if front_ok == want else {"error": why}))  # fmt: skip
    return ok, front_ok


def probe_child(a) -> int:
    os.environ["DECODESCOPE_MOE_EXPERTS"] = "pipe"
    os.environ["DECODESCOPE_MOE_FRONT"] = "simt"  # the probe is about the expert kernel
    for preset, tp in shapes_of(a):
        cfg = get_config(preset, tp)
        w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=0, device=DEV)
        for n in a.tokens if "pipe" in a.variants else []:
            blk = mb.SpecializedMoE(cfg, w, n)
            h = torch.randn(n, cfg.hidden, device=DEV).to(BF16)
            for _ in range(3):
                blk.forward(h, torch.empty_like(h))
            torch.cuda.synchronize()
            print(f"PROBE_OK {preset} {tp} {n}", flush=True)
        # then the tensor-core front alone (after every pipe point: a crash here loses no
        # pipe result)
        os.environ["DECODESCOPE_MOE_FRONT"] = "mma"
        for n in a.tokens:
            blk = mb.SpecializedMoE(cfg, w, n)
            h = torch.randn(n, cfg.hidden, device=DEV).to(BF16)
            out = torch.empty_like(h)
            for _ in range(3):
                blk.front(h)
                with env(DECODESCOPE_MOE_BACK="mma"):
                    blk.back(out)
            torch.cuda.synchronize()
            print(f"FRONT_OK {preset} {tp} {n}", flush=True)
        os.environ["DECODESCOPE_MOE_FRONT"] = "simt"
        del w
        torch.cuda.empty_cache()
    return 0


def probe_grouped(a) -> set:
    """The grouped expert kernels once per (TP, tokens) in a child process with a deadline
    (``grouped_probe.log``), as :func:`probe_pipe` does for the pipe: a hang or a sticky CUDA
    error fails the grouped points alone."""
    gv = [v for v in a.variants if v.startswith("grouped")]
    if not gv:
        return set()
    cmd = [sys.executable, __file__, "--probe-grouped-child", "--out", a.out, "--tp",
           *map(str, a.tp), "--tokens", *map(str, a.tokens), "--variants", *gv] + (
           ["--tiny"] if a.tiny else [])  # fmt: skip
    limit = 120
    log = Path(a.out) / "grouped_probe.log"
    with open(log, "w") as f:
        child = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
        last, seen = time.time(), 0
        while child.poll() is None:
            time.sleep(0.5)
            n = log.read_text().count("GROUPED_")  # OK and FAIL lines: progress
            if n > seen:
                last, seen = time.time(), n
            elif time.time() - last > limit:
                child.kill()
                child.wait()
                break
    text = log.read_text()
    ok = set()
    for line in text.splitlines():
        if line.startswith("GROUPED_OK "):
            _, var, preset, tp, n = line.split()
            ok.add((var, preset, int(tp), int(n)))
    want = {(v, p, tp, n) for v in gv for p, tp in shapes_of(a) for n in a.tokens}
    why = (f"exit {child.returncode}; see grouped_probe.log: {text.strip()[-300:]}"
           if child.returncode is not None and child.returncode >= 0
           else f"no progress within {limit} s (kernel hang: the child was killed)")  # fmt: skip
    record(check="grouped_probe", ok=sorted(ok), status="pass" if ok == want else "FAIL",
           **({} if ok == want else {"error": why}))  # fmt: skip
    a.tile_ok = set()  # the tile front (DECODESCOPE_MOE_FRONT=tile) on each grouped point
    for line in text.splitlines():
        if line.startswith("GROUPED_TILE_OK "):
            _, var, preset, tp, n = line.split()
            a.tile_ok.add((var, preset, int(tp), int(n)))
    record(check="front_tile_probe", ok=sorted(a.tile_ok),
           status="pass" if a.tile_ok == want else "FAIL",
           **({} if a.tile_ok == want else {"error": why}))  # fmt: skip
    return ok


def variant_env(var: str) -> dict:
    """The environment of an expert-kernel variant of ``--variants``."""
    if var == "grouped_t1base" or T1_RE.fullmatch(var):  # 1 token: DECODESCOPE_MOE_T1
        return t1_env(var)
    if var == "grouped_split":  # the route kernel's top-k over ceil(T/8) CTAs
        return {"DECODESCOPE_MOE_EXPERTS": "grouped", "DECODESCOPE_MOE_GROUPED_ROUTE": "split"}
    if var == "grouped_w8":  # the route split, w13 on 8 warps with its K loop unrolled
        return {"DECODESCOPE_MOE_EXPERTS": "grouped", "DECODESCOPE_MOE_GROUPED_ROUTE": "split",
                "DECODESCOPE_MOE_GROUPED_W13": "w8"}  # fmt: skip
    if var == "grouped_thresh":  # grouped_ring with the threshold top-k in the route kernel
        return {"DECODESCOPE_MOE_EXPERTS": "grouped", "DECODESCOPE_MOE_GROUPED_ROUTE": "thresh",
                "DECODESCOPE_MOE_GROUPED_W13": "ring", "DECODESCOPE_MOE_GROUPED_W2": "ring"}  # fmt: skip
    if var == "grouped_ring":  # the route split, w13 and w2 streamed through cp.async rings
        return {"DECODESCOPE_MOE_EXPERTS": "grouped", "DECODESCOPE_MOE_GROUPED_ROUTE": "split",
                "DECODESCOPE_MOE_GROUPED_W13": "ring", "DECODESCOPE_MOE_GROUPED_W2": "ring"}  # fmt: skip
    if var.startswith("grouped_w2s"):  # the defaults (thresh route, rings), w2 ring stages set
        return {"DECODESCOPE_MOE_EXPERTS": "grouped", "DECODESCOPE_MOE_GROUPED_ROUTE": "thresh",
                "DECODESCOPE_MOE_GROUPED_W13": "ring", "DECODESCOPE_MOE_GROUPED_W2": "ring",
                "DECODESCOPE_MOE_W2_STAGES": var.removeprefix("grouped_w2s")}  # fmt: skip
    if var == "grouped":
        return {"DECODESCOPE_MOE_EXPERTS": "grouped", "DECODESCOPE_MOE_GROUPED_ROUTE": "one"}
    m = W2TILE_RE.fullmatch(var)
    if m:  # the defaults (thresh route, w13 ring), w2 on grouped_w2_tile with its knobs
        env = {"DECODESCOPE_MOE_EXPERTS": "grouped", "DECODESCOPE_MOE_GROUPED_ROUTE": "thresh",
               "DECODESCOPE_MOE_GROUPED_W13": "ring", "DECODESCOPE_MOE_GROUPED_W2": "tile"}  # fmt: skip
        knobs = ("LOAD", "WARPS", "RT", "BK", "STAGES", "MT", "CAP", "ORDER", "SNJ", "SHARED",
                 "EARLY")  # fmt: skip
        for knob, v in zip(knobs, m.groups(), strict=True):
            v = {"early": "1", "late": "0", "sht": "tile", "shs": "spread", "shr": "regs"}.get(
                v, v
            )  # flags
            env[f"DECODESCOPE_MOE_W2T_{knob}"] = v or ""  # "": the module default
        return env
    m = W13TILE_RE.fullmatch(var)
    if m:  # the defaults (thresh route, w2 ring), w13 on grouped_w13_tile with its knobs
        env = {"DECODESCOPE_MOE_EXPERTS": "grouped", "DECODESCOPE_MOE_GROUPED_ROUTE": "thresh",
               "DECODESCOPE_MOE_GROUPED_W13": "tile", "DECODESCOPE_MOE_GROUPED_W2": "ring"}  # fmt: skip
        for knob, v in zip(("ROWS", "BK", "STAGES", "RT", "PERSIST"), m.groups(), strict=True):
            env[f"DECODESCOPE_MOE_W13T_{knob}"] = v or ""  # "": the module default
        return env
    return {"DECODESCOPE_MOE_EXPERTS": var}


# grouped_w13tile[_r<R>][_k<BK>][_s<stages>][_t<RT>][_p<persist>]: GroupedW13Tile and its
# tiling knobs (kernels/specialized/grouped_w13_tile.py), e.g. grouped_w13tile_k64_s4_p3
W13TILE_RE = re.compile(
    r"grouped_w13tile(?:_r(\d+))?(?:_k(\d+))?(?:_s(\d+))?(?:_t(\d+))?(?:_p(\d+))?"
)
# grouped_w2tile[_bulk][_w<warps>][_r<RT>][_k<BK>][_s<stages>][_m<MT>][_c<cap>][_block|_col]
# [_sj<N>][_sht|_shs|_shr][_early|_late]:
# GroupedW2Tile and its knobs (kernels/specialized/grouped_w2_tile.py), e.g. grouped_w2tile_r2
# (128 rows per item), grouped_w2tile_bulk (a producer warp's cp.async.bulk per row on
# mbarriers), grouped_w2tile_c512 (routed grid up to 512 CTAs per SM: one item per CTA at 64
# tokens), grouped_w2tile_block (a CTA walks consecutive items), grouped_w2tile_col (items slot
# fastest: the empty CTAs spread through the grid), grouped_w2tile_sj2 (the shared-expert CTAs
# 2 token tiles per pass), grouped_w2tile_col_sht (the shared expert on the tile pipeline;
# _shs: its CTAs spread through the grid; _shr: the register-load shared CTAs),
# grouped_w2tile_stride_shr_late (the defaults before s10/r2: stride order, register-load shared
# expert, weights after the PDL wait),
# grouped_w2tile_col_early (weights issued before the PDL wait)
W2TILE_RE = re.compile(
    r"grouped_w2tile(?:_(bulk))?(?:_w(\d+))?(?:_r(\d+))?(?:_k(\d+))?(?:_s(\d+))?(?:_m(\d+))?"
    r"(?:_c(\d+))?(?:_(block|col|stride))?(?:_sj(\d+))?(?:_(sht|shs|shr))?(?:_(early|late))?"
)
VARIANTS = ["pipe", "old", "grouped", "grouped_split", "grouped_w8", "grouped_ring",
            "grouped_thresh", "grouped_w2s2", "grouped_w2s4", "grouped_w2s3", "grouped_w2s6"]  # fmt: skip


# grouped_t1[_r<R>][_s<stages>][_k<BK>][_kw<warps>][_zt][_w2w<warps>][_w2sh][_nopre][_rt1]:
# DECODESCOPE_MOE_T1=t1 (1 token, kernels/specialized/experts_t1.py): the w13 tile with R gate rows
# per item (16), its stages (6), K chunk (128) and warps splitting an item's K chunks
# (DECODESCOPE_MOE_T1_KW: 2 where it fits), z stages sized for the tokens (_zt:
# DECODESCOPE_MOE_T1_ZT=1), w2's warps per item (DECODESCOPE_MOE_W2T_WARPS: 4 = 64 rows), the
# shared down before w13's PDL wait (_w2sh: in w2's first CTAs instead), w2's weights before its
# wait (_nopre: after it), the route: RouteT1 (_rt1; the default since s10/r2) or the grouped
# route kernel (_rtg).
# _w2p[_pw<warps>][_ps<stages>][_pm<CTAs per SM>]: w2 on the persistent
# kernels/specialized/w2_t1_persist.py (DECODESCOPE_MOE_T1_W2=persist and its
# DECODESCOPE_MOE_T1_W2P_WARPS / _STAGES / _PERSM; defaults 2 / 5 / 3), e.g.
# grouped_t1_w2p_pw4_ps4; _w2t: W2T1 (DECODESCOPE_MOE_T1_W2=tile); neither: the default
# (persist since session 12, W2T1 with _w2sh).
# grouped_t1base: the grouped kernels' own defaults at 1 token (DECODESCOPE_MOE_T1=grouped).
T1_RE = re.compile(
    r"grouped_t1(?:_r(\d+))?(?:_s(\d+))?(?:_k(\d+))?(?:_kw(\d+))?(?:_ks(\d+))?(?:_(zt))?"
    r"(?:_w2w(\d+))?"
    r"(?:_(w2sh))?"
    r"(?:_(nopre))?"
    r"(?:_(rt1|rtg|rtw))?(?:_(w2p|w2t)(?:_pw(\d+))?(?:_ps(\d+))?(?:_pm(\d+))?)?"
    r"(?:_e(\d))?"
)


def t1_env(var: str) -> dict:
    """The environment of a ``grouped_t1...`` variant: the grouped kernels with the route's
    default (thresh) and every w13 / w2 tile knob at its default, plus the T1 knobs."""
    from decodescope.kernels.specialized import grouped_w2_tile as gw2
    from decodescope.kernels.specialized import grouped_w13_tile as gwt

    env = {"DECODESCOPE_MOE_EXPERTS": "grouped", "DECODESCOPE_MOE_GROUPED_ROUTE": "thresh",
           "DECODESCOPE_MOE_GROUPED_W13": "", "DECODESCOPE_MOE_GROUPED_W2": ""}  # fmt: skip
    env.update({v: "" for v in gwt.ENV.values()})
    env.update({v: "" for v, _ in gw2._ENV.values()})
    if var == "grouped_t1base":
        return {**env, "DECODESCOPE_MOE_T1": "grouped"}
    r, s, k, kw, ks, zt, w2w, w2sh, nopre, rt1, w2p, pw, ps, pm, early = T1_RE.fullmatch(
        var
    ).groups()
    env["DECODESCOPE_MOE_T1_EARLY"] = early or ""
    env["DECODESCOPE_MOE_T1_KW"] = kw or ""
    env["DECODESCOPE_MOE_T1_KSPLIT"] = ks or ""
    env["DECODESCOPE_MOE_T1_ZT"] = "1" if zt else ""
    env["DECODESCOPE_MOE_W2T_WARPS"] = w2w or ""
    env["DECODESCOPE_MOE_T1_W2"] = {"w2p": "persist", "w2t": "tile"}.get(w2p or "", "")
    env["DECODESCOPE_MOE_T1_W2P_WARPS"] = pw or ""
    env["DECODESCOPE_MOE_T1_W2P_STAGES"] = ps or ""
    env["DECODESCOPE_MOE_T1_W2P_PERSM"] = pm or ""
    env["DECODESCOPE_MOE_T1_ROUTE"] = {"rt1": "t1", "rtg": "grouped", "rtw": "w13"}.get(
        rt1 or "", ""
    )
    return {**env, "DECODESCOPE_MOE_T1": "t1", "DECODESCOPE_MOE_T1_ROWS": r or "",
            "DECODESCOPE_MOE_T1_STAGES": s or "", "DECODESCOPE_MOE_T1_BK": k or "",
            "DECODESCOPE_MOE_T1_SHARED": "w2" if w2sh else "",
            "DECODESCOPE_MOE_T1_W2PRE": "0" if nopre else ""}  # fmt: skip


def variant_name(v: str) -> str:
    """argparse type of ``--variants``: a fixed name or a ``grouped_w13tile...`` pattern."""
    if v == "grouped_t1base" or T1_RE.fullmatch(v):
        return v
    if v in VARIANTS or W13TILE_RE.fullmatch(v) or W2TILE_RE.fullmatch(v):
        return v
    raise argparse.ArgumentTypeError(
        f"unknown variant {v!r}: one of {VARIANTS} or "
        "grouped_w13tile[_r<R>][_k<BK>][_s<S>][_t<RT>][_p<persist>]"
        " or grouped_w2tile[_bulk][_w<warps>][_r<RT>][_k<BK>][_s<S>][_m<MT>][_c<cap>][_block|_col|_stride]"
        "[_sj<SNJ>][_sht|_shs|_shr][_early|_late]"
    )


def probe_grouped_child(a) -> int:
    for preset, tp in shapes_of(a):
        cfg = get_config(preset, tp)
        w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=0, device=DEV)
        for var in a.variants:
            os.environ.update(variant_env(var))
            for n in a.tokens:
                try:  # a Python-level failure (compile, launch config) fails this point alone
                    blk = mb.SpecializedMoE(cfg, w, n)
                    h = torch.randn(n, cfg.hidden, device=DEV).to(BF16)
                    for _ in range(3):
                        blk.forward(h, torch.empty_like(h))
                    torch.cuda.synchronize()
                except Exception as ex:  # noqa: BLE001 (reported, the child goes on)
                    print(f"GROUPED_FAIL {var} {preset} {tp} {n}: {type(ex).__name__}: {ex}"[:400],
                          flush=True)  # fmt: skip
                    continue
                print(f"GROUPED_OK {var} {preset} {tp} {n}", flush=True)
                try:  # then with the tile front (its route kernel zeroes acc)
                    with env(DECODESCOPE_MOE_FRONT="tile"):
                        for _ in range(3):
                            blk.forward(h, torch.empty_like(h))
                    torch.cuda.synchronize()
                except Exception as ex:  # noqa: BLE001 (reported, the child goes on)
                    print(f"GROUPED_TILE_FAIL {var} {preset} {tp} {n}: {type(ex).__name__}: "
                          f"{ex}"[:400], flush=True)  # fmt: skip
                    continue
                print(f"GROUPED_TILE_OK {var} {preset} {tp} {n}", flush=True)
        del w
        torch.cuda.empty_cache()
    return 0


def finish(a, t0) -> str:
    out = Path(a.out)
    commit = os.popen("git rev-parse HEAD").read().strip()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "seconds": round(time.time() - (t0 or START), 1), "commit": commit,
            "variants": a.variants}  # fmt: skip
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": RESULTS}, indent=1))
    md = table_md()
    (out / "table.md").write_text(md + "\n")
    print("\n" + md, flush=True)
    return md


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/specialized_moe")
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--copies", type=int, default=3, help="layers rotated to defeat L2")
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="also check the tiny preset")
    ap.add_argument("--compare-pdl", action="store_true", help="also time the block without PDL")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["old", "pipe"],
        type=variant_name,
        help=f"expert kernels to check and time (DECODESCOPE_MOE_EXPERTS): {VARIANTS} or "
        "grouped_w13tile[_r<R>][_k<BK>][_s<stages>][_t<RT>][_p<persist>] or "
        "grouped_w2tile[_bulk][_w<warps>][_r<RT>][_k<BK>][_s<stages>][_m<MT>][_c<cap>][_block|_col|_stride]"
        "[_sj<SNJ>][_sht|_shs|_shr][_early|_late]",
    )
    ap.add_argument(
        "--quick", action="store_true", help="one draw per check, no front-norm checks or timings"
    )
    ap.add_argument("--probe-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probe-grouped-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.probe_child:
        return probe_child(a)
    if a.probe_grouped_child:
        return probe_grouped_child(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    JSONL[:] = [out / "results.jsonl"]
    JSONL[0].write_text("")
    t0 = time.time()
    bw = guarded("copy_bandwidth", {}, lambda: copy_bandwidth_tbs()) or 4.22
    record(check="copy_bandwidth", tbs=f"{bw:.2f}", status="info")
    a.pipe_ok, a.front_ok = probe_pipe(a)
    a.tile_ok = set()
    a.grouped_ok = probe_grouped(a)
    for preset, tp in shapes_of(a):
        cfg = get_config(preset, tp)
        ws = []
        for c in range(a.copies if not a.no_timing else 1):
            ws.append(make_layer_weights(cfg, LayerSpec(1 + c, "kda", "moe"), seed=c, device=DEV))
        for N in a.tokens:
            run_point(a, cfg, preset, tp, ws, N, bw)
        ws = []
        torch.cuda.empty_cache()
    finish(a, t0)
    bad = any(r.get("status") in ("FAIL", "error") for r in RESULTS)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
