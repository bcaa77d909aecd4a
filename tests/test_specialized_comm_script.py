"""``scripts/gpu_tp2_fused.py --dry-run`` on a CPU: two gloo processes (torchrun), the fused
kernels emulated by torch + dist. Checks the script's own logic (pieces, collectives in step on
both ranks, graph stand-in, results.json, the table), not the kernels."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_tp2_fused_dry_run(tmp_path):
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--nproc-per-node", "2", str(ROOT / "scripts" / "gpu_tp2_fused.py"), "--dry-run",
            "--out", str(tmp_path), "--tps", "8", "--batches", "1", "--burst", "2",
            "--replays", "2", "--copies", "1"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    names = {r.get("check") or r.get("timing") for r in rows}
    for want in ("oproj_vs_exact", "oproj_burst_layerB", "moe_burst", "oproj", "moe_back"):
        assert want in names, want
    assert not [r for r in rows if r.get("status") in ("FAIL", "error")]
    assert "PASS: 0 failing" in proc.stdout
