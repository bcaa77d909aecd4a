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
