"""The standard decode layers on a CPU (torch implementations of every op) against the float64
reference, tiny preset; fresh random weights, state and inputs for every check (hypothesis)."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decodescope.kernels import bytes as kbytes
from decodescope.kernels import reference as R
from decodescope.kernels.config import get_config
from decodescope.kernels.standard import ops as O
from decodescope.kernels.standard.model import StandardModel, parse_layers
from decodescope.kernels.workloads import WORKLOADS

TOL = 1.5e-2  # bf16 activations and weights through ~10 roundings: METHOD.md's 1e-3..1e-2 band
SETTINGS = settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=False
)


def _state_tol(cfg, name: str) -> float:
    """FP8 cache rows round to 3 mantissa bits: a one-ulp flip moves an element by ~6%."""
    return 6e-2 if name == "kv_cache" and cfg.kv_cache_dtype == "fp8_e4m3" else TOL


def _state_err(cfg, got: dict, ref: dict) -> dict[str, float]:
    out = {}
    for k, v in ref.items():
        g = got[k]
        if k == "kv_cache":  # the rows this step wrote (the rest is untouched context)
            g, v = g[:, cfg.context_len :], v[:, cfg.context_len :]
        out[k] = R.rel_l2(g, v)
    return out


def check_layer(preset, tp, kind, batch, T, seed, kda_mode="auto", **options):
    cfg = get_config(preset, tp, **options)
    specs = parse_layers(cfg, kind)
    m = StandardModel(cfg, specs, batch, T, seed=seed, kda_mode=kda_mode)
    before = {k: v.clone() for k, v in m.states[0].items()}
    x_in, r_in = m.x_in.clone(), m.r_in.clone()
    m.x_out.fill_(float("nan"))  # poison: every element must be written
    m.r_out.fill_(float("nan"))
    m.step()
    assert torch.equal(m.x_in, x_in) and torch.equal(m.r_in, r_in), "the step wrote its inputs"
    layer = m.layers[0]
    x, r, new_state, ids = R.layer_ref(
        cfg, specs[0], m.weights[0], before, x_in, r_in, T, topk_ids=layer.topk_ids
    )
    ex, er = R.rel_l2(m.x_out, x), R.rel_l2(m.r_out, r)
    se = _state_err(cfg, m.states[0], new_state)
    msg = f"{preset} tp{tp} {kind} B={batch} T={T} seed={seed}: x {ex:.2e} r {er:.2e} {se}"
    assert ex < TOL and er < TOL, msg
    assert all(v < _state_tol(cfg, k) for k, v in se.items()), msg
    if ids is not None:  # the standard path's routing is the reference's, up to near-ties
        h, _ = R.attn_res_ref(*_post_attn(cfg, specs[0], m, before, x_in, r_in, T))
        _, ref_ids, margin = R.routing_ref(cfg, m.weights[0], h)
        a = torch.sort(ref_ids, 1).values
        b = torch.sort(layer.topk_ids.long(), 1).values
        differ = (a != b).any(1)
        assert bool((margin[differ] < 2e-2).all()), f"routing differs beyond a near-tie: {msg}"
    return ex, se


def _post_attn(cfg, spec, m, before, x_in, r_in, T):
    """(attention output, residual, mlp_norm weight, eps): the MoE input's ingredients."""
    w = m.weights[0]
    h, r = R.attn_res_ref(x_in, r_in, w["attn_norm"], cfg.eps)
    if spec.attn == "kda":
        a, _, _ = R.kda_attn_ref(cfg, w, h, before["kda_state"], before["conv_state"], T)
    else:
        a, _ = R.mla_attn_ref(cfg, w, h, before["kv_cache"], T)
    return a, r, w["mlp_norm"], cfg.eps


@SETTINGS
@given(
    kind=st.sampled_from(["kda", "mla", "dense"]),
    batch=st.sampled_from([1, 2, 5]),
    T=st.sampled_from([1, 2, 4, 8]),
    tp=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_layer_matches_reference(kind, batch, T, tp, seed):
    check_layer("tiny", tp, kind, batch, T, seed)


@pytest.mark.parametrize("kind", ["kda", "mla", "dense"])
@pytest.mark.parametrize("batch, T", [(1, 1), (4, 1), (3, 4)])
def test_each_kind_batch_and_verify_tokens(kind, batch, T):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())  # fresh each run; printed on failure
    check_layer("tiny", 1, kind, batch, T, seed)


