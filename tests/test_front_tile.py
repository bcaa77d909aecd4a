"""The LatentMoE front on the tile GEMM (``DECODESCOPE_MOE_FRONT=tile``, issue #5) on the CPU.

Compiles for sm_90a (``CUTE_DSL_ARCH`` set by the package, no GPU): the tile GEMM with FP32
outputs at the front's kimi-k3 TP8 / TP16 shapes at 32 and 64 tokens, and the grouped route
kernel with ``zero_acc``. The block's wiring with fake launches (which kernels, which compile
keys, the route's ``acc`` argument), the refusals where the front would be wrong, and the torch
references chained. The GPU checks are in ``scripts/gpu_specialized_moe.py`` (``front_tile``).
"""

from __future__ import annotations

import pytest
import torch

# the package first: it sets CUTE_DSL_ARCH=sm_90a before anything imports cutlass (a test module
# collected early that imports cutlass first leaves later ones compiling for cutlass's default)
from decodescope.kernels import specialized  # noqa: F401
from decodescope.kernels.config import LayerSpec, get_config  # noqa: E402
from decodescope.kernels.reference import rel_l2  # noqa: E402
from decodescope.kernels.specialized import front_mma as fm  # noqa: E402
from decodescope.kernels.specialized import interface as itf  # noqa: E402
from decodescope.kernels.specialized import moe_block as mb  # noqa: E402
from decodescope.kernels.specialized import moe_experts as me  # noqa: E402
from decodescope.kernels.specialized import moe_grouped as mg  # noqa: E402
from decodescope.kernels.specialized import router_topk as rt  # noqa: E402
from decodescope.kernels.specialized import tile_gemm as tg  # noqa: E402
from decodescope.kernels.weights import make_layer_weights  # noqa: E402


def _dims(tp: int, preset: str = "kimi-k3"):
    cfg = get_config(preset, tp)
    e = cfg.moe
    NF = e.num_experts + cfg.expert_dim + 2 * cfg.shared_inter
    return cfg, NF


@pytest.mark.parametrize("tp,T", [(8, 32), (8, 64), (16, 32), (16, 64)])
def test_front_tile_compiles(tp, T):
    cfg, NF = _dims(tp)
    p = fm.tile_plan(T, cfg.hidden, NF)
    assert p.out_f32 and p.segments == (NF,) and not p.norm
    assert p.row_ctas * p.splits >= tg.NUM_SMS
    assert p.smem_bytes <= 114 * 1024  # two CTAs per SM
    assert tg.compile_plan(p) is not None


def test_tile_plan_f32():
    cfg, NF = _dims(8)
    p = fm.tile_plan(64, cfg.hidden, NF)
    assert (p.row_ctas, p.splits, p.chunks) == (47, 4, 28)  # 188 CTAs, as in_proj's 200
    assert p != tg.TilePlan(m=64, k=cfg.hidden, segments=(NF,), pdl=p.pdl)  # compile key
    with pytest.raises(ValueError, match="out_f32 has no residual epilogue"):
        tg.TilePlan(m=8, k=1024, segments=(16,), out_f32=True, residual_epilogue=True)


@pytest.mark.parametrize("tp,T,split", [(8, 64, True), (8, 32, True), (16, 32, True),
                                        (16, 64, True), (8, 8, False)])  # fmt: skip
def test_route_zero_acc_compiles(tp, T, split):
    cfg, _ = _dims(tp)
    e = cfg.moe
    op, args = mg._build_route(T, e.num_experts, e.top_k, cfg.expert_dim, cfg.shared_inter,
                               1.0, 4.0, 25.0, True, split, zero_acc=True)  # fmt: skip
    assert op.zero_acc and op.nsh >= 1
    assert tuple(args[-2].shape) == (T * cfg.expert_dim,)  # acc, flat
    assert itf.compile_only(op, *args) is not None


def test_route_zero_acc_errors():
    with pytest.raises(ValueError, match="zero_acc needs latent"):
        mg.GroupedRoute(8, 32, 4, 130, 64, 1.0, 4.0, 25.0, zero_acc=True)
    assert not mg.GroupedRoute(8, 32, 4, 128, 64, 1.0, 4.0, 25.0).zero_acc  # the default


def test_front_variant_tile(monkeypatch):
    monkeypatch.delenv("DECODESCOPE_MOE_FRONT", raising=False)
    assert fm.front_variant(64, 7168) == "mma"  # the default is untouched
    monkeypatch.setenv("DECODESCOPE_MOE_FRONT", "tile")
    assert fm.front_variant(32, 7168) == "tile"


