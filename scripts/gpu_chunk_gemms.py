"""cuBLAS over all of a chunked verify step's tokens: what the token-parallel ops would cost.

The specialized kernels take at most 64 tokens, so the 32x8 / 64x8 verify steps (256 / 512
tokens) run the attention projections and the MoE front / back once per 64-token chunk, each
launch reading its weights again (notes/specialized.md "Session 20"). This times the same
projections as cuBLAS GEMMs over all of the step's tokens (one weight read), at the per-rank
shapes of TP8 and TP16, and probes the torch calls such a path would use (``out_dtype``):

- ``front``: ``y_front[N, E + L + 2S] fp32 = h @ w_front^T`` (router, latent down, shared
  gate/up packed as ``router_topk.pack_front_weights`` packs them);
- ``back``: ``out = bf16(rmsnorm(acc) * latent_norm @ latent_up^T + shared_out)`` as torch ops
  (the norm, the GEMM, the add) and the GEMM alone (``back_mm``);
- ``in_proj`` (KDA), ``qkv_a`` + ``g_proj`` (MLA), ``o_proj`` (residual add in the GEMM).

Medians of CUDA-graph replays over weight copies rotated past the 50 MB L2, fresh random
inputs; each row gives the bytes moved and the rate. Nothing here is checked for speed.

    python scripts/gpu_chunk_gemms.py --out $OUT/chunk_gemms [--tp 8 16] [--tokens 64 256 512]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from decodescope.kernels.config import get_config
from decodescope.kernels.timing import graph_time_us

BF16, F32 = torch.bfloat16, torch.float32


def probe() -> dict[str, str]:
    """Which ``out_dtype`` forms this torch takes on the GPU (bf16 inputs, fp32 output)."""
    a = torch.randn(64, 256, device="cuda", dtype=BF16)
    b = torch.randn(128, 256, device="cuda", dtype=BF16)
    c = torch.randn(64, 128, device="cuda", dtype=F32)
    ref = a.float() @ b.float().t()
    out: dict[str, str] = {}
    forms = {
        "mm_out_dtype": lambda: torch.mm(a, b.t(), out_dtype=F32),
        "mm_out_dtype_out": lambda: torch.mm(
            a, b.t(), out_dtype=F32, out=torch.empty(64, 128, device="cuda", dtype=F32)
        ),
        "addmm_out_dtype": lambda: torch.addmm(c, a, b.t(), out_dtype=F32) - c,
    }
    for name, fn in forms.items():
        try:
            y = fn()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            out[name] = f"ok dtype {y.dtype} rel {err:.1e}"
        except Exception as e:  # noqa: BLE001 - the probe reports what this torch refuses
            out[name] = f"refused: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return out


def copies_for(nbytes: int) -> int:
    return max(2, -(-200_000_000 // nbytes))


def cases(cfg, n: int) -> dict:
    """Per op: (a function of one weight copy, the bytes it moves, the weight shape)."""
    H, L, S, E = cfg.hidden, cfg.expert_dim, cfg.shared_inter, cfg.moe.num_experts
    g = torch.Generator(device="cuda").manual_seed(n)

    def rnd(*shape, dtype=BF16):
        return torch.randn(*shape, device="cuda", dtype=F32, generator=g).to(dtype) * 0.05

    h = rnd(n, H)
    out: dict = {}

    def gemm(name, rows, k, out_dtype, residual=False):
        x = rnd(n, k)
        res = rnd(n, rows) if residual else None
        y = torch.empty(n, rows, device="cuda", dtype=out_dtype)
        nbytes = rows * k * 2 + n * k * 2 + n * rows * y.element_size() * (2 if residual else 1)

        def make(w):
            if residual:
                return lambda: torch.addmm(res, x, w.t(), out=y)
            if out_dtype == F32:
                return lambda: torch.mm(x, w.t(), out_dtype=F32, out=y)
            return lambda: torch.mm(x, w.t(), out=y)

        out[name] = (make, nbytes, (rows, k))

    gemm("front", E + L + 2 * S, H, F32)
    gemm("in_proj", cfg.kda_in_proj_out, H, BF16)
    gemm("qkv_a", cfg.mla_qkv_a_out, H, BF16)
    gemm("g_proj", cfg.mla_v_dim, H, BF16)
    gemm("o_proj_kda", H, cfg.kda_dim, BF16, residual=True)
    gemm("back_mm", H, L, F32)
    acc, shared = rnd(n, L, dtype=F32), rnd(n, H, dtype=F32)
    nw = rnd(L, dtype=F32) + 1.0
    a = torch.empty(n, L, device="cuda", dtype=BF16)
    y = torch.empty(n, H, device="cuda", dtype=F32)
    o = torch.empty(n, H, device="cuda", dtype=BF16)

    def back(w):
        def f():
            a.copy_(torch.nn.functional.rms_norm(acc, (L,), nw, cfg.eps))
            torch.mm(a, w.t(), out_dtype=F32, out=y)
            torch.add(y, shared, out=o)

        return f

    out["back"] = (back, H * L * 2 + n * L * 4 * 2 + n * L * 2 + n * H * 4 * 3 + n * H * 2, (H, L))
    del h
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512])
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pr = probe()
    for k, v in pr.items():
        print(f"probe {k}: {v}", flush=True)
    rows = []
    for tp in args.tp:
        cfg = get_config("kimi-k3", tp)
        for n in args.tokens:
            for name, (make, nbytes, shape) in cases(cfg, n).items():
                try:
                    ws = [
                        torch.randn(*shape, device="cuda", dtype=BF16) * 0.02
                        for _ in range(copies_for(shape[0] * shape[1] * 2))
                    ]
                    med, lo, hi = graph_time_us([make(w) for w in ws], args.replays)
                    del ws
                    row = {"tp": tp, "tokens": n, "op": name, "us": med, "min": lo, "max": hi,
                           "mbytes": nbytes / 1e6, "tbs": nbytes / med / 1e6}  # fmt: skip
                except Exception as e:  # noqa: BLE001 - a refused form is a row, not a stop
                    row = {"tp": tp, "tokens": n, "op": name, "error": f"{type(e).__name__}: {e}"}
                rows.append(row)
                (args.out / "results.json").write_text(json.dumps({"probe": pr, "rows": rows}))
                torch.cuda.empty_cache()
    lines = ["| tp | tokens | op | us (median) | min | max | MB | TB/s |", "|---" * 8 + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['tp']} | {r['tokens']} | {r['op']} | {r['error'][:80]} |||||")
            continue
        lines.append(
            f"| {r['tp']} | {r['tokens']} | {r['op']} | {r['us']:.1f} | {r['min']:.1f} | "
            f"{r['max']:.1f} | {r['mbytes']:.1f} | {r['tbs']:.2f} |"
        )
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