def test_fp8_latent_cache():
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    check_layer("tiny", 1, "mla", 3, 2, seed, kv_cache_dtype="fp8_e4m3")


@pytest.mark.parametrize("kind", ["kda", "mla"])
def test_mxfp4_experts(kind):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    check_layer("tiny", 1, kind, 3, 2, seed, expert_dtype="mxfp4")


def test_mxfp4_dequant_layout():
    from decodescope.kernels.weights import dequant_mxfp4

    q = torch.zeros(1, 1, 32, dtype=torch.uint8)
    q[0, 0, 0] = 0x2C  # k=0: code 12 (-2.0); k=32: code 2 (1.0)
    s = torch.tensor([[[127, 128]]], dtype=torch.uint8)  # group 0: x1, group 1: x2
    d = dequant_mxfp4(q, s)
    assert d.shape == (1, 1, 64)
    assert d[0, 0, 0] == -2.0 and d[0, 0, 32] == 2.0 and d[0, 0, 1] == 0.0


@pytest.mark.parametrize("mode", ["fused", "chain"])
def test_kda_fused_and_chain_paths(mode):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    check_layer("tiny", 1, "kda", 2, 2, seed, kda_mode=mode)


def test_step_of_the_model_mix_matches_chained_reference():
    cfg = get_config("tiny", 1)
    specs = parse_layers(cfg, "mix:4")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    m = StandardModel(cfg, specs, 2, 2, seed=seed)
    before = [{k: v.clone() for k, v in s.items()} for s in m.states]
    m.step()
    x, r = m.x_in, m.r_in
    for i, spec in enumerate(specs):
        x, r, _, _ = R.layer_ref(
            cfg, spec, m.weights[i], before[i], x, r, 2, topk_ids=m.layers[i].topk_ids
        )
    # four layers deep, each rounding to bf16: the error compounds a little
    assert R.rel_l2(m.x_out, x) < 3 * TOL and R.rel_l2(m.r_out, r) < 3 * TOL, seed


