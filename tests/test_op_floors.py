"""``scripts/op_floors.py`` on the committed H200 runs (TP16 batch 1 at a494371, both paths)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from decodescope import tracer

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


def test_op_parts(of):
    """The shared experts' gate/up go with the MoE front, their down with the routed experts;
    routing and norm-only names carry no bytes; an unknown name is an error."""
    assert of.op_parts("router+latent_down+shared_experts") == pytest.approx(
        {"router": 1.0, "latent_down_up": 0.5, "shared_experts": 2 / 3}
    )
    assert of.op_parts("grouped_topk+align+routed_experts+shared_experts+topk_sum") == (
        pytest.approx({"routed_experts": 1.0, "shared_experts": 1 / 3})
    )
    assert of.op_parts("shared_experts") == {"shared_experts": 1.0}
    assert of.op_parts("grouped_topk+align") == {}
    with pytest.raises(of.FloorError, match="no bytes known for 'flash_attn'"):
        of.op_parts("flash_attn")


def test_a_trace_without_bytes_is_a_one_line_error():
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "op_floors.py"), str(KINETO)],
                       capture_output=True, text=True)  # fmt: skip
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert str(KINETO) in lines[0] and "no copy bandwidth" in lines[0]
