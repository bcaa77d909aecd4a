"""CPU checks of the specialized dense MLP (Kimi K3's layer 0; kernels/specialized/dense_mlp.py).

1. Both launches (the skinny GEMM with its RMSNorm prologue and SiTU epilogue, the down GEMM)
   compile for sm_90a without a GPU at the kimi-k3 TP8 / TP16 per-rank shapes and the tiny
   preset's, at decode batch sizes.
2. Their torch references chained match the float64 reference of the dense MLP
   (:mod:`decodescope.kernels.reference`) within BF16 tolerances, on fresh random inputs.
3. The ``specialized`` workload accepts ``layers="dense,kda,mla"``: ranges, launches, meta, and
   the step's wiring with every kernel replaced by its reference gives the standard step.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
# the package's interface module first: it sets CUTE_DSL_ARCH (sm_90a) before cutlass loads, so
# that this file compiles for Hopper when it runs alone too
pytest.importorskip("decodescope.kernels.specialized.interface")

from decodescope import tracer  # noqa: E402
from decodescope.kernels import reference as R  # noqa: E402
from decodescope.kernels import weights as W  # noqa: E402
from decodescope.kernels.config import LayerSpec, get_config  # noqa: E402
from decodescope.kernels.specialized import dense_mlp as dm  # noqa: E402
from decodescope.kernels.specialized import skinny_gemm as sg  # noqa: E402
from decodescope.kernels.specialized import step as S  # noqa: E402
from decodescope.kernels.specialized import tile_gemm as tg  # noqa: E402

SHAPES = [("kimi-k3", 8), ("kimi-k3", 16), ("tiny", 1), ("tiny", 2)]
TINY = {"preset": "tiny", "tp_shape": 1}


@pytest.mark.parametrize("preset,tp", SHAPES)
@pytest.mark.parametrize("m", [1, 8])
def test_dense_gemms_compile(preset, tp, m):
    cfg = get_config(preset, tp)
    up, down = dm.gate_up_plan(cfg, m), dm.down_plan(cfg, m)
    assert up.situ and up.norm and not up.add_residual
    assert up.grid * (up.rt // 2) * 16 >= cfg.dense_inter  # every output column has a CTA
    assert sg.compile_plan(up) is not None
    assert tg.compile_any(down) is not None
    # from 8 tokens the down projection runs on the tile GEMM where K allows
    assert isinstance(down, tg.TilePlan) == (m >= 8 and tg.selected(m, cfg.dense_inter))
    assert isinstance(dm.down_plan(get_config("kimi-k3", 8), m), tg.TilePlan) == (m >= 8)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [8, 16])
def test_dense_gemms_compile_m64(tp):
    cfg = get_config("kimi-k3", tp)
    assert sg.compile_plan(dm.gate_up_plan(cfg, 64, norm=False)) is not None  # the split path
    assert tg.compile_any(dm.down_plan(cfg, 64)) is not None


def test_tiling_facts_kimi_k3():
    """The CTA counts and warps the notes' predictions assume."""
    for tp, dn in ((8, 4224), (16, 2112)):
        cfg = get_config("kimi-k3", tp)
        assert cfg.dense_inter == dn
        up = dm.gate_up_plan(cfg, 1)
        assert (up.rt, up.ks, up.grid) == (2, 8, dn // 16)  # one gate + one up tile per CTA
        down = dm.down_plan(cfg, 1)
        assert (down.ks, down.grid) == (6, 7168 // 16)
        assert dm.gate_up_plan(cfg, 64).grid == dn // 32  # rt 4: two gate + two up tiles
    with pytest.raises(ValueError, match="even"):
        sg.GemmPlan(m=1, k=256, segments=(64,), situ=True, rt_force=3)
    with pytest.raises(ValueError, match="gate/up"):
        sg.GemmPlan(m=1, k=256, segments=(48,), situ=True)


def test_weight_tile_map_covers_gate_and_up():
    """Each CTA's tiles: q < rt/2 gate tiles, q >= rt/2 the up tiles D/16 further; every gate
    tile appears exactly once (clamped duplicates are never stored)."""
    p = sg.GemmPlan(m=40, k=256, segments=(2 * 80,), situ=True)  # 5 gate tiles, rt 4
    ntiles = 10
    seen = []
    for cta in range(p.grid):
        tiles = [int(p.weight_tile(cta, q, ntiles)) for q in range(p.rt)]
        h = p.rt // 2
        for q in range(h):
            assert tiles[q + h] == tiles[q] + ntiles // 2
            if cta * h + q < ntiles // 2:
                seen.append(tiles[q])
    assert sorted(seen) == list(range(5))


def _dense_layer(cfg, n: int, seed: int):
    spec = LayerSpec(0, "kda", "dense")
    w = W.make_layer_weights(cfg, spec, seed=seed)
    x, r = W.make_inputs(cfg, n, seed=seed)
    return w, (x.float() + r.float()).bfloat16()


def test_situ_epilogue_ref():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 64, generator=g).bfloat16()
    wt = (torch.randn(64, 64, generator=g) / 4).bfloat16()
    (o,), _ = sg.skinny_gemm_ref(x, [wt], situ=(4.0, 25.0))
    gu = (x.float() @ wt.float().T).bfloat16().double()
    ref = R.situ_ref(gu[:, :32], gu[:, 32:], 4.0, 25.0)
    assert o.shape == (3, 32) and o.dtype == torch.bfloat16
    assert R.rel_l2(o, ref) < 4e-3


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("n", [1, 5, 24])
def test_dense_refs_match_float64_reference(tp, n, split):
    cfg = get_config("tiny", tp)
    w, r = _dense_layer(cfg, n, seed=100 * tp + n)
    out = dm.dense_mlp_ref(cfg, w, r, split_norm=split)
    h64 = R.rmsnorm_ref(r.double(), w["mlp_norm"].double(), cfg.eps)
    ref = R.dense_mlp_ref(cfg, w, h64)
    assert out.shape == (n, cfg.hidden) and out.dtype == torch.bfloat16
    assert R.rel_l2(out, ref) < 2e-2


def test_dense_refs_match_float64_reference_kimi_k3_tp16():
    """The real K3 width (TP16: Dn 2112, H 7168), one token."""
    cfg = get_config("kimi-k3", 16)
    g = torch.Generator().manual_seed(4)
    H, Dn = cfg.hidden, cfg.dense_inter
    w = {
        "dense_w13": (torch.randn(2 * Dn, H, generator=g) * H**-0.5).bfloat16(),
        "dense_w2": (torch.randn(H, Dn, generator=g) * Dn**-0.5).bfloat16(),
        "mlp_norm": (1 + 0.1 * torch.randn(H, generator=g)).bfloat16(),
    }
    r = torch.randn(2, H, generator=g).bfloat16()
    out = dm.dense_mlp_ref(cfg, w, r)
    ref = R.dense_mlp_ref(cfg, w, R.rmsnorm_ref(r.double(), w["mlp_norm"].double(), cfg.eps))
    assert R.rel_l2(out, ref) < 2e-2


def test_split_norm_choice(monkeypatch):
    """The skinny path's rule (``DECODESCOPE_DENSE_TILE=0``); by default the norm is folded into
    the tile GEMM from 8 tokens (two launches at every token count)."""
    monkeypatch.delenv("DECODESCOPE_DENSE_TILE", raising=False)
    assert dm.ops_for(1) == dm.OPS and dm.ops_for(32) == dm.OPS and dm.ops_for(64) == dm.OPS
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE", "0")
    assert dm.ops_for(1) == dm.OPS and dm.ops_for(31) == dm.OPS
    assert dm.ops_for(32) == dm.OPS_SPLIT == ("residual_norm", "gate_up+act", "down")
    monkeypatch.setenv("DECODESCOPE_DENSE_SPLIT_NORM", "1")
    assert dm.ops_for(1) == dm.OPS_SPLIT
    monkeypatch.setenv("DECODESCOPE_DENSE_SPLIT_NORM", "0")
    assert dm.ops_for(64) == dm.OPS
    monkeypatch.setenv("DECODESCOPE_DENSE_SPLIT_NORM", "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_DENSE_SPLIT_NORM"):
        S.plan(**TINY, layers="dense")


def test_silu_preset_is_refused():
    import dataclasses

    cfg = get_config("tiny", 1)
    model = dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.moe, activation="silu"))
    cfg = dataclasses.replace(cfg, model=model)
    with pytest.raises(ValueError, match="SiTU"):
        dm.gate_up_plan(cfg, 1)


