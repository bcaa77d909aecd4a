"""H200 check and timing of the KDA decode split over clusters (``DECODESCOPE_KDA_VSPLIT``,
:mod:`decodescope.kernels.specialized.kda_decode_split`) against the one-CTA kernel.

For each TP shape, point ``BxT`` and split (1 = the one-CTA kernel): correctness first, on two
fresh random draws of the input projection, state and conv history (output poisoned with NaN):
``out``, the FP32 state and the conv history against :func:`kda_decode.kda_decode_ref` (rel. L2
within the GPU attention script's tolerances); then the kernel alone, timed by CUDA-graph replay
over enough copies of the state / history / projection to pass the 50 MB L2 (each launch reads
its state from DRAM, as in the model's step), medians of ``--replays`` replays. Prints a
markdown table and writes ``OUT/kda_split.json``.

    python scripts/gpu_kda_split.py --out $OUT/kda_split [--tp 8 16] [--points 1x1 1x8 2x1 8x1]
        [--splits 1 2 4 8] [--streams 0 2x1 3x1 1x2] [--chains token batched]

``--streams``: with split 1, also the persistent state stream (:mod:`.kda_decode_stream`,
``DECODESCOPE_KDA_STREAM`` values: stages x CTAs per SM; ``0`` the one-CTA kernel).
``--chains``: each kernel with the per-token or the batched chain (``DECODESCOPE_KDA_CHAIN``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

from decodescope.kernels import reference as R
from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.specialized import kda_decode as kda
from decodescope.kernels.timing import graph_time_us
from decodescope.kernels.weights import make_layer_weights, make_state

DEV = "cuda"
BF16 = torch.bfloat16
TOL = {"out": 2e-2, "state": 2e-3}
L2_BYTES = 50 * 2**20


def run_one(fn, cfg, w, proj, s, c, out, p):
    fn(proj, w["conv_w"], c, w["f_b"], w["A_log"], w["dt_bias"], w["o_norm"], s, out)


def check(cfg, w, p, B, T, seed) -> dict:
    g = torch.Generator(device=DEV).manual_seed(seed)
    st = make_state(cfg, LayerSpec(1, "kda", "moe"), B, T, seed=seed, device=DEV)
    proj = (torch.randn(B * T, cfg.kda_in_proj_out, device=DEV, generator=g)).to(BF16)
    s0, c0 = st["kda_state"], st["conv_state"]
    s1, c1 = s0.clone(), c0.clone()
    out = torch.full((B * T, cfg.kda_dim), float("nan"), dtype=BF16, device=DEV)
    fn = kda.compile_plan(p)
    run_one(fn, cfg, w, proj, s1, c1, out, p)
    torch.cuda.synchronize()
    ro, rs, rc = kda.kda_decode_ref(cfg, w, proj, s0, c0, T)
    res = {
        "out": R.rel_l2(out, ro),
        "state": R.rel_l2(s1, rs),
        "conv": R.rel_l2(c1, rc),
        "written": bool(torch.isfinite(out.float()).all()),
    }
    res["ok"] = (res["written"] and res["out"] < TOL["out"] and res["state"] < TOL["state"]
                 and res["conv"] < TOL["state"])  # fmt: skip
    return res


def time_alone(cfg, w, p, B, T, replays: int) -> float:
    st = make_state(cfg, LayerSpec(1, "kda", "moe"), B, T, seed=3, device=DEV)
    per = st["kda_state"].numel() * 4 + st["conv_state"].numel() * 2
    n = max(4, min(256, -(-2 * L2_BYTES // per)))
    ss = [st["kda_state"].clone() for _ in range(n)]
    cs = [st["conv_state"].clone() for _ in range(n)]
    proj = [torch.randn(B * T, cfg.kda_in_proj_out, device=DEV).to(BF16) for _ in range(n)]
    outs = [torch.empty(B * T, cfg.kda_dim, dtype=BF16, device=DEV) for _ in range(n)]
    fn = kda.compile_plan(p)
    fns = [lambda i=i: run_one(fn, cfg, w, proj[i], ss[i], cs[i], outs[i], p) for i in range(n)]
    return graph_time_us(fns, replays)[0]


def stream_value(v: str) -> tuple[int, int]:
    """A ``DECODESCOPE_KDA_STREAM`` value as ``(stages, CTAs per SM)`` (its own parser)."""
    old = os.environ.get(kda.STREAM_ENV)
    os.environ[kda.STREAM_ENV] = v
    try:
        return kda.stream_for(1)
    finally:
        if old is None:
            del os.environ[kda.STREAM_ENV]
        else:
            os.environ[kda.STREAM_ENV] = old


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/kda_split")
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--points", nargs="+", default=["1x1", "1x8", "2x1", "8x1"])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--streams", nargs="+", default=["0"])
    ap.add_argument("--chains", nargs="+", default=["token"], choices=["token", "batched"])
    ap.add_argument("--replays", type=int, default=30)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_kda_split: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    rows, t0 = [], time.time()
    print("| tp | B | T | split | stream | chain | CTAs | out err | state err | conv err | us alone "
          "| status |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tp in a.tp:
        cfg = get_config("kimi-k3", tp)
        w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=tp, device=DEV)
        for pt in a.points:
            B, T = (int(x) for x in pt.split("x"))
            one = [(s, c) for s in a.streams for c in a.chains]
            for vs, (sv, ch) in [
                (v, x) for v in a.splits for x in (one if v == 1 else [("0", c) for c in a.chains])
            ]:
                ns, cpsm = stream_value(sv)
                p = dataclasses.replace(kda.plan_for(cfg, B, T), vsplit=vs, stream=ns,
                                        stream_cpsm=cpsm, chain=ch)  # fmt: skip
                ctas = p.heads * B * vs
                if ns:
                    ctas = min(ctas, kda.NUM_SMS * cpsm)
                row = {"tp": tp, "batch": B, "tokens": T, "vsplit": vs, "stream": sv,
                       "chain": ch, "ctas": ctas}  # fmt: skip
                try:
                    chk = [check(cfg, w, p, B, T, seed=11 + d) for d in range(2)]
                    row.update({k: max(c[k] for c in chk) for k in ("out", "state", "conv")})
                    row["ok"] = all(c["ok"] for c in chk)
                    row["us"] = time_alone(cfg, w, p, B, T, a.replays) if row["ok"] else None
                except Exception as ex:  # noqa: BLE001 (reported; the next point runs)
                    row.update({"ok": False, "error": f"{type(ex).__name__}: {ex}"[:300]})
                rows.append(row)
                us = f"{row['us']:.2f}" if row.get("us") else "-"
                errs = " | ".join(f"{row[k]:.1e}" if k in row else "-"
                                  for k in ("out", "state", "conv"))  # fmt: skip
                status = "PASS" if row["ok"] else ("ERROR " + row.get("error", "FAIL"))
                print(f"| {tp} | {B} | {T} | {vs} | {sv} | {ch} | {row['ctas']} | {errs} | {us} "
                      f"| {status} |", flush=True)  # fmt: skip
    with open(os.path.join(a.out, "kda_split.json"), "w") as f:
        json.dump({"rows": rows, "tol": TOL, "gpu": torch.cuda.get_device_name(),
                   "seconds": round(time.time() - t0, 1)}, f, indent=1)  # fmt: skip
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} PASS ({time.time() - t0:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
