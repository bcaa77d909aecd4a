"""The ``specialized`` workload on the H200 (``pytest -m gpu tests/test_specialized_step_gpu.py``).

The specialized decode step equals the standard step (same seed: same weights, state and inputs)
within bf16 tolerances, on fresh random inputs with poisoned outputs, eager and replayed from one
CUDA graph, at kimi-k3 TP8 batch 1 and 8 and the chunked verify step of 16 x (1+7) tokens,
layers "kda,mla". The comparison is
``scripts/gpu_steps.py``'s (routing near-ties allowed, rows compared where the routing agrees);
the same script runs every TP shape and batch in one go.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def g():
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_steps.py"
    spec = importlib.util.spec_from_file_location("gpu_steps", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _failures(rec: dict) -> str:
    if rec.get("error"):
        return f"{rec['status']}: {rec['error']}\n{rec.get('trace', '')}"
    bad = [
        f"{d['mode']} seed {d.get('seed')}: {c['check']} = {c['value']:.3g} (tol {c['tol']})"
        for d in rec["draws"]
        if not d["mode"].endswith("-inconclusive")
        for c in d["checks"]
        if not c["ok"]
    ]
    if not rec.get("same_weights", True):
        bad.insert(0, "the two workloads' weights differ")
    return "\n".join(bad)


@pytest.mark.parametrize("batch", [1, 8])
def test_specialized_step_equals_standard(g, batch):
    rec = g.run_case("kimi-k3", 8, batch, 1, "kda,mla", seed=0, draws=2, graph=True)
    print(json.dumps({k: v for k, v in rec.items() if k != "draws"}, default=str))
    assert rec["status"] == "PASS", _failures(rec)
    modes = [d["mode"] for d in rec["draws"]]
    assert modes.count("eager") == 2 and modes.count("graph") == 2
    assert rec["same_weights"]
    assert rec["launches"] and all(n <= 11 for n in rec["launches"].values())


def test_front_norm_step_equals_standard(g):
    """front_norm=1: the post-attention RMSNorm inside the MoE front kernel: one launch fewer
    per layer than the default's 10 (KDA) / 11 (MLA) at 8 tokens. The 6 / 7 this test asserted
    before were written for earlier layers; on the H200 (s36/n4, 0d24706) it gave 9 / 10 with
    the step equal to the standard one."""
    rec = g.run_case("kimi-k3", 8, 8, 1, "kda,mla", seed=0, draws=2, graph=True, front_norm="1")
    assert rec["status"] == "PASS", _failures(rec)
    assert rec["launches"] == {"layer.0:kda": 9, "layer.1:mla": 10}


@pytest.mark.parametrize("token_ops,decode", [("once", "once"), ("once", "chunk"),
                                             ("chunk", "chunk")])  # fmt: skip
def test_chunked_verify_step_equals_standard(g, monkeypatch, token_ops, decode):
    """16 sequences of 1+7 tokens (128 tokens: two chunks of 64): every kernel once over all
    tokens (the default since session 22), the decode kernels per chunk (session 21's,
    ``DECODESCOPE_CHUNK_DECODE=chunk``), and session 20's layout
    (``DECODESCOPE_CHUNK_TOKEN_OPS=chunk``)."""
    monkeypatch.setenv("DECODESCOPE_CHUNK_TOKEN_OPS", token_ops)
    monkeypatch.setenv("DECODESCOPE_CHUNK_DECODE", decode)
    rec = g.run_case("kimi-k3", 8, 16, 8, "kda,mla", seed=0, draws=1, graph=True)
    assert rec["status"] == "PASS", _failures(rec)
    n = 1 if decode == "once" else 2  # decode launches
    if token_ops == "once":  # KDA: 4 + n decodes + 7 MoE; MLA: 5 + n + 2 + 7
        assert rec["launches"] == {"layer.0:kda": 11 + n, "layer.1:mla": 14 + n}


def test_chunked_verify_step_with_dense_layer_equals_standard(g):
    """16 x (1+7) tokens with the dense layer 0 first (session 22): its attention over all rows,
    its MLP as cuBLAS gate_up, the SiTU launch, cuBLAS down."""
    rec = g.run_case("kimi-k3", 8, 16, 8, "dense,kda", seed=0, draws=1, graph=True)
    assert rec["status"] == "PASS", _failures(rec)
    assert rec["launches"] == {"layer.0:dense": 8, "layer.1:kda": 12}  # one decode launch each


def test_workload_meta_on_gpu():
    """The factory's meta after the first (compiling) step: real routing in layer_bytes."""
    from decodescope.kernels import bytes as kbytes
    from decodescope.kernels.specialized.step import specialized

    wl = specialized(preset="kimi-k3", tp_shape=8, batch=8, layers="kda,mla")
    m = wl.meta
    assert m["backend"] == "specialized" and m["workload"] == "specialized"
    cfg = json.loads(m["config_json"])
    assert cfg["layer_bytes_from"].startswith("the routing")
    assert set(cfg["op_impl"].values()) == {"cute:decodescope"}
    sel = wl.model.selected_experts()
    for spec in wl.model.specs:
        ids = sel[spec.index]
        assert ids.shape == (8, 16) and int(ids.min()) >= 0 and int(ids.max()) < 896
        assert cfg["distinct_experts"][f"layer.{spec.index}"] == kbytes.distinct_experts(ids)
    want = kbytes.layer_bytes(wl.model.cfg, "kda", 8, 1, sel[0])
    assert m["layer_bytes"]["kda"] == want
    wl.refresh()  # a second refresh steps again (no recompilation) and keeps meta consistent
    torch.cuda.synchronize()
    del wl
    torch.cuda.empty_cache()