# -- the workload with a dense layer -----------------------------------------------------------


def test_plan_accepts_dense_first():
    for preset, tp in (("tiny", 1), ("kimi-k3", 8), ("kimi-k3", 16)):
        for b, t in ((1, 1), (64, 1), (8, 8)):
            p = S.plan(preset=preset, tp_shape=tp, batch=b, tokens_per_seq=t,
                       layers="dense,kda,mla")  # fmt: skip
            want = 6 if dm.split_norm_for(b * t) else 5  # the norm launch of its own
            # the attention's input projection on the tile GEMM: its RMSNorm is a launch too
            want += 1 if tg.selected(b * t, p.cfg.hidden, norm=True) else 0
            assert p.launches()["layer.0:dense"] == want
    p = S.plan(**TINY, batch=2, layers="dense,kda,mla")
    cfg = json.loads(p.meta["config_json"])
    assert cfg["layers"] == ["0:dense", "1:kda", "2:mla"]
    assert cfg["launches"] == {"layer.0:dense": 5, "layer.1:kda": 7, "layer.2:mla": 8}
    assert set(p.meta["layer_bytes"]) == {"dense", "kda", "mla"}
    assert p.range_names()["layer.0:dense"] == [
        "layer.0.attn.input_residual_norm+qkv_proj+f_b_proj",
        "layer.0.attn.conv1d+kda_recurrence+gated_norm",
        "layer.0.attn.o_proj",
        "layer.0.mlp.residual_norm+gate_up+act",
        "layer.0.mlp.down",
    ]
    assert "mlp.residual_norm+gate_up+act" in cfg["op_impl"]
    # front_norm changes the MoE layers only
    fn = S.plan(**TINY, batch=2, layers="dense,kda", front_norm=1)
    assert fn.launches() == {"layer.0:dense": 5, "layer.1:kda": 6}