def test_moe_align_torch_groups_and_pads():
    E, k, N, bm = 12, 3, 5, 4
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(torch.int32)
    numel = N * k
    mp = -(-(numel + E * (bm - 1)) // bm) * bm
    s = torch.empty(mp, dtype=torch.int32)
    e = torch.empty(mp // bm, dtype=torch.int32)
    n = torch.empty(1, dtype=torch.int32)
    O.moe_align_torch(ids, E, bm, s, e, n)
    ntp = int(n.item())
    assert ntp % bm == 0 and ntp <= mp
    flat = ids.reshape(-1)
    seen = []
    for b in range(ntp // bm):
        rows = s[b * bm : (b + 1) * bm]
        for r in rows.tolist():
            if r < numel:
                assert int(flat[r]) == int(e[b])  # each row sits in its expert's block
                seen.append(r)
    assert sorted(seen) == list(range(numel))  # every (token, k) row exactly once
    counts = torch.bincount(flat.long(), minlength=E)
    assert ntp == int(((counts + bm - 1) // bm * bm).sum())


def test_layer_bytes_matches_design_figures():
    c8, c16 = get_config("kimi-k3", 8), get_config("kimi-k3", 16)
    # DESIGN.md section 7: ~395 MB (94 us) at batch 1 and ~5.4 GB (1.29 ms) at batch 64, TP8
    assert 390e6 < kbytes.layer_bytes(c8, "kda", 1, 1, 16) < 400e6
    assert 5.3e9 < kbytes.layer_bytes(c8, "kda", 64, 1, 613) < 5.5e9
    assert 250e6 < kbytes.layer_bytes(c16, "kda", 1, 1, 16) < 262e6
    assert 2.7e9 < kbytes.layer_bytes(c16, "kda", 64, 1, 613) < 2.9e9
    assert [round(kbytes.expected_distinct(896, 16, n)) for n in (1, 8, 32, 64)] == [
        16,
        120,
        393,
        613,
    ]
    ids = torch.tensor([[1, 2, 3], [3, 4, 5]])
    assert kbytes.distinct_experts(ids) == 5
    assert kbytes.layer_bytes(c8, "kda", 2, 1, ids) - kbytes.layer_bytes(
        c8, "kda", 2, 1, 4
    ) == kbytes.expert_bytes(c8)
    # one layer's experts at TP8: 7.4 GB in BF16 (about 17-18 layers per H200)
    assert 7.3e9 < 896 * kbytes.expert_bytes(c8) < 7.5e9
    # MXFP4 experts: about 300 MB per KDA layer at TP8, batch 1 (DESIGN.md section 3)
    c8x = get_config("kimi-k3", 8, expert_dtype="mxfp4")
    assert 290e6 < kbytes.layer_bytes(c8x, "kda", 1, 1, 16) < 305e6


def test_workload_contract():
    wl = WORKLOADS["standard"](
        preset="tiny", tp_shape="2", batch="3", tokens_per_seq="2", layers="kda,mla", seed="7"
    )
    meta = wl.meta
    for key in ("workload", "backend", "preset", "batch", "tokens_per_seq", "tp_shape"):
        assert meta[key] is not None
    assert meta["backend"] == "standard" and meta["tp_shape"] == 2 and meta["batch"] == 3
    assert set(meta["layer_bytes"]) == {"kda", "mla"}
    cfg = json.loads(meta["config_json"])
    assert cfg["op_impl"]["moe.routed_experts"] == "torch"  # a CPU: every op's torch fallback
    assert cfg["layers"] == ["0:kda", "1:mla"]
    before = wl.model.x_out.clone()
    wl.step()  # same inputs, evolved KDA state: runs, same shapes, finite
    assert torch.isfinite(wl.model.x_out).all() and wl.model.x_out.shape == before.shape
    wl.refresh()
    with pytest.raises(ValueError, match="unknown option"):
        WORKLOADS["standard"](preset="tiny", tp_shape=1, bogus=1)


def test_ranges_name_every_op(monkeypatch):
    from decodescope.kernels.standard import layers as L

    names: list[str] = []

    class Rec:
        def __init__(self, name):
            names.append(name)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(L, "range", Rec)
    cfg = get_config("tiny", 1)
    m = StandardModel(cfg, parse_layers(cfg, "kda,mla"), 1, 1, seed=1)
    m.step()
    assert "layer.0:kda" in names and "layer.1:mla" in names
    assert "layer.0.attn.qkv_proj" in names and "layer.1.attn.mla_decode" in names
    assert "layer.0.moe.routed_experts" in names and "layer.1.moe.router" in names
    for n in names:
        assert n.startswith("layer.") and "/" not in n


class _FakeVllm:
    """vLLM's op schemas (kernels/vllm_ops.py) implemented in torch, so the vLLM branches of
    the standard path and their probes run on a CPU. ``pad`` False: moe_align leaves padding
    unwritten (the probe must notice and fill it each step)."""

    def __init__(self, pad: bool, bad_topk: bool = False):
        self.pad, self.bad_topk, self.calls = pad, bad_topk, []

    def rms_norm(self, out, x, w, eps):
        self.calls.append("rms_norm")
        O.rmsnorm_torch(x, w, eps, out)

    def concat_and_cache_mla(self, kv_c, k_pe, kv_cache, slots, dtype_str, scale):
        self.calls.append("concat_and_cache_mla")
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        flat[slots] = torch.cat([kv_c, k_pe], -1).to(flat.dtype)

    def grouped_topk(self, scores, n_group, topk_group, topk, renorm, scale, bias, scoring):
        self.calls.append("grouped_topk")
        assert scoring == 1
        ids = torch.empty(scores.shape[0], topk, dtype=torch.int32)
        tw = torch.empty(scores.shape[0], topk, dtype=torch.float32)
        O.routing_torch(scores, bias, ids, tw, topk, renorm, scale)
        if self.bad_topk:
            ids = (ids + 1) % scores.shape[1]  # a mismatch the probe must reject
        return tw, ids

    def moe_align_block_size(self, ids, E, bs, sorted_ids, expert_ids, ntp, expert_map):
        self.calls.append("moe_align_block_size")
        if self.pad:
            O.moe_align_torch(ids, E, bs, sorted_ids, expert_ids, ntp)
            return
        keep = sorted_ids.clone()
        O.moe_align_torch(ids, E, bs, sorted_ids, expert_ids, ntp)
        pad = sorted_ids == ids.numel()
        sorted_ids[pad] = keep[pad]  # padding left as it was

    def moe_sum(self, x, out, topk_ids=None, expert_map=None):
        self.calls.append("moe_sum")
        out.copy_(x.float().sum(1))

    def first(self, *names):
        for q in names:
            f = getattr(self, q.split(".", 1)[1], None)
            if f is not None and q.split(".", 1)[1] != "first":
                return q, f
        return None, None


@pytest.mark.parametrize("pad, bad_topk", [(True, False), (False, True)])
def test_vllm_branches_with_fake_ops(monkeypatch, pad, bad_topk):
    from decodescope.kernels import vllm_ops

    fake = _FakeVllm(pad, bad_topk)
    monkeypatch.setattr(vllm_ops, "load", lambda: "fake")
    monkeypatch.setattr(vllm_ops, "first", fake.first)
    cfg = get_config("tiny", 1)
    specs = parse_layers(cfg, "kda,mla")
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    m = StandardModel(cfg, specs, 3, 2, seed=seed, use_vllm="force")
    impl = m.ops.impl
    assert impl["moe.align"] == "vllm:_moe_C.moe_align_block_size"
    assert impl["moe.topk_sum"] == "vllm:_moe_C.moe_sum"
    assert impl["moe.latent_norm"] == "vllm:_C.rms_norm"
    assert impl["attn.cache_insert"] == "vllm:_C_cache_ops.concat_and_cache_mla"
    if bad_topk:
        assert impl["moe.grouped_topk"] == "torch"
        assert "moe.grouped_topk:vllm:_moe_C.grouped_topk" in m.ops.rejected
    else:
        assert impl["moe.grouped_topk"] == "vllm:_moe_C.grouped_topk"
    assert all(layer.align_fill is (not pad) for layer in m.layers)
    before = [{k: v.clone() for k, v in s.items()} for s in m.states]
    fake.calls.clear()
    m.step()
    assert "moe_align_block_size" in fake.calls and "moe_sum" in fake.calls
    x, r = m.x_in, m.r_in
    for i, spec in enumerate(specs):
        x, r, _, _ = R.layer_ref(
            cfg, spec, m.weights[i], before[i], x, r, 2, topk_ids=m.layers[i].topk_ids
        )
    assert R.rel_l2(m.x_out, x) < 2 * TOL, seed


def _interpreter_ready() -> bool:
    import importlib.util
    import os

    return (
        importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
    )


@pytest.mark.slow
@pytest.mark.skipif(not _interpreter_ready(), reason="needs triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize(
    "kind, mode, options",
    [
        ("kda", "fused", {}),
        ("kda", "chain", {}),
        ("mla", "auto", {}),
        ("kda", "fused", {"expert_dtype": "mxfp4"}),
    ],
)
def test_triton_kernels_in_the_interpreter(kind, mode, options):
    """Our Triton kernels on a CPU (``TRITON_INTERPRET=1 pytest -m slow -k interpreter``)."""
    import triton.runtime.interpreter as interp

    orig = interp._patch_lang_tensor

    def patched(tensor, scope):  # numpy 2: int() of a 1-element array argument fails
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    try:
        cfg = get_config("tiny", 1, **options)
        specs = parse_layers(cfg, kind)
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
        m = StandardModel(cfg, specs, 2, 2, seed=seed, use_triton=True, kda_mode=mode)
        assert not [k for k in m.ops.rejected if "triton" in k], m.ops.rejected
        before = {k: v.clone() for k, v in m.states[0].items()}
        m.step()
        x, _, _, _ = R.layer_ref(
            cfg, specs[0], m.weights[0], before, m.x_in, m.r_in, 2, topk_ids=m.layers[0].topk_ids
        )
        assert R.rel_l2(m.x_out, x) < TOL, (seed, m.ops.impl)
    finally:
        interp._patch_lang_tensor = orig


def test_a_step_writes_everything_poison_left():
    # poison() fills the outputs and every intermediate with NaN; a step writes all of them, so
    # the step after poisoning equals the one before (weights and state untouched by poison)
    cfg = get_config("tiny", 1)
    m = StandardModel(cfg, parse_layers(cfg, "dense,kda,mla"), 2, 1, seed=3)
    start = [{k: v.clone() for k, v in state.items()} for state in m.states]
    m.step()
    want = (m.x_out.clone(), m.r_out.clone())
    for state, s0 in zip(m.states, start, strict=True):
        for k, v in s0.items():
            state[k].copy_(v)
    m.poison()
    assert torch.isnan(m.x_out).all()
    m.step()
    assert torch.isfinite(m.x_out).all() and torch.isfinite(m.r_out).all()
    torch.testing.assert_close(m.x_out, want[0], rtol=0, atol=0)
    torch.testing.assert_close(m.r_out, want[1], rtol=0, atol=0)
