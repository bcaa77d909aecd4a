"""``scripts/ncu_stalls.py``: Nsight Compute's per-SASS source counters summarised. The CSV here
is a small synthetic one (ncu's column names, four instructions), written to check the parsing
corners: notes before the header, the kernel-name line ncu 2025 writes before each kernel's
header (the H200's, session 31), a second kernel's section (ignored), thousands separators,
predicates, a missing column."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_stalls.py"
spec = importlib.util.spec_from_file_location("ncu_stalls", _SCRIPT)
ns = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ns)

CSV = """==PROF== a note ncu printed first
"Kernel Name","kernel_cutlass_kernel_KDADecode_0",
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_short_scoreboard","stall_long_scoreboard"
"0","LDS.128 R4, [R2]","1,200","1,100","1,000","0"
"16","@!P0 FFMA R5, R4, R6, R5","300","250","200","0"
"32","LDG.E R8, [R10.64]","2,500","2,400","0","2,300"
"48","EXIT","0","0","0","0"
"Kernel Name","another_kernel",
"# Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_short_scoreboard","stall_long_scoreboard"
"0","EXIT","9,999","0","0","0"
"""


def test_summary(tmp_path):
    p = tmp_path / "k.sass.csv"
    p.write_text(CSV)
    text = ns.summarise(p, top=2)
    assert "4 SASS instructions, 4000 stall samples" in text
    lines = text.splitlines()
    reasons = lines[lines.index("stall reasons (samples, share):") + 1 :][:2]
    assert "stall_long_scoreboard" in reasons[0] and "57.5%" in reasons[0]
    assert "stall_short_scoreboard" in reasons[1]
    assert any(ln.strip().startswith("FFMA") for ln in lines)  # the predicate dropped
    top = lines[lines.index("top 2 instructions:") + 1 :]
    assert [ln.split()[0] for ln in top] == ["#0", "#2"]  # address order


def test_errors(tmp_path, capsys):
    p = tmp_path / "bad.csv"
    p.write_text('"# Address","Source"\n"0","EXIT"\n')
    assert ns.main([str(p)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ncu_stalls: ") and "bad.csv" in err and err.count("\n") == 1
    assert ns.main([str(tmp_path / "missing.csv")]) == 1