def _model(batch, tokens, layers, seed=0, front_norm=0):
    p = S.plan(**TINY, batch=batch, tokens_per_seq=tokens, layers=layers, seed=seed,
               front_norm=front_norm)  # fmt: skip
    m = S.SpecializedModel(p.cfg, p.specs, batch, tokens, seed=seed, device="cpu",
                           front_norm=p.front_norm)  # fmt: skip
    return p, m


def test_dry_run_dense_ranges(monkeypatch):
    from decodescope.kernels.specialized import interface as itf

    calls: list[str] = []
    monkeypatch.setattr(
        itf, "compiled", lambda key, build: lambda *a, **k: calls.append(tracer.current_path())
    )
    p, m = _model(2, 1, "dense,kda,mla")
    assert m.moe[0] is None and m.dense[0] is not None and m.dense[1] is None
    with tracer.range("step"):
        m.step()
    want = [f"step/{lay}/{op}" for lay, ops in p.range_names().items() for op in ops]
    assert calls == want
    assert m.launches() == p.launches()
    assert set(m.selected_experts()) == {1, 2}


def _reference_kernels(monkeypatch, m):
    """Every half replaced by its chained kernel references; the dense MLP's two launches by
    theirs (its stages, ranges and buffers stay the real ones)."""
    from decodescope.kernels.specialized import attention_layers as al
    from decodescope.kernels.specialized import moe_block as mb

    w_of = {id(moe): w for moe, w in zip(m.moe, m.weights, strict=True) if moe is not None}

    def attn_stages(self, x_in, r_in, r_out, h_out):
        def body():
            r, h, ns = al.attention_ref(self.cfg, self.spec, self.w, self.state, x_in, r_in,
                                        self.T)  # fmt: skip
            r_out.copy_(r)
            h_out.copy_(h)
            for k, v in ns.items():
                self.state[k].copy_(v)

        def norm():
            raise AssertionError("a dense layer must skip the attention's residual_norm launch")

        return [("body", body), ("residual_norm", norm)]

    def attn_forward(self, x_in, r_in, r_out, h_out):
        for _, fn in attn_stages(self, x_in, r_in, r_out, h_out)[:1]:
            fn()

    def moe_forward(self, h, out):
        o, ids = mb.moe_block_ref(self.cfg, w_of[id(self)], h)
        out.copy_(o)
        self.topk_ids.copy_(ids)

    monkeypatch.setattr(al.SpecializedAttention, "stages", attn_stages)
    monkeypatch.setattr(al.SpecializedAttention, "forward", attn_forward)
    monkeypatch.setattr(mb.SpecializedMoE, "forward", moe_forward)
    from decodescope.kernels.specialized import rmsnorm as rms

    monkeypatch.setattr(dm, "gate_up_act", lambda cfg, w, r, act, norm=True: act.copy_(
        dm.gate_up_act_ref(cfg, w, r, norm=norm)))  # fmt: skip
    monkeypatch.setattr(rms, "rmsnorm",
                        lambda x, w, y, eps: y.copy_(rms.rmsnorm_ref(x, w, eps)))  # fmt: skip
    monkeypatch.setattr(dm, "down_proj",
                        lambda cfg, w, act, out: out.copy_(dm.down_proj_ref(cfg, w, act)))  # fmt: skip
    # the tile GEMM's gate_up (the default from 8 tokens): with the norm folded it takes the
    # raw residual, else the normalized h
    monkeypatch.setattr(dm, "gate_up_act_tile", lambda cfg, w, x, act, fold=False: act.copy_(
        dm.gate_up_act_ref(cfg, w, x, norm=fold)))  # fmt: skip


