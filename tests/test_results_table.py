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
