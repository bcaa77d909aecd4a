"""The two-GPU fused reductions on real GPUs (``pytest -m gpu``, a host with 2 GPUs and NVLink).

Runs ``scripts/gpu_tp2_fused.py`` under ``torchrun --nproc-per-node 2`` without its timing part
(kimi-k3 TP8 and TP2 per-rank shapes, batch 1 and 64, bursts of CUDA-graph replays with one rank
lagging) and asserts that every check passed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA GPUs")  # fmt: skip
def test_tp2_fused_reductions(tmp_path):
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--nproc-per-node", "2", str(ROOT / "scripts" / "gpu_tp2_fused.py"),
            "--out", str(tmp_path), "--batches", "1", "64", "--burst", "16", "--no-timing"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    checks = [r for r in rows if "check" in r]
    assert checks, "no checks ran"
    bad = [r for r in rows if r.get("status") in ("FAIL", "error")]
    assert not bad, bad