def _rel(a, b, rows=None):
    a, b = a.double(), b.double()
    if rows is not None:
        a, b = a[rows], b[rows]
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("batch, tokens", [(3, 1), (2, 3), (32, 1)])
def test_dense_first_step_matches_standard(monkeypatch, batch, tokens):
    from decodescope.kernels.standard.model import StandardModel

    p, m = _model(batch, tokens, "dense,kda,mla", seed=5)
    assert m.dense[0].split == dm.split_norm_for(batch * tokens)
    _reference_kernels(monkeypatch, m)
    std = StandardModel(p.cfg, p.specs, batch, tokens, seed=5, device="cpu")
    m.step()
    std.step()
    # layer 0 alone: its MLP output and residual stream (no routing involved yet)
    ok = torch.ones(batch * tokens, dtype=torch.bool)
    for i, lay in enumerate(std.layers):
        if m.moe[i] is None:
            continue
        a = torch.sort(m.moe[i].topk_ids.long(), 1).values
        b = torch.sort(lay.topk_ids.long(), 1).values
        ok &= (a == b).all(1)
    ok = ok.view(batch, tokens).all(1).repeat_interleave(tokens)
    assert ok.float().mean() >= 0.5, "routing differs in most sequences"
    assert _rel(m.x_out, std.x_out, ok) < 3e-2
    assert _rel(m.r_out, std.r_out, ok) < 3e-2
    for k in m.states[0]:
        assert _rel(m.states[0][k], std.states[0][k]) < 2e-2, k


def test_dense_layer_alone_matches_standard(monkeypatch):
    """One dense layer: the specialized MLP output equals the standard one (BF16 rounding)."""
    from decodescope.kernels.standard.model import StandardModel

    p, m = _model(4, 1, "dense", seed=8)
    _reference_kernels(monkeypatch, m)
    std = StandardModel(p.cfg, p.specs, 4, 1, seed=8, device="cpu")
    m.step()
    std.step()
    assert _rel(m.x_out, std.x_out) < 1.5e-2
    assert _rel(m.r_out, std.r_out) < 1e-2


