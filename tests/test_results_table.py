"""``scripts/results_table.py``: the README's results section is what the script prints from the
committed ``results/`` dataset (the real H200 runs), so no figure in it is typed by hand; a path
that is not a dataset is a one-line error and exit 2."""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "results_table", ROOT / "scripts/results_table.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_section_is_the_scripts_output():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _script().cli([str(ROOT / "results")]) == 0
    readme = (ROOT / "README.md").read_text()
    a = readme.index("Measured by `decodescope bench`")
    b = readme.index("The reference, on other hardware")
    assert readme[a:b].strip() == out.getvalue().strip()


def test_bad_dataset(tmp_path, capsys):
    assert _script().cli([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(tmp_path) in err and "\n" not in err


def test_pair_floor_is_the_faster_copy():
    """A real pair (H200, 5f7e049, TP8 batch 32 KDA layer): the standard run's process measured
    3.90 TB/s, the specialized run's 4.14, for the same 3.01 GB of layer bytes. The standard
    run's floor (773.3 us) would put the specialized span (734.0) below its floor; the table
    holds both paths to the lower one (``cmd_bench.pair_floor``, which the bench's own table uses
    too). A path with no run gives its partner's floor."""
    from decodescope.tracer.dataset import read_runs
    from decodescope.ui import cmd_bench

    ids = {"standard-20261204T115612-99bf84", "specialized-20261204T115620-5ff904"}
    runs = {r.meta.backend: r for r in read_runs(ROOT / "results") if r.meta.run_id in ids}
    assert set(runs) == {"standard", "specialized"}
    rows = {
        b: next(k for k in cmd_bench.kind_rows(r, b, 32, 1) if k["layer_kind"] == "kda")
        for b, r in runs.items()
    }
    std, spec = rows["standard"], rows["specialized"]
    assert std["floor_us"] > spec["span_us"] > spec["floor_us"]
    assert cmd_bench.pair_floor(std, spec) == spec["floor_us"]
    assert cmd_bench.pair_floor(None, spec) == spec["floor_us"]
    assert cmd_bench.pair_floor(std, None) == std["floor_us"]
    assert cmd_bench.pair_floor(None, None) is None


def test_standard_side_is_the_vllm_baseline():
    """Session 39's verify-step runs (eb1204e) ran on a GPU machine without vLLM's compiled ops:
    their standard runs used the project's stand-ins (a torch ``moe_align`` of some 30 launches,
    54 kernels per KDA layer at TP8 32x8 against 22). They are kept apart from ``results/``
    (``notes/gpu-logs/s39/std_no_vllm``); read with it, the tables keep the newest standard run
    with vLLM's ops (ae03bef) beside the newest specialized one."""
    from decodescope.tracer.dataset import read_runs
    from decodescope.ui.cmd_demo import _pairs, without_vllm

    runs = read_runs(ROOT / "results") + read_runs(ROOT / "notes/gpu-logs/s39/std_no_vllm")
    by_id = {r.run_id: r for r in runs}
    new = by_id["standard-20261205T023411-a8683b"]  # TP8 32x8, eb1204e, no vLLM ops
    old = by_id["standard-20261204T182246-263a94"]  # TP8 32x8, ae03bef, vLLM's ops
    assert without_vllm(new.meta) and not without_vllm(old.meta)
    assert new.meta.created_at > old.meta.created_at
    pair = _pairs(runs)[("kimi-k3", 8, 1, 32, 8)]
    assert pair["standard"].run_id == old.run_id
    assert (pair["specialized"].meta.git_commit or "").startswith("eb1204e")
    assert not any(without_vllm(r.meta) for by in _pairs(runs).values() for r in by.values())
    only_new = _pairs([new])[("kimi-k3", 8, 1, 32, 8)]  # no run with vLLM's ops: shown
    assert only_new["standard"].run_id == new.run_id
