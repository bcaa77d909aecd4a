"""Where the early one-token route's time goes (GPU; ``DECODESCOPE_MOE_T1_EARLY``).

Builds the specialized step (one token) with the early route, captures it as a CUDA graph,
replays it and reads, after each replay, the global-timer stamps that ``FrontMmaEarly`` and
``RouteT1Early`` write into their words (``front_mma.STAMPS``): when the front's CTA 0 became
resident, when its last router CTA counted in, when the route kernel became resident, passed
the count, finished ranking, and returned from its PDL wait (the front complete). Prints, per MoE
layer, the medians over replays in microseconds from the front's CTA 0, and writes them as
JSON. Session 28 (notes/specialized.md, part 30) left open which of these the +9 us per layer
came from.

    DECODESCOPE_MOE_T1_EARLY=4 python scripts/early_stamps.py --tp 16 --replays 50 --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

PHASES = ("router_done", "route_resident", "route_counted", "route_ranked", "route_waited")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="kimi-k3")
    ap.add_argument("--tp", type=int, default=16)
    ap.add_argument("--layers", default="kda,mla")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="folder for stamps.json")
    a = ap.parse_args()
    if os.environ.get("DECODESCOPE_MOE_T1_EARLY", "") in ("", "0"):
        print("error: set DECODESCOPE_MOE_T1_EARLY=2 or 4 (the early route writes the stamps)",
              file=sys.stderr)  # fmt: skip
        return 2

    import torch

    import decodescope.kernels.specialized.step as spec_step
    from decodescope.kernels.specialized import front_mma as fm

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_steps import capture_graph  # the same warm-up and capture as the step checks

    spec = spec_step.specialized(preset=a.preset, tp_shape=a.tp, batch=1, tokens_per_seq=1,
                                 layers=a.layers, seed=a.seed)  # fmt: skip
    model = spec.model
    g = capture_graph(model.step)  # warmed up first: the blocks made their early buffers
    blocks = [(i, b) for i, b in enumerate(model.moe) if b is not None]
    missing = [i for i, b in blocks if getattr(b, "_t1_early", None) is None]
    if missing:
        print(f"error: MoE layer(s) {missing} ran without the early route (one token, the "
              "t1 experts with RouteT1 and the tensor-core front are needed)",
              file=sys.stderr)  # fmt: skip
        return 2
    rel: dict[int, dict[str, list[float]]] = {i: {p: [] for p in PHASES} for i, _ in blocks}
    for _ in range(a.replays):
        g.replay()
        torch.cuda.synchronize()
        for i, b in blocks:
            s = fm.read_stamps(b._t1_early[1])
            for p in PHASES:
                rel[i][p].append((s[p] - s["front_cta0"]) / 1e3)
    out = {i: {p: statistics.median(v) for p, v in ph.items()} for i, ph in rel.items()}
    print(f"early route stamps, us from the front's CTA 0 (median of {a.replays} replays; "
          f"{a.preset} TP{a.tp}, DECODESCOPE_MOE_T1_EARLY="
          f"{os.environ['DECODESCOPE_MOE_T1_EARLY']})")  # fmt: skip
    print("| layer | " + " | ".join(PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    for i, m in out.items():
        print(f"| {i} | " + " | ".join(f"{m[p]:.1f}" for p in PHASES) + " |")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "stamps.json").write_text(json.dumps({"medians_us": out, "raw_us": rel}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