def test_warmup_names_the_dense_half(monkeypatch):
    from decodescope.kernels.specialized import interface as itf

    def fake_compiled(key, build):
        if str(key[0]) == "skinny_gemm" and key[1].situ:
            raise RuntimeError("situ epilogue broke")
        return lambda *a, **k: None

    monkeypatch.setattr(itf, "compiled", fake_compiled)
    _, m = _model(2, 1, "dense,kda")
    with pytest.raises(ValueError) as ei:
        m.warmup()
    assert "dense MLP of layer.0:dense" in str(ei.value) and "situ epilogue broke" in str(ei.value)


@pytest.mark.slow
def test_dense_step_kernels_compile_kimi_k3(monkeypatch):
    """The TP8 dense layer's kernels compile with the step's own keys (meta tensors)."""
    from decodescope.kernels.specialized import interface as itf

    monkeypatch.setattr(W, "_gen", lambda device, seed: None)
    monkeypatch.setattr(
        W, "_randn", lambda shape, g, device, std, dtype=torch.bfloat16: torch.empty(
            shape, device="meta", dtype=dtype)
    )  # fmt: skip
    real = itf.compiled
    n = [0]

    def compile_only(key, build):
        real(key, build)
        n[0] += 1
        return lambda *a, **k: None

    monkeypatch.setattr(itf, "compiled", compile_only)
    p = S.plan(preset="kimi-k3", tp_shape=8, batch=1, layers="dense")
    m = S.SpecializedModel(p.cfg, p.specs, 1, 1, device="meta")
    m.warmup()
    # with the input projection on the tile GEMM (tile_gemm.AUTO_MIN_M) its GEMM and its norm
    # kernel are compiled, and the attention's own residual_norm kernel still is
    assert n[0] == (7 if tg.selected(1, p.cfg.hidden, norm=True) else 5)


def _gpu_steps():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_steps.py"
    spec = importlib.util.spec_from_file_location("gpu_steps_dense", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("layers", ["dense", "dense,kda,mla"])
def test_gpu_steps_compare_with_a_dense_layer_on_cpu(monkeypatch, layers):
    """scripts/gpu_steps.py's comparison with layer 0 dense (no routing there), on the CPU with
    the kernels' references; a step that writes nothing fails."""
    from decodescope.kernels.standard.model import StandardModel

    g = _gpu_steps()
    p, m = _model(4, 1, layers, seed=11)
    _reference_kernels(monkeypatch, m)
    std = StandardModel(p.cfg, p.specs, 4, 1, seed=11, device="cpu")
    assert g.same_weights(std, m)
    r = g.compare_step(std, m, 4, 1, m.step, seed=5, tie=0.05, min_rows=0.0)
    assert r["ok"], [c for c in r["checks"] if not c["ok"]]
    assert r["routing_rows_agree"][0] == 4  # the dense layer: every row agrees
    names = {c["check"] for c in r["checks"]}
    assert {"x_out", "r_out", "layer0.kda_state", "layer0.conv_state"} <= names
    bad = g.compare_step(std, m, 4, 1, lambda: None, seed=6, tie=0.05, min_rows=0.0)
    assert not bad["ok"]


def test_dense_layer_tp_world():
    """tp_world 2: the down projection's all-reduce is the o_proj fused kernel (tp2.py), so the
    dense layer runs; more ranks are refused, said plainly (the fused reductions are two-rank)."""
    from decodescope.kernels.standard.model import parse_layers

    cfg = get_config("tiny", 1)
    S.check_usable(cfg, parse_layers(cfg, "dense,kda"), 2, 1, tp_world=2)
    with pytest.raises(ValueError, match="tp_world=4: .*two-rank"):
        S.check_usable(cfg, parse_layers(cfg, "dense,kda"), 2, 1, tp_world=4)
