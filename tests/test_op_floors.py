"""Per-op bytes floors (``kernels.bytes.op_parts`` / ``op_bytes``, ``decodescope report``'s op
table, ``scripts/op_floors.py``) on the committed H200 runs (TP16 batch 1 at a494371, both
paths) and an imported trace."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.compute as pc
import pytest
from cli_helpers import cli

from decodescope import tracer
from decodescope.analysis import metrics
from decodescope.kernels import bytes as kbytes
from decodescope.ui.op_floors import op_floors

ROOT = Path(__file__).resolve().parent.parent
SPEC = f"{ROOT / 'results'}@specialized-20261204T031629-ed57e6"
STD = f"{ROOT / 'results'}@standard-20261204T031621-80f49f"
KINETO = ROOT / "tests" / "data" / "traces" / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"


@pytest.fixture(scope="module")
def of():
    spec = importlib.util.spec_from_file_location("op_floors", ROOT / "scripts" / "op_floors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("src", [SPEC, STD])
def test_the_ops_cover_each_layer_s_bytes_once(of, src):
    """Both paths' ops, fused or not, split each kind's recorded ``layer_bytes`` among them
    exactly (``rows`` raises where a part is left over or counted twice); the op shares are
    ``metrics.op_table``'s."""
    run = tracer.load(src)
    rows = of.rows(run)
    for kind, nbytes in run.meta.layer_bytes.items():
        got = sum(r["bytes"] for r in rows if r["kind"] == kind)
        assert got == pytest.approx(nbytes, abs=8), kind
    floor = {k: sum(r["floor_us"] for r in rows if r["kind"] == k) for k in run.meta.layer_bytes}
    for k, f in floor.items():
        assert f == pytest.approx(run.meta.layer_bytes[k] / (run.meta.copy_bw_tbs * 1e6), rel=1e-6)


def test_where_the_specialized_batch1_layer_is_over_its_floor(of):
    """TP16 batch 1 (a494371): the MLA decode adds ~12 us for under 3 MB; the one-CTA RMSNorm
    ~3 us for no bytes; the MoE front streams before its wait (share under its floor)."""
    rows = {(r["kind"], r["op"]): r for r in of.rows(tracer.load(SPEC), ["kda", "mla"])}
    dec = rows[("mla", "w_uk_bmm+cache_insert+mla_decode+w_uv_bmm+gate_mul")]
    assert dec["bytes"] < 3e6 and dec["over_us"] > 10
    norm = rows[("kda", "residual_norm")]
    assert norm["bytes"] < 1e5 and norm["share_us"] > 2
    front = rows[("mla", "router+latent_down+shared_experts")]
    assert front["over_us"] < 0 and front["bytes"] > 70e6


def test_op_parts():
    """The shared experts' gate/up go with the MoE front, their down with the routed experts;
    routing and norm-only names, communication and ranges nested in an op carry no bytes; an
    unknown name is an error."""
    assert kbytes.op_parts("router+latent_down+shared_experts") == pytest.approx(
        {"router": 1.0, "latent_down_up": 0.5, "shared_experts": 2 / 3}
    )
    assert kbytes.op_parts("grouped_topk+align+routed_experts+shared_experts+topk_sum") == (
        pytest.approx({"routed_experts": 1.0, "shared_experts": 1 / 3})
    )
    assert kbytes.op_parts("shared_experts") == {"shared_experts": 1.0}
    assert kbytes.op_parts("grouped_topk+align") == {}
    assert kbytes.op_parts("o_proj+allreduce+residual") == {"o_proj": 1.0}
    assert kbytes.op_parts("align.cub::DeviceScan::InclusiveScan") == {}
    with pytest.raises(kbytes.OpBytesError, match="no bytes known for 'flash_attn'"):
        kbytes.op_parts("flash_attn")


def test_ops_that_miss_a_part_are_named():
    """``op_bytes`` refuses ops that leave a part unmoved or move one twice (a small synthetic
    case), and ``report`` says why instead of showing partial floors."""
    parts = {"o_proj": 100, "norms": 10, "router": 0}
    assert kbytes.op_bytes(parts, ["o_proj", "residual_norm", "input_residual_norm"]) == {
        "o_proj": 100, "residual_norm": 5, "input_residual_norm": 5}  # fmt: skip
    with pytest.raises(kbytes.OpBytesError, match="'o_proj': 1.0"):
        kbytes.op_bytes(parts, ["residual_norm", "input_residual_norm"])
    with pytest.raises(kbytes.OpBytesError, match="'o_proj': -1.0"):
        kbytes.op_bytes(parts, ["o_proj", "o_proj+residual_norm", "input_residual_norm"])
    run = tracer.load(SPEC)
    ops = metrics.op_table(run.kernels)
    cut = ops.filter(pc.not_equal(ops["op"], "o_proj"))
    table, why = op_floors(run, cut)
    assert "op_floor_us" not in table.column_names
    assert why.startswith("no per-op floors:") and "'o_proj': 1.0" in why


def test_report_shows_the_op_floors():
    """``report --json`` on the specialized run: every op has a floor, each kind's op floors sum
    to its layer floor; the table prints them; an imported trace has neither (no message)."""
    d = json.loads(cli("report", SPEC, "--json", "--top", "0").stdout)
    assert "op_floors" not in d
    kinds = {r["layer_kind"]: r for r in d["kinds"]}
    for kind, r in kinds.items():
        ops = [o for o in d["ops"] if o["layer_kind"] == kind]
        assert all(o["op_floor_us"] is not None for o in ops)
        assert sum(o["op_floor_us"] for o in ops) == pytest.approx(r["floor_us"], rel=1e-6)
    p = cli("report", SPEC, "--top", "0")
    assert p.returncode == 0 and "share - floor us" in " ".join(p.stdout.split())
    k = json.loads(cli("report", KINETO, "--json", "--top", "0").stdout)
    assert "op_floors" not in k and all("op_floor_us" not in o for o in k["ops"])


def test_a_trace_without_bytes_is_a_one_line_error():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "op_floors.py"), str(KINETO)],
                       capture_output=True, text=True)  # fmt: skip
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert str(KINETO) in lines[0] and "no copy bandwidth" in lines[0]
