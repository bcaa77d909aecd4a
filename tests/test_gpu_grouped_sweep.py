"""scripts/gpu_grouped_sweep.py's plumbing on the CPU: the model, the kernels and the timer
replaced by stand-ins (synthetic timings, the exact corners: which row is fastest, the combined
row, the --best-env file). The real run is on the H200 (notes/specialized.md "Session 21")."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def _script():
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_grouped_sweep.py"
    spec = importlib.util.spec_from_file_location("gpu_grouped_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Block:
    N = 16

    def __init__(self):
        self.topk_ids = torch.tensor([[0, 1], [1, 2], [2, 3], [0, 3]], dtype=torch.int32)
        self.acc = torch.zeros(4, 8)
        self.shared_out = torch.zeros(4, 8)

    def experts(self):  # the same sums whatever the knobs, except one broken variant
        broken = os.environ.get("DECODESCOPE_MOE_W2T_BK") == "32"
        self.acc.copy_(torch.arange(32.0).view(4, 8) + (5.0 if broken else 0.0))
        self.shared_out.fill_(1.0)


class _Model:
    def __init__(self, *a, **k):
        self.moe = [_Block()]

    def warmup(self):
        pass


# synthetic microseconds per variant env (the rest: 100)
US = {("DECODESCOPE_MOE_W13T_STAGES", "4"): 95.0, ("DECODESCOPE_MOE_W2T_MT", "2"): 97.0}


def _time(fns, replays):
    us = 100.0
    for (k, v), t in US.items():
        if os.environ.get(k) == v:
            us -= 100.0 - t
    return us, us - 1, us + 1


def test_sweep_rows_combo_and_best_env(monkeypatch, tmp_path):
    from decodescope.kernels import timing
    from decodescope.kernels.specialized import step as S

    sw = _script()
    monkeypatch.setattr(S, "SpecializedModel", _Model)
    monkeypatch.setattr(timing, "graph_time_us", _time)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_RT", "2")  # cleared: base is the defaults
    out, best = tmp_path / "sweep", tmp_path / "best.env"
    rc = sw.main(["--out", str(out), "--variants", "base", "w13_s4", "w2_mt2", "w2_bk32",
                  "--best-env", str(best)])  # fmt: skip
    assert rc == 1  # a variant failed its check
    res = json.loads((out / "results.json").read_text())
    rows = {r["variant"]: r for r in res["rows"]}
    assert set(rows) == {"base", "w13_s4", "w2_mt2", "w2_bk32", "combo"}
    assert rows["base"]["us"] == 100.0 and rows["base"]["env"] == {}
    assert not rows["w2_bk32"]["ok"] and rows["w13_s4"]["ok"]
    assert rows["combo"]["env"] == {"DECODESCOPE_MOE_W13T_STAGES": "4",
                                    "DECODESCOPE_MOE_W2T_MT": "2"}  # fmt: skip
    assert rows["combo"]["us"] == pytest.approx(92.0)
    assert res["info"]["experts_selected"] == 4 and res["info"]["pairs_per_expert"] == 2.0
    assert best.read_text() == (
        "export DECODESCOPE_MOE_W13T_STAGES=4\nexport DECODESCOPE_MOE_W2T_MT=2\n"
    )
    table = (out / "table.md").read_text()
    assert "| combo | W13T_STAGES=4 W2T_MT=2 | 92.0 |" in table and "| FAIL |" in table


def test_no_best_env_below_the_gain(monkeypatch, tmp_path):
    from decodescope.kernels import timing
    from decodescope.kernels.specialized import step as S

    sw = _script()
    monkeypatch.setattr(S, "SpecializedModel", _Model)
    monkeypatch.setattr(timing, "graph_time_us", lambda fns, r: (99.0, 98.0, 100.0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stand-in")
    best = tmp_path / "best.env"
    assert sw.main(["--out", str(tmp_path / "o"), "--variants", "base", "w13_s4",
                    "--best-env", str(best)]) == 0  # fmt: skip
    assert best.read_text() == ""
    with pytest.raises(SystemExit):
        sw.main(["--out", str(tmp_path / "o"), "--variants", "nope"])
