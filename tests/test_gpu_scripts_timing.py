"""The GPU check scripts time with one shared CUDA-graph helper (decodescope.kernels.timing);
importing them needs no GPU."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from decodescope.kernels import timing

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize(
    "name", ["gpu_back_tile", "gpu_mla_tc", "gpu_specialized_attn", "gpu_specialized_moe"]
)
def test_scripts_use_the_shared_graph_timing(name):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.graph_time_us is timing.graph_time_us
