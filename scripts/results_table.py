"""Print the README's results section (markdown) from the committed results dataset."""

from __future__ import annotations

import sys
from pathlib import Path

from decodescope.tracer.dataset import read_runs
from decodescope.ui import cmd_bench
from decodescope.ui.cmd_demo import _pairs


def main(path: str = "results") -> None:
    runs = read_runs(Path(path))
    pairs = _pairs(runs)
    commits = sorted({(r.meta.git_commit or "?")[:10] for r in runs})
    dates = sorted({str(r.meta.created_at)[:16] for r in runs})
    gpu = runs[0].meta.gpu
    print(
        f"Measured by `decodescope bench` on one {gpu} (tp_world 1: the per-rank shapes of TP8 "
        f"and TP16 without communication), runs of {dates[0]} to {dates[-1]} UTC, commits "
        f"{', '.join(commits)} (the newest run of each setup is shown; `results/` keeps them "
        "all); each figure the median over 30 CUDA-graph replays of one KDA and one gated-MLA "
        "layer, each with its LatentMoE block, BF16 experts. Batch `1x8` is the verify step of "
        "speculative decoding: 1 sequence of 1+7 tokens. The floor is the layer's bytes "
        "(weights, the experts the batch's routing selected, state, cache) over the copy "
        "bandwidth measured in the same process (4.10-4.18 TB/s); runs of commit 688d6c5 did "
        "not record the bandwidth yet.\n"
    )
    print(
        "| tp_shape | batch | kind | std kernels | spec kernels | std us | spec us | speedup "
        "| floor us | std / floor | spec / floor | commit |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    proj = []
    commit: dict[tuple, str] = {}
    for (_preset, tp, batch, tps), by in sorted(
        pairs.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][3])
    ):
        rows = {}
        commit[(tp, batch, tps)] = ", ".join(
            sorted({(r.meta.git_commit or "?")[:7] for r in by.values()})
        )
        for backend, run in by.items():
            for r in cmd_bench.kind_rows(run, backend, batch, tps):
                rows[(backend, r["layer_kind"])] = r
        allrows = list(rows.values())
        for p in cmd_bench.projections(allrows, 6.0):
            proj.append((tp, p))
        for kind in ("kda", "mla"):
            s, p = rows.get(("standard", kind)), rows.get(("specialized", kind))
            if not s or not p:
                continue
            fl = s.get("floor_us") or p.get("floor_us")
            f = (lambda x: f"{x:.2f}") if fl else (lambda x: "-")
            print(
                f"| {tp} | {batch}{'' if tps == 1 else f'x{tps}'} | {kind} | {s['kernels']:.0f} "
                f"| {p['kernels']:.0f} | {s['span_us']:,.1f} | {p['span_us']:,.1f} "
                f"| {s['span_us'] / p['span_us']:.2f}x | {f'{fl:,.1f}' if fl else '-'} "
                f"| {f(s['span_us'] / fl) if fl else '-'} | {f(p['span_us'] / fl) if fl else '-'} "
                f"| {commit[(tp, batch, tps)]} |"
            )
    print(
        "\nPROJECTION (not a served-request measurement): the full model's decode step as "
        "69 KDA + 24 MLA layer spans (the dense layer 0 and everything outside the layers are "
        "not measured and not included), tok/s = batch / step:\n"
    )
    print("| tp_shape | batch | std step ms | spec step ms | std tok/s | spec tok/s | ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    keyed = {}
    for tp, p in proj:
        keyed[(tp, p["batch"], p["tokens_per_seq"], p["backend"])] = p
    for tp, batch, tps in sorted({(k[0], k[1], k[2]) for k in keyed}):
        s, p = keyed.get((tp, batch, tps, "standard")), keyed.get((tp, batch, tps, "specialized"))
        if s and p:
            print(
                f"| {tp} | {batch}{'' if tps == 1 else f'x{tps}'} | {s['step_us'] / 1e3:.2f} "
                f"| {p['step_us'] / 1e3:.2f} | {s['tok_s']:,.1f} | {p['tok_s']:,.1f} "
                f"| {p['tok_s'] / s['tok_s']:.2f}x |"
            )


if __name__ == "__main__":
    main(*sys.argv[1:])
