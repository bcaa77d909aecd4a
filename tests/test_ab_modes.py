"""scripts/ab_modes.py on the real bench JSON files of part 43 (H200, session 34)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
S34 = ROOT / "notes" / "gpu-logs" / "s34"


def _mod():
    spec = importlib.util.spec_from_file_location("ab_modes", ROOT / "scripts" / "ab_modes.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _tp16(name: str) -> str:
    return f"{S34 / 'n2' / f't16{name}.json'},{S34 / 'n4' / f't16{name}2.json'}"


def test_tp16_table_matches_notes():
    ab = _mod()
    modes = ab.parse_modes([f"default={_tp16('d')}", f"auto={_tp16('a')}", f"issued={_tp16('i')}"])
    rows = {r["batch"]: r for r in ab.compare(modes, "mla")}
    assert sorted(rows) == [1, 8, 24, 64]
    assert rows[1]["modes"]["auto"] is None  # auto's runs skip batch 1
    a8 = rows[8]["modes"]["auto"]
    assert a8["span_us"] == pytest.approx(-13.6, abs=0.05)
    assert [round(v, 2) for v in a8["share_us"]] == [-0.83, -0.88]
    assert [round(v) for v in a8["step_us"]] == [-86, -84]
    i64 = rows[64]["modes"]["issued"]
    assert [round(v) for v in i64["step_us"]] == [118, 182]
    assert round(rows[24]["baseline_step_spread_us"]) == 58
    md = ab.markdown(list(rows.values()), "mla")
    assert "| b8 | -13.6, -0.83 / -0.88, -86 / -84 |" in md


def test_bad_input(tmp_path, capsys):
    ab = _mod()
    bad = tmp_path / "x.json"
    bad.write_text('{"rows": []}')
    assert ab.main([f"default={bad}", f"b={bad}"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "not a `decodescope bench --json` file" in err
    assert ab.main(["default"]) == 2
    assert "expected NAME=FILE" in capsys.readouterr().err


def test_mixed_setups_refused(capsys):
    ab = _mod()
    t8 = S34 / "n3" / "t8d.json"
    assert ab.main([f"default={_tp16('d')}", f"x={t8}"]) == 2
    assert "another setup" in capsys.readouterr().err


S35 = ROOT / "notes" / "gpu-logs" / "s35"


def _pair(n: str, tp: int, tag: str) -> str:
    return f"{S35 / n / f't{tp}{tag}.json'},{S35 / n / f't{tp}{tag}2.json'}"


def test_ops_per_kernel_matches_notes():
    """``--ops``: per kernel from the bench's dataset (part 45, TP8, `rn` against the default):
    the MLA decode at one token is where the layer lost, with 4 more registers."""
    ab = _mod()
    modes = ab.parse_modes([f"default={_pair('n3', 8, 'd')}", f"rn={_pair('n3', 8, 'r')}"])
    rows = ab.compare_ops(modes, str(S35 / "n3" / "ab"), "mla")
    by = {(r["batch"], r["kernel"]): r for r in rows}
    dec = by[(1, "mla_decode_splitMLADecodeSplit")]
    assert dec["op"] == "w_uk_bmm+cache_insert+mla_decode+w_uv_bmm+gate_mul"
    assert round(dec["baseline_us"], 2) == 16.38
    assert [round(v, 2) for v in dec["modes"]["rn"]["us"]] == [2.52, 1.78]
    assert (dec["baseline_registers"], dec["modes"]["rn"]["registers"]) == (88, 92)
    route = by[(8, "moe_groupedGroupedRoute")]["modes"]["rn"]
    assert all(v < -1.0 for v in route["us"]) and route["registers"] == 161
    md = ab.ops_markdown(rows, min_us=0.3)
    assert "| +2.52 / +1.78 (88 -> 92) |" in md
    assert "experts_t1RouteT1" not in md  # moved by less than 0.3 us at TP8
    assert "experts_t1RouteT1" in ab.ops_markdown(rows)


def test_ops_bad_dataset(tmp_path, capsys):
    ab = _mod()
    modes = [f"default={_pair('n3', 8, 'd')}", f"rn={_pair('n3', 8, 'r')}"]
    assert ab.main([*modes, "--ops", str(tmp_path)]) == 2
    assert f"{tmp_path}: not a decodescope dataset" in capsys.readouterr().err
    assert ab.main([*modes, "--ops", str(S35 / "n2" / "ab")]) == 2  # TP16's runs, not these
    assert "no kernels of run(s) specialized-" in capsys.readouterr().err


S39 = ROOT / "notes" / "gpu-logs" / "s39"


def test_ops_new_kernels_and_op_totals():
    """Part 52 (H200, session 39, TP8 32x8 / 64x8, two datasets joined by a comma): a knob that
    replaces kernels lists the ones only it ran as ``new`` (the merged qkv_a + g_proj GEMM, the
    up-projection adding in its epilogue), those it dropped as ``-``, and each op's total, so
    the op's gain reads as one number."""
    ab = _mod()
    d, x = (f"{S39 / 'n52b' / f'v8{t}.json'},{S39 / 'n52c' / f'v8{t}2.json'}" for t in "dx")
    modes = ab.parse_modes([f"default={d}", f"all={x}"])
    ds = f"{S39 / 'n52b' / 'ab'},{S39 / 'n52c' / 'ab'}"
    rows = ab.compare_ops(modes, ds, "mla")
    op = "input_residual_norm+fused_qkv_a_proj+g_proj"
    first = [r for r in rows if (r["batch"], r["tokens_per_seq"], r["op"]) == (32, 8, op)]
    assert first[-1]["kernel"] == ab.TOTAL  # each op's total comes last
    new = [r for r in first if r["baseline_us"] is None]
    assert len(new) == 1 and new[0]["modes"]["all"]["new"]
    assert [round(v, 2) for v in new[0]["modes"]["all"]["us"]] == [25.15, 25.3]
    dropped = [r for r in first if r["modes"]["all"] is None]
    assert len(dropped) == 2  # qkv_a's and g_proj's GEMMs
    total = first[-1]
    assert round(total["baseline_us"], 2) == 38.62
    assert [round(v, 2) for v in total["modes"]["all"]["us"]] == [-7.87, -7.66]
    md = ab.ops_markdown(rows, min_us=0.5)
    assert "| new: 25.15 / 25.30 |" in md
    assert f"| b32x8 | {op} | {ab.TOTAL} | 38.62 | -7.87 / -7.66 |" in md
    assert ab.main([f"default={d}", f"all={x}", "--ops", ds, "--min-us", "0.5"]) == 0
