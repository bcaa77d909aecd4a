"""Fixtures shared by test files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

_SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def gks():
    """``scripts/gpu_kda_split.py`` as a module (its checks against the KDA decode's
    reference), for the KDA decode's GPU tests; skips without a CUDA GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = importlib.util.spec_from_file_location("gpu_kda_split", _SCRIPTS / "gpu_kda_split.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