class _Launches:
    """``itf.compiled`` stand-in: records (key, args) of every launch, runs nothing."""

    def __init__(self):
        self.calls: list[tuple[tuple, tuple]] = []

    def compiled(self, key, build):
        return lambda *a: self.calls.append((key, a))

    def names(self):
        return [k[0] for k, _ in self.calls]


def _block(monkeypatch, T: int = 8):
    rec = _Launches()
    monkeypatch.setattr(itf, "compiled", rec.compiled)
    cfg = get_config("tiny", 1)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=1)
    return rec, mb.SpecializedMoE(cfg, w, T)


def test_block_wiring_tile(monkeypatch):
    """front: one tile GEMM launch with FP32 ``y_front``; experts: route (``zero_acc`` in its
    key, ``acc`` as its argument), w13, w2; run_block_parts keeps ``zero_acc``."""
    monkeypatch.setenv("DECODESCOPE_MOE_FRONT", "tile")
    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")
    rec, blk = _block(monkeypatch)
    h = torch.randn(8, blk.cfg.hidden).to(torch.bfloat16)
    assert blk.route_zeroes_acc()
    blk.front(h)
    assert rec.names() == ["tile_gemm"]
    (key, args) = rec.calls[0]
    assert key[1].out_f32 and key[1].segments == (blk.w_front.shape[0],)
    assert args[0] is h and args[1] is blk.w_front and args[2] is blk.y_front
    rec.calls.clear()
    blk.experts()
    assert rec.names() == ["moe_grouped_route", "moe_grouped_w13", "moe_grouped_w2"]
    rkey, rargs = rec.calls[0]
    assert rkey[-1] is True  # zero_acc
    assert rargs[-1].data_ptr() == blk.acc.data_ptr() and rargs[-1].numel() == blk.acc.numel()
    rec.calls.clear()
    mg.run_block_parts(blk, (0,))
    assert rec.calls[0][0] == rkey
    # the default front: the route does not zero (acc zeroed by the front)
    monkeypatch.delenv("DECODESCOPE_MOE_FRONT")
    rec.calls.clear()
    blk.front(h)
    blk.experts()
    assert rec.names()[0] == "moe_front_mma" and rec.calls[1][0][-1] is False


def test_tile_front_refused_without_grouped(monkeypatch):
    """The persistent expert kernels (the default below 8 tokens, or forced) need acc and done
    zeroed by the front: ``tile`` refuses, before launching anything."""
    monkeypatch.setenv("DECODESCOPE_MOE_FRONT", "tile")
    monkeypatch.delenv("DECODESCOPE_MOE_EXPERTS", raising=False)
    rec, blk = _block(monkeypatch, T=4)  # auto: pipe below 8 tokens
    h = torch.randn(4, blk.cfg.hidden).to(torch.bfloat16)
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_FRONT=tile needs the grouped"):
        blk.front(h)
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_FRONT=tile needs the grouped"):
        blk.experts()
    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "pipe")
    rec8, blk8 = _block(monkeypatch, T=8)
    with pytest.raises(ValueError, match="grouped"):
        blk8.front(torch.randn(8, blk8.cfg.hidden).to(torch.bfloat16))
    assert rec.calls == [] and rec8.calls == []
    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")  # forced: fine below 8 tokens
    rec4, blk4 = _block(monkeypatch, T=4)
    blk4.front(h)
    assert rec4.names() == ["tile_gemm"]


@pytest.mark.parametrize("tp", [8, 16])
def test_front_tile_ref(tp):
    """The tile front's summation order (per split of K, splits summed in order) against the
    FP32 reference of FrontGemv: the same to FP32 rounding (a K-slice of kimi-k3 rows)."""
    cfg, NF = _dims(tp)
    g = torch.Generator().manual_seed(tp)
    x = torch.randn(32, cfg.hidden, generator=g).to(torch.bfloat16)
    w = (torch.randn(256, cfg.hidden, generator=g) * 0.02).to(torch.bfloat16)
    got = fm.front_tile_ref(x, w)
    assert rel_l2(got, rt.front_gemv_ref(x, w)) < 1e-6


