"""Print the README's results section (markdown) from the committed results dataset.

    python scripts/results_table.py [results]

Every figure comes from the runs in the dataset: the newest run of each setup (preset, tp_shape,
tp_world, batch, tokens per sequence, backend) is shown; the text names their commits, dates,
GPU and the copy-bandwidth range they measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

from decodescope.tracer.dataset import read_runs
from decodescope.ui import cmd_bench
from decodescope.ui.cmd_demo import _pairs, without_vllm
from decodescope.ui.cmd_report import chunk_note, knobs_of

KINDS = ("dense", "kda", "mla")
DESCRIBE = {
    "dense": "the dense layer 0 (KDA attention, dense MLP)",
    "kda": "a KDA layer",
    "mla": "a gated-MLA layer (each with its LatentMoE block)",
}


def _batch(batch: int, tps: int) -> str:
    return f"{batch}" if tps == 1 else f"{batch}x{tps}"


def _setup(run) -> str:
    m = run.meta
    return f"TP{m.tp_shape} x{m.tp_world or 1} {_batch(m.batch, m.tokens_per_seq or 1)}"


def main(path: str = "results") -> None:
    runs = read_runs(Path(path))
    pairs = _pairs(runs)
    shown = [r for by in pairs.values() for r in by.values()]
    commits = sorted({(r.meta.git_commit or "?")[:7] for r in shown})
    dates = sorted({str(r.meta.created_at)[:16] for r in shown})
    bws = sorted(r.meta.copy_bw_tbs for r in shown if r.meta.copy_bw_tbs)
    gpu = shown[0].meta.gpu
    worlds = sorted({k[2] for k in pairs})
    kinds = {r["layer_kind"] for x in shown for r in cmd_bench.kind_rows(x, "", 1, 1)}
    print(
        f"Measured by `decodescope bench` on {gpu} GPUs (tp_world 1: one GPU running the "
        f"per-rank shapes of TP8 and TP16 without communication"
        + (", tp_world 2: two GPUs on NVLink with real all-reduces" if 2 in worlds else "")
        + f"), runs of {dates[0]} to {dates[-1]} UTC, commit(s) {', '.join(commits)} (the "
        "newest run of each setup is shown, on the standard side the newest with vLLM's "
        "compiled ops; `results/` keeps them all"
        + (
            "; these standard runs had none of vLLM's ops and are not the vLLM baseline: "
            + ", ".join(sorted(_setup(r) for r in shown if without_vllm(r.meta)))
            if any(without_vllm(r.meta) for r in shown)
            else ""
        )
        + "). Each figure is the "
        "median over 30 CUDA-graph replays of one decode step of "
        + ", ".join(DESCRIBE[k] for k in KINDS if k in kinds)
        + ", BF16 weights. Batch `BxT` is "
        "the verify step of speculative decoding: B sequences of 1+7 tokens. The floor is the "
        "layer's bytes (weights, the experts the batch's routing selected, state, cache) over "
        "the copy bandwidth measured in the same process"
        + (f" ({bws[0]:.2f}-{bws[-1]:.2f} TB/s)" if bws else "")
        + "; each setup shows the lower of its two runs' floors (the faster copy measured).\n"
    )
    print(
        "| tp_shape | tp_world | batch | kind | std kernels | spec kernels | std us | spec us "
        "| speedup | floor us | std / floor | spec / floor | std share | spec share "
        "| spec share / floor | share speedup | commit |"
    )
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    proj = []
    for (_preset, tp, tpw, batch, tps), by in sorted(
        pairs.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][4], kv[0][3])
    ):
        rows = {}
        commit = ", ".join(sorted({(r.meta.git_commit or "?")[:7] for r in by.values()}))
        for backend, run in by.items():
            for r in cmd_bench.kind_rows(run, backend, batch, tps):
                rows[(backend, r["layer_kind"])] = r
        for p in cmd_bench.projections(list(rows.values()), 6.0):
            proj.append((tp, tpw, p))
        for kind in KINDS:
            s, p = rows.get(("standard", kind)), rows.get(("specialized", kind))
            if not s and not p:
                continue
            fl = cmd_bench.pair_floor(s, p)

            def cell(r, key, fmt):
                return fmt.format(r[key]) if r and r.get(key) is not None else "-"

            ratio = f"{s['span_us'] / p['span_us']:.2f}x" if s and p else "-"
            s_eff = f"{s['span_us'] / fl:.2f}" if s and fl else "-"
            p_eff = f"{p['span_us'] / fl:.2f}" if p and fl else "-"
            p_sh_eff = f"{p['share_us'] / fl:.2f}" if p and fl and p.get("share_us") else "-"
            sh = (
                f"{s['share_us'] / p['share_us']:.2f}x"
                if s and p and s.get("share_us") and p.get("share_us")
                else "-"
            )
            print(
                f"| {tp} | {tpw} | {_batch(batch, tps)} | {kind} | {cell(s, 'kernels', '{:.0f}')} "
                f"| {cell(p, 'kernels', '{:.0f}')} | {cell(s, 'span_us', '{:,.1f}')} "
                f"| {cell(p, 'span_us', '{:,.1f}')} | {ratio} | {f'{fl:,.1f}' if fl else '-'} "
                f"| {s_eff} | {p_eff} | {cell(s, 'share_us', '{:,.1f}')} "
                f"| {cell(p, 'share_us', '{:,.1f}')} | {p_sh_eff} | {sh} | {commit} |"
            )
    chunked = sorted(
        {
            (r.meta.tp_shape, _batch(r.meta.batch, r.meta.tokens_per_seq or 1), chunk_note(r.meta))
            for r in shown
            if chunk_note(r.meta)
        },  # fmt: skip
        key=lambda c: (c[0], c[2]),
    )
    if chunked:
        print(
            "\nThe specialized fused kernels take at most 64 tokens per launch; how the larger "
            "steps ran (kernels that ran per sequence chunk read their weights once per "
            "chunk): " + "; ".join(f"TP{tp} {b}: {note}" for tp, b, note in chunked) + "."
        )
    knobbed = sum(1 for r in runs if knobs_of(r.meta))
    if knobbed:
        print(
            f"\n{knobbed} run(s) in `results/` were captured with kernel knobs set through the "
            "environment (`DECODESCOPE_*`, recorded in each run): A/B runs of other kernels, "
            "left out of these tables (`decodescope report` shows a run's knobs)."
        )
    dense = {p["dense_layer"] for _, _, p in proj}
    print(
        "\nPROJECTION (not a served-request measurement): the full model's decode step as the "
        "sum of 69 KDA + 24 MLA layers' shares of the step (span less the overlap with the "
        "previous layer)"
        + (
            " + the measured dense layer 0"
            if dense == {"measured"}
            else " (the dense layer 0 is included only where it was measured: "
            + ", ".join(sorted(dense))
            + ")"
        )
        + "; nothing outside the layers (embedding, lm_head, sampling) is included; "
        "tok/s = batch / step, or batch x 6 accepted tokens / step for the verify step "
        "(synthetic acceptance 6):\n"
    )
    print(
        "| tp_shape | tp_world | batch | std step ms | spec step ms | std tok/s | spec tok/s "
        "| ratio |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    keyed = {}
    for tp, tpw, p in proj:
        keyed[(tpw, tp, p["tokens_per_seq"], p["batch"], p["backend"])] = p
    for tpw, tp, tps, batch in sorted({k[:4] for k in keyed}):
        s = keyed.get((tpw, tp, tps, batch, "standard"))
        p = keyed.get((tpw, tp, tps, batch, "specialized"))
        if s and p:
            print(
                f"| {tp} | {tpw} | {_batch(batch, tps)} | {s['step_us'] / 1e3:.2f} "
                f"| {p['step_us'] / 1e3:.2f} | {s['tok_s']:,.1f} | {p['tok_s']:,.1f} "
                f"| {p['tok_s'] / s['tok_s']:.2f}x |"
            )


def cli(argv: list[str] | None = None) -> int:
    """``python scripts/results_table.py [DATASET]``; a path that is not a results dataset: a
    one-line error naming it, exit 2."""
    import argparse

    from decodescope.tracer.errors import TraceError

    ap = argparse.ArgumentParser(description="Print the README's results section (markdown).")
    ap.add_argument("dataset", nargs="?", default="results", help="results dataset folder")
    a = ap.parse_args(argv)
    try:
        main(a.dataset)
    except TraceError as e:
        print(f"results_table.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
