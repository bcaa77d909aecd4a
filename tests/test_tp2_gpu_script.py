"""scripts/gpu_tp2.py's checks, dry-run on a CPU with the tiny preset and gloo: the same code
path the H200 pair runs (weights built whole on each rank, sharded, broadcast of the TP1 result,
rank 1's weights sent to rank 0 for the sum-of-partials reference), without graphs or timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_tp2.py"


def test_gpu_tp2_dry_run_on_cpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--pieces", "tp2_kda,tp8",
         "--preset", "tiny", "--tp-shape", "2", "--batch", "1", "--tp2-batch", "2",
         "--allreduce", "nccl", "--budget", "300"],
        capture_output=True, text=True, timeout=400, env=env,
    )  # fmt: skip
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    checks = {(r["piece"], r["check"]): r for r in rows if r.get("rank", 0) == 0}
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    tp2 = checks[("tp2_kda", "TP2 vs TP1 batch 2 (nccl)")]
    assert tp2["ok"] and tp2["routing_agree"] == 1.0 and tp2["rel_err_x"] < 3e-2
    tp8 = checks[("tp8", "TP8 shapes x2 GPUs vs sum of partials, batch 1 (nccl)")]
    assert tp8["ok"] and tp8["rel_err_x"] < 3e-2
    assert "PASS" in p.stdout.splitlines()[-3] or "0 failed" in p.stdout