def test_chain_with_tile_front_matches_reference():
    """Tiny preset, 8 tokens: the chain the tile front runs (y in the tile GEMM's order, route,
    grouped experts into a zero acc as the route kernel leaves it) equals the persistent path's
    reference on FrontGemv's y."""
    cfg = get_config("tiny", 1)
    e = cfg.moe
    E, L = e.num_experts, cfg.expert_dim
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=3)
    h = torch.randn(8, cfg.hidden, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    wf = rt.pack_front_weights(w)
    y_t, y_g = fm.front_tile_ref(h, wf), rt.front_gemv_ref(h, wf)
    ids, tw = rt.router_topk_ref(y_g[:, :E], w["router_bias"], e.top_k, e.routed_scaling)
    b, lb = cfg.model.situ_beta, cfg.model.situ_linear_beta
    acc_t, sh_t = mg.grouped_ref(y_t[:, E : E + L], y_t[:, E + L :], ids, tw, w["w13"], w["w2"],
                                 w["shared_w2"], b, lb)  # fmt: skip
    acc_g, sh_g = me.moe_experts_ref(y_g[:, E : E + L], y_g[:, E + L :], ids, tw, w["w13"],
                                     w["w2"], w["shared_w2"], b, lb)  # fmt: skip
    assert rel_l2(acc_t, acc_g) < 1e-3 and rel_l2(sh_t, sh_g) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tp,T", [(8, 32), (8, 64), (16, 32), (16, 64)])
def test_front_tile_and_route_zeroing_gpu(tp, T, monkeypatch):
    """H200 (``pytest -m gpu``): the tile front vs its reference with ``y`` poisoned; the
    grouped experts after it, ``acc`` poisoned with NaN before the front: the route kernel
    zeroes it (routed sum vs the reference on the kernel's ids), twice in a row."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("DECODESCOPE_MOE_FRONT", "tile")
    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")
    cfg, _ = _dims(tp)
    e = cfg.moe
    E, L = e.num_experts, cfg.expert_dim
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=0, device="cuda")
    blk = mb.SpecializedMoE(cfg, w, T)
    h = torch.randn(T, cfg.hidden, device="cuda").to(torch.bfloat16)
    blk.y_front.fill_(float("nan"))
    blk.acc.fill_(float("nan"))
    for _ in range(2):  # the second time acc holds the first sum: zeroed again
        blk.front(h)
        blk.experts()
        torch.cuda.synchronize()
        assert rel_l2(blk.y_front, fm.front_tile_ref(h, blk.w_front)) < 1e-5
        y = blk.y_front
        acc_r, sh_r = me.moe_experts_ref(
            y[:, E : E + L], y[:, E + L :], blk.topk_ids, blk.topk_weights, w["w13"], w["w2"],
            w["shared_w2"], cfg.model.situ_beta, cfg.model.situ_linear_beta,
        )  # fmt: skip
        assert rel_l2(blk.acc, acc_r) < 5e-3
        assert rel_l2(blk.shared_out, sh_r) < 5e-3


def test_front_auto_takes_tile_from_32_tokens_with_grouped_experts(monkeypatch):
    """The auto front: the tile GEMM from 32 tokens where the grouped experts run (H200 TP8 at 64
    tokens: 37.6 us against FrontMma's 57.0, notes/gpu-logs/s8/r4), FrontMma otherwise."""
    monkeypatch.delenv("DECODESCOPE_MOE_FRONT", raising=False)
    nf = 896 + 3584 + 2 * 768
    assert fm.front_variant(64, 7168, grouped=True, nf=nf) == "tile"
    assert fm.front_variant(32, 7168, grouped=True, nf=nf) == "tile"
    assert fm.front_variant(16, 7168, grouped=True, nf=nf) == "mma"
    assert fm.front_variant(64, 7168, grouped=False, nf=nf) == "mma"  # the pipe experts
    assert fm.front_variant(64, 7168, grouped=True, nf=nf + 8) == "mma"  # rows not 16-aligned
    monkeypatch.setenv("DECODESCOPE_MOE_FRONT", "mma")
    assert fm.front_variant(64, 7168, grouped=True, nf=nf) == "mma"


@pytest.mark.parametrize("T", [1, 16, 17])
def test_front_norm_wiring(monkeypatch, T):
    """``forward_norm``'s front: the tensor-core kernel with the norm in it (its own compile
    key, the norm weights and eps passed) where the front is ``mma`` and up to NORM_MAX_T
    tokens; else the SIMT kernel's norm prologue."""
    monkeypatch.delenv("DECODESCOPE_MOE_FRONT", raising=False)
    rec, blk = _block(monkeypatch, T)
    r = torch.randn(T, blk.cfg.hidden).to(torch.bfloat16)
    assert blk._front() == "mma"
    blk.front_norm(r)
    (key, args) = rec.calls[0]
    if T <= fm.NORM_MAX_T:
        assert key[0] == "moe_front_mma_norm" and key[-1] == blk.cfg.eps
        assert args[0] is r and args[-1] is blk.mlp_norm
    else:
        assert key[0] == "moe_front_gemv" and key[7] is True  # norm, no residual add
    rec.calls.clear()
    monkeypatch.setenv("DECODESCOPE_MOE_FRONT", "simt")
    blk.front_norm(r)
    assert rec.names() == ["moe_front_gemv"]
