"""The LatentMoE back end on the tile GEMM (``back_tile``) against ``BackMma`` on the H200.

    python scripts/gpu_back_tile.py --out $OUT/back_tile [--tp 8 16] [--tokens 8 32 64]
        [--variants tile tile_ldsm tile_ldsm_s5 ...] [--copies 4]
        [--replays 50] [--no-block] [--budget-s 420]

Order: (1) a probe child runs every tile variant once per token count (a device fault kills
only the child: the variants it could not run are marked FAIL and skipped, the rest goes on);
(2) per (TP, tokens), the back alone: outputs poisoned with NaN, fresh random inputs (tokens of
different scales, so each has its own rstd) vs ``up_proj_shared_add_ref`` (tolerance 1e-2, the
MoE script's) and vs the kernel's own arithmetic ``back_tile.back_tile_ref`` (2e-3), three
launches in a row (self-resetting counters), a CUDA graph replayed twice; BackMma (the default
back) checked the same way; then CUDA-graph replay medians of ``--copies`` launches on
independent weights (51 MB each: rotated past the 50 MB L2) with the bytes floor at the
measured copy bandwidth; (3) per (TP, tokens), unless ``--no-block``, the block: a
``SpecializedMoE`` forward (default front and experts, BackMma), then the tile back on the same
``acc`` vs BackMma's output, the block with ``DECODESCOPE_MOE_BACK=tile`` vs the float32 reference
(``moe_ref`` on the kernel's ids) and vs the standard path's MoE block (rows whose routing
agrees), and graph medians of the block with each back. TP8 and TP16 have the same back shapes
(L 3584 and H 7168 are replicated): the back-alone rows repeat, the block rows differ.

Results: ``results.json`` (rewritten after every record) and ``table.md`` under ``--out``; the
table (timings, then PASS/FAIL) is printed last. Pieces are skipped once ``--budget-s`` is spent.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from decodescope.kernels.timing import graph_time_us

DEV = torch.device("cuda")
BF16 = torch.bfloat16
RESULTS: list[dict] = []
START = time.time()
OUT: Path | None = None

# tile variants: name -> BackPlan fields (``back_tile.back_tile`` keywords)
VARIANTS = {
    "tile": {},  # the defaults: k16 + cp.async FP32 stage up to 32 tokens, ldsm (regs) above
    "tile_s4": {"stages": 4},  # 64 tokens: one CTA per SM, 3 chunks in flight
    "tile_s2": {"stages": 2},
    "tile_k7": {"splits": 7},  # 392 CTAs, 8 chunks each
    "tile_k2": {"splits": 2},  # 112 CTAs, 28 chunks each
    "tile_w8": {"warps": 8},  # 256-row tiles: half the acc re-reads; 28 x 7 CTAs
    "tile_w2": {"warps": 2},
    # FP32 activations through registers, BF16 double buffer: 4 weight stages at 64 tokens
    "tile_regs": {"act": "regs"},
    "tile_regs_s5": {"act": "regs", "stages": 5},
    # 256-row tiles, 4 splits: 112 CTAs, one per SM (20 SMs idle), half the acc re-reads and
    # 1.5 instead of 2 L2->SM bytes per weight byte at 64 tokens (the front's ratio)
    "tile_w8k4s4": {"warps": 8, "splits": 4, "stages": 4},
    "tile_w8k4s3": {"warps": 8, "splits": 4, "stages": 3},
    "tile_regs_w8k4s5": {"act": "regs", "warps": 8, "splits": 4, "stages": 5},
    # fewer instructions per chunk (s9/r2: the loop at 64 tokens is issue-bound): hoisted copy
    # addresses + A fragments once per half; ldmatrix fragments (281 SASS per chunk and warp
    # at 64 tokens against 670)
    "tile_lean": {"lean": True},
    "tile_regs_lean": {"act": "regs", "lean": True},
    "tile_ldsm": {"act": "regs", "ldsm": True},
    "tile_ldsm_s5": {"act": "regs", "ldsm": True, "stages": 5},
    "tile_ldsm_s3": {"act": "regs", "ldsm": True, "stages": 3},
    "tile_ldsm_w8k4s5": {"act": "regs", "ldsm": True, "warps": 8, "splits": 4, "stages": 5},
    # more warps per SM: 392 CTAs at three per SM (168 registers, 67 KB at 64 tokens); 196 CTAs
    # of 8 warps at two per SM (126 registers, 2 stages)
    "tile_ldsm_k7s3": {"act": "regs", "ldsm": True, "splits": 7, "stages": 3},
    "tile_ldsm_w8k7s2": {"act": "regs", "ldsm": True, "warps": 8, "splits": 7, "stages": 2},
    # the k16 fragments with the cp.async FP32 stage (the default up to 32 tokens), forced
    "tile_k16": {"act": "smem"},
    # ldsm with the FP32 stage through cp.async, converted and packed in place (a warp barrier
    # between the FP32 reads and the BF16 writes): 304 SASS per chunk and warp at 64 tokens
    "tile_ldsm_smem": {"act": "smem", "ldsm": True},
    "tile_ldsm_smem_s2": {"act": "smem", "ldsm": True, "stages": 2},
}
DEFAULT_VARIANTS = ["tile", "tile_k16", "tile_ldsm", "tile_ldsm_smem", "tile_ldsm_smem_s2",
                    "tile_ldsm_s5"]  # fmt: skip


def record(**kw) -> dict:
    RESULTS.append(kw)
    print(" ".join(f"{k}={v}" for k, v in kw.items() if k != "trace"), flush=True)
    if kw.get("status") == "error" and "trace" in kw:
        print(kw["trace"], file=sys.stderr, flush=True)
    if OUT is not None:
        tmp = OUT / "results.json.tmp"
        tmp.write_text(json.dumps(RESULTS, indent=1))
        tmp.replace(OUT / "results.json")
    return kw


def guarded(what: str, ctx: dict, fn):
    try:
        return fn()
    except Exception as e:  # one failing piece never stops the run
        record(check=what, **ctx, status="error", error=f"{type(e).__name__}: {e}"[:300],
               trace=traceback.format_exc())  # fmt: skip
        return None


def check(what: str, ctx: dict, err: float, tol: float) -> bool:
    ok = bool(err <= tol)  # NaN / inf fail
    record(check=what, **ctx, err=f"{err:.3e}", tol=tol, status="pass" if ok else "FAIL")
    return ok


def over_budget(a, what: str, ctx: dict) -> bool:
    if time.time() - START > a.budget_s:
        record(check=what, **ctx, status="skipped", note=f"budget {a.budget_s} s spent")
        return True
    return False


def back_inputs(L: int, H: int, T: int, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    scale = torch.logspace(-1, 1, T, device=DEV).unsqueeze(1)  # each token its own rstd
    acc = torch.randn(T, L, device=DEV, generator=g) * scale
    nw = (1 + 0.1 * torch.randn(L, device=DEV, generator=g)).to(BF16)
    up = (torch.randn(H, L, device=DEV, generator=g) / L**0.5).to(BF16)
    sh = torch.randn(T, H, device=DEV, generator=g)
    return acc, nw, up, sh


def launcher(name: str):
    """``f(acc, nw, up, sh, out, eps)`` of a back kernel: ``mma`` (BackMma, its default load /
    norm for the token count) or a tile variant."""
    from decodescope.kernels.specialized import back_mma as bm
    from decodescope.kernels.specialized import back_tile as bt

    if name == "mma":
        return bm.back_mma
    kw = VARIANTS[name]
    return lambda *a: bt.back_tile(*a, **kw)


# -- probe child -------------------------------------------------------------------------------


def probe_main(a) -> int:
    """Run every variant once per token count; print ``PROBE_OK name T`` after each."""
    from decodescope.kernels.config import get_config

    cfg = get_config("kimi-k3", 8)
    L, H = cfg.expert_dim, cfg.hidden
    for T in a.tokens:
        acc, nw, up, sh = back_inputs(L, H, T, 1)
        for name in a.variants:
            out = torch.full((T, H), float("nan"), dtype=BF16, device=DEV)
            launcher(name)(acc, nw, up, sh, out, cfg.eps)
            torch.cuda.synchronize()
            print(f"PROBE_OK {name} {T} finite={bool(torch.isfinite(out).all())}", flush=True)
    return 0


def run_probe(a) -> set[tuple[str, int]]:
    """The (variant, tokens) pairs that ran in the probe child (within 180 s)."""
    cmd = [sys.executable, __file__, "--probe", "--tokens", *map(str, a.tokens),
           "--variants", *a.variants]  # fmt: skip
    ok: set[tuple[str, int]] = set()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, check=False)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode() + (e.stderr or b"").decode(), "timeout"
    if OUT is not None:
        (OUT / "probe.log").write_text(text)
    for line in text.splitlines():
        if line.startswith("PROBE_OK "):
            _, name, T, _ = line.split()
            ok.add((name, int(T)))
    for T in a.tokens:
        for name in a.variants:
            good = (name, T) in ok
            record(check="probe", variant=name, tokens=T, rc=rc,
                   status="pass" if good else "FAIL")  # fmt: skip
    return ok


# -- the back alone ----------------------------------------------------------------------------


def back_checks(cfg, T: int, names: list[str], ctx: dict, seed: int) -> None:
    from decodescope.kernels.reference import rel_l2
    from decodescope.kernels.specialized import back_tile as bt
    from decodescope.kernels.specialized.up_proj_shared_add import up_proj_shared_add_ref

    L, H = cfg.expert_dim, cfg.hidden
    acc, nw, up, sh = back_inputs(L, H, T, seed)
    ref = up_proj_shared_add_ref(acc, nw, up, sh, cfg.eps)
    for name in names:
        c = dict(ctx, variant=name)
        f = launcher(name)
        out = torch.empty(T, H, dtype=BF16, device=DEV)

        def run(f=f, out=out, c=c, name=name):
            own = None
            if name != "mma":
                splits = bt.plan_for(T, L, H, cfg.eps, **VARIANTS[name]).tile.splits
                own = bt.back_tile_ref(acc, nw, up, sh, cfg.eps, splits=splits)
            for i in range(3):  # the counters reset themselves
                out.fill_(float("nan"))
                f(acc, nw, up, sh, out, cfg.eps)
                torch.cuda.synchronize()
                check(f"back_vs_ref_{i}", c, rel_l2(out, ref), 1e-2)
                if own is not None:
                    check(f"back_vs_own_arith_{i}", c, rel_l2(out, own), 2e-3)
            out_g = torch.full_like(out, float("nan"))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                f(acc, nw, up, sh, out_g, cfg.eps)
            for _ in range(2):
                graph.replay()
            torch.cuda.synchronize()
            check("back_graph_replay", c, rel_l2(out_g, out), 1e-6)

        guarded("back_checks", c, run)


def back_timing(cfg, T: int, names: list[str], ctx: dict, a, bw_tbs: float, seed: int) -> None:
    L, H = cfg.expert_dim, cfg.hidden
    sets = [back_inputs(L, H, T, seed + 100 + i) for i in range(a.copies)]
    outs = [torch.empty(T, H, dtype=BF16, device=DEV) for _ in sets]
    floor = (H * L * 2 + L * 2 + T * L * 4 + T * H * 4 + T * H * 2) / (bw_tbs * 1e6)
    base = None
    for name in names:
        if over_budget(a, f"time_back_{name}", ctx):
            return
        f = launcher(name)
        fns = [(lambda s=s, o=o, f=f: f(*s, o, cfg.eps)) for s, o in zip(sets, outs, strict=True)]
        r = guarded(f"time_back_{name}", dict(ctx, variant=name),
                    lambda fns=fns: graph_time_us(fns, a.replays))  # fmt: skip
        if r is None:
            continue
        med, lo, hi = r
        base = med if name == "mma" else base
        record(time=f"back_{name}", **ctx, us=f"{med:.1f}", us_min=f"{lo:.1f}",
               us_max=f"{hi:.1f}", floor_us=f"{floor:.1f}", eff=f"{med / floor:.2f}",
               vs_mma=f"{base / med:.2f}" if base else "", status="time")  # fmt: skip


# -- the block ---------------------------------------------------------------------------------


def block_pieces(cfg, w, T: int, ctx: dict, a, seed: int) -> None:
    from decodescope.kernels.config import LayerSpec
    from decodescope.kernels.reference import moe_ref, rel_l2
    from decodescope.kernels.specialized import back_mma as bm
    from decodescope.kernels.specialized import moe_block as mb
    from decodescope.kernels.standard.layers import StandardLayer
    from decodescope.kernels.standard.ops import Ops
    from decodescope.kernels.weights import make_state

    blk = mb.SpecializedMoE(cfg, w, T)
    g = torch.Generator(device=DEV).manual_seed(seed + 7 + T)
    h = torch.randn(T, cfg.hidden, device=DEV, generator=g).to(BF16)
    out = torch.full((T, cfg.hidden), float("nan"), dtype=BF16, device=DEV)
    os.environ["DECODESCOPE_MOE_BACK"] = "mma"
    try:
        blk.forward(h, out)  # the default front and experts, BackMma
    finally:
        os.environ.pop("DECODESCOPE_MOE_BACK", None)
    torch.cuda.synchronize()
    c = dict(ctx, default_back=bm.back_variant(T, cfg.expert_dim, cfg.hidden))
    out_t = torch.full_like(out, float("nan"))
    os.environ["DECODESCOPE_MOE_BACK"] = "tile"
    try:
        blk.back(out_t)  # the same acc / shared_out
        torch.cuda.synchronize()
        check("block_back_tile_vs_mma_back", c, rel_l2(out_t, out), 1e-2)
        out_t.fill_(float("nan"))
        blk.forward(h, out_t)
        torch.cuda.synchronize()
        ref, _ = moe_ref(cfg, w, h, topk_ids=blk.topk_ids, dtype=torch.float32)
        check("block_tile_vs_reference", c, rel_l2(out_t, ref), 2e-2)
    finally:
        os.environ.pop("DECODESCOPE_MOE_BACK", None)

    def vs_standard():
        spec = LayerSpec(1, "kda", "moe")
        state = make_state(cfg, spec, T, 1, 0, DEV)
        std = StandardLayer(cfg, spec, w, state, T, 1, Ops(DEV), side_stream=torch.cuda.Stream())
        std.h.copy_(h)
        o_std = torch.full_like(out, float("nan"))
        std._moe_forward(o_std)
        torch.cuda.synchronize()
        rows = (blk.topk_ids.long().sort(1).values == std.topk_ids.long().sort(1).values).all(1)
        n = int(rows.sum())
        err = rel_l2(out_t[rows], o_std[rows]) if n else float("nan")
        record(check="block_tile_vs_standard", **c, rows_same_routing=f"{n}/{T}",
               err=f"{err:.3e}", tol=3e-2,
               status="pass" if (n >= 0.9 * T and err <= 3e-2) else "FAIL")  # fmt: skip

    guarded("block_tile_vs_standard", c, vs_standard)
    if over_budget(a, "time_block", c):
        return
    fl = None
    for back in ("mma", "tile"):

        def fwd(back=back):
            os.environ["DECODESCOPE_MOE_BACK"] = back
            try:
                blk.forward(h, out)
            finally:
                os.environ.pop("DECODESCOPE_MOE_BACK", None)

        r = guarded(f"time_block_{back}", c, lambda fwd=fwd: graph_time_us([fwd], a.replays))
        if r is not None:
            med, lo, hi = r
            fl = fl or med
            record(time=f"block_back_{back}", **c, us=f"{med:.1f}", us_min=f"{lo:.1f}",
                   us_max=f"{hi:.1f}", floor_us="", eff="", vs_mma=f"{fl / med:.2f}",
                   n_experts=int(torch.unique(blk.topk_ids).numel()), status="time")  # fmt: skip


# -- main --------------------------------------------------------------------------------------


def table_md() -> str:
    lines = ["| tp | tokens | what | us (median) | min | max | floor us | us/floor | mma/this |",
             "|" + "---|" * 9]  # fmt: skip
    for r in RESULTS:
        if r.get("status") == "time":
            lines.append(f"| {r['tp']} | {r['tokens']} | {r['time']} | {r['us']} | {r['us_min']} "
                         f"| {r['us_max']} | {r['floor_us']} | {r['eff']} | {r.get('vs_mma', '')} |")  # fmt: skip
    fails = [r for r in RESULTS if r.get("status") in ("FAIL", "error")]
    skipped = [r for r in RESULTS if r.get("status") == "skipped"]
    passes = sum(r.get("status") == "pass" for r in RESULTS)
    lines += ["", f"checks: {passes} PASS, {len(fails)} FAIL/error, {len(skipped)} skipped"]
    for r in fails:
        lines.append(f"- FAIL {r.get('check')} tp={r.get('tp')} tokens={r.get('tokens')} "
                     f"variant={r.get('variant', '')}: {r.get('err', r.get('error', ''))}")  # fmt: skip
    lines.append(f"wall {time.time() - START:.0f} s")
    return "\n".join(lines)


def main() -> int:
    global OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS,
                    choices=sorted(VARIANTS))  # fmt: skip
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--no-block", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=None, help="input seed (default: from the clock)")
    a = ap.parse_args()
    if "tile" not in a.variants:
        a.variants.insert(0, "tile")  # the block pieces use it
    if a.probe:
        return probe_main(a)
    if a.out is None:
        ap.error("--out DIR is required")
    a.out.mkdir(parents=True, exist_ok=True)
    OUT = a.out

    from decodescope.kernels.bandwidth import copy_bandwidth_tbs
    from decodescope.kernels.config import LayerSpec, get_config
    from decodescope.kernels.weights import make_layer_weights

    seed = a.seed if a.seed is not None else int(time.time()) % 100000  # fresh inputs per run
    bw = copy_bandwidth_tbs()
    record(check="copy_bandwidth", tbs=f"{bw:.3f}", gpu=torch.cuda.get_device_name(), seed=seed,
           variants=" ".join(a.variants), status="info")  # fmt: skip
    ok = run_probe(a)
    for tp in a.tp:
        cfg = get_config("kimi-k3", tp)
        for T in a.tokens:
            ctx = {"tp": tp, "tokens": T}
            names = ["mma"] + [n for n in a.variants if (n, T) in ok]
            if over_budget(a, "back", ctx):
                break
            back_checks(cfg, T, names, ctx, seed=seed + tp * 1000 + T)
            back_timing(cfg, T, names, ctx, a, bw, seed)
        if a.no_block or not any(("tile", T) in ok for T in a.tokens):
            continue
        if over_budget(a, "block", {"tp": tp}):
            continue
        w = guarded("weights", {"tp": tp}, lambda cfg=cfg: make_layer_weights(
            cfg, LayerSpec(1, "kda", "moe"), seed=0, device=DEV))  # fmt: skip
        if w is None:
            continue
        for T in a.tokens:
            ctx = {"tp": tp, "tokens": T}
            if ("tile", T) not in ok or over_budget(a, "block", ctx):
                continue
            guarded("block", ctx, lambda cfg=cfg, w=w, T=T, ctx=ctx: block_pieces(
                cfg, w, T, ctx, a, seed))  # fmt: skip
        del w
        torch.cuda.empty_cache()
    table = table_md()
    (a.out / "table.md").write_text(table + "\n")
    print("\n" + table, flush=True)
    return 0 if not any(r.get("status") in ("FAIL", "error") for r in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
