"""CPU checks of the specialized attention kernels.

1. Every kernel compiles for sm_90a (``CUTE_DSL_ARCH``, no GPU) at the kimi-k3 TP8 and TP16
   per-rank shapes and at the tiny preset's, at decode batch sizes.
2. The kernels' torch references (their math and BF16 rounding points, FP32 arithmetic) chained
   into the attention half of a layer match the float64 reference of the layer
   (:mod:`decodescope.kernels.reference`) within BF16 tolerances, on fresh random inputs.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
# the package's interface module first: it sets CUTE_DSL_ARCH (sm_90a) before cutlass loads, so
# that this file compiles for Hopper when it runs alone too
pytest.importorskip("decodescope.kernels.specialized.interface")

from decodescope.kernels import reference as R  # noqa: E402
from decodescope.kernels import weights as W  # noqa: E402
from decodescope.kernels.config import LayerSpec, get_config  # noqa: E402
from decodescope.kernels.specialized import interface as itf  # noqa: E402
from decodescope.kernels.specialized import kda_decode as kda  # noqa: E402
from decodescope.kernels.specialized import mla_decode as mla  # noqa: E402
from decodescope.kernels.specialized import mla_decode_tc as mtc  # noqa: E402
from decodescope.kernels.specialized import norm_qkv_proj as nqp  # noqa: E402
from decodescope.kernels.specialized import oproj_residual_norm as op  # noqa: E402
from decodescope.kernels.specialized import rmsnorm as rms  # noqa: E402
from decodescope.kernels.specialized import skinny_gemm as sg  # noqa: E402
from decodescope.kernels.specialized import splitk_gemm as sk  # noqa: E402
from decodescope.kernels.specialized.attention_layers import attention_ref  # noqa: E402

SHAPES = [("kimi-k3", 8), ("kimi-k3", 16), ("tiny", 1), ("tiny", 2)]


@pytest.mark.parametrize("preset,tp", SHAPES)
@pytest.mark.parametrize("m", [1, 8, 64])
def test_gemms_compile(preset, tp, m, monkeypatch):
    """The skinny / split-K plans (small-M skinny GEMM below 8 tokens, split-K from 8 where K
    allows; ``DECODESCOPE_ATTN_GEMM=default``: the tile GEMM's own tests are
    tests/test_tile_gemm.py), compiled for sm_90a."""
    monkeypatch.setenv("DECODESCOPE_ATTN_GEMM", "default")
    cfg = get_config(preset, tp)
    plans = [
        nqp.plan_for(cfg, "kda", m),
        nqp.plan_for(cfg, "mla", m),
        op.plan_for(cfg, "kda", m),
        op.plan_for(cfg, "mla", m),
        op.q_b_plan(cfg, m),
    ]
    if m > 1 and preset == "kimi-k3":
        plans = plans[:1] + plans[2:3]  # the large unrolls compile slowly: one of each kind
    for p in plans:
        want = m >= sk.MIN_M and p.k >= sk.MIN_K and p.k % sk.KGRAIN == 0
        assert isinstance(p, sk.SplitKPlan) == want
        assert sk.compile_any(p) is not None
    assert rms.compile_plan(rms.NormPlan(m, cfg.hidden, cfg.eps)) is not None


@pytest.mark.parametrize("preset,tp,m", [("kimi-k3", 8, 32), ("kimi-k3", 16, 16), ("tiny", 1, 1)])
def test_splitk_gemm_compiles(preset, tp, m):
    """Split-K with both segments (MLA qkv_a + g_proj), the strided q_a input of q_b, and a
    forced split count; the grid covers the SMs twice where the shape allows."""
    cfg = get_config(preset, tp)
    p = sk.SplitKPlan(m=m, k=cfg.hidden, segments=(cfg.mla_qkv_a_out, cfg.mla_v_dim), norm=True,
                      add_residual=True)  # fmt: skip
    assert p.k % p.kl == 0 and p.kl % sk.KGRAIN == 0
    assert p.smem_for(p.splits) <= sk.SMEM_BUDGET or p.splits == p.k // sk.KGRAIN
    assert sk.compile_plan(p) is not None
    if cfg.mla.q_lora_rank % sk.KGRAIN == 0:
        qb = sk.SplitKPlan(m=m, k=cfg.mla.q_lora_rank, segments=(cfg.mla_q_b_out,), norm=True,
                           x_stride=cfg.mla_qkv_a_out)  # fmt: skip
        assert sk.compile_plan(qb) is not None


@pytest.mark.parametrize("preset,tp,m", [("kimi-k3", 8, 8), ("tiny", 1, 16)])
def test_splitk_partial_reduce_compiles(preset, tp, m):
    """The opt-in partial-sum reduction (``DECODESCOPE_SPLITK_REDUCE=partial``): one FP32
    partial per split in the workspace, summed by the last CTA."""
    cfg = get_config(preset, tp)
    p = sk.SplitKPlan(m=m, k=cfg.hidden, segments=(cfg.kda_in_proj_out,), norm=True,
                      add_residual=True, reduce="partial")  # fmt: skip
    assert p.ws_rows == p.acc_rows * p.splits
    assert sk.compile_plan(p) is not None
    with pytest.raises(ValueError, match="reduce"):
        sk.SplitKPlan(m=m, k=cfg.hidden, segments=(16,), reduce="tree")


def test_splitk_plan_choice(monkeypatch):
    monkeypatch.setenv("DECODESCOPE_ATTN_GEMM", "default")  # the skinny / split-K choice
    cfg = get_config("kimi-k3", 8)
    p64 = nqp.plan_for(cfg, "kda", 64)
    assert (p64.splits, p64.kl, p64.row_ctas) == (14, 512, 50)
    assert p64.row_ctas * p64.splits >= 2 * sk.NUM_SMS
    p1 = nqp.plan_for(cfg, "kda", 1)
    assert isinstance(p1, sg.GemmPlan)
    # small K (o_proj, q_b): the skinny kernel from every M (H200: split-K o_proj 2x slower)
    assert isinstance(op.plan_for(cfg, "kda", 64), sg.GemmPlan)
    assert isinstance(op.q_b_plan(cfg, 64), sg.GemmPlan)
    with pytest.raises(ValueError, match="multiple of 256"):
        sk.SplitKPlan(m=16, k=1000, segments=(16,))


def test_splitk_ref_matches_float64():
    """The split-K kernel's reference (rstd applied to the FP32 sums) is the same function as
    the skinny GEMM's within BF16 rounding."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(20, 512, generator=g).bfloat16()
    r = torch.randn(20, 512, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16()
    wt = (torch.randn(64, 512, generator=g) / 16).bfloat16()
    (o,), rout = sk.splitk_gemm_ref(x, [wt], residual=r, norm_weight=nw)
    ref = R.rmsnorm_ref(x.double() + r.double(), nw.double(), 1e-5) @ wt.double().T
    assert torch.equal(rout, (x.float() + r.float()).bfloat16())
    assert R.rel_l2(o, ref) < 1e-2
    (o2,), _ = sg.skinny_gemm_ref(x, [wt], residual=r, norm_weight=nw)
    assert R.rel_l2(o, o2) < 1e-2


@pytest.mark.parametrize("preset,tp", SHAPES)
@pytest.mark.parametrize("batch,tokens", [(1, 1), (32, 1)])
def test_attention_kernels_compile(preset, tp, batch, tokens):
    cfg = get_config(preset, tp)
    assert kda.compile_plan(kda.plan_for(cfg, batch, tokens)) is not None
    assert mla.compile_plan(mla.plan_for(cfg, batch, tokens)) is not None


@pytest.mark.parametrize(
    "preset,tp,batch,tokens",
    [("kimi-k3", 8, 1, 1), ("kimi-k3", 8, 64, 1), ("kimi-k3", 8, 1, 8), ("kimi-k3", 16, 8, 8),
     ("tiny", 1, 1, 1), ("tiny", 1, 2, 3), ("tiny", 2, 8, 8)],
)  # fmt: skip
def test_mla_tc_compiles(preset, tp, batch, tokens):
    cfg = get_config(preset, tp)
    p = mtc.plan_for(cfg, batch, tokens)
    assert p.rows <= mtc.ROWS and p.heads % p.hg == 0
    assert p.splits * p.keys_per_split >= p.nkeys > (p.splits - 1) * p.keys_per_split
    assert p.smem_bytes <= mtc.SMEM_MAX
    assert mtc.compile_plan(p) is not None


def test_mla_tc_plan_choice():
    cfg = get_config("kimi-k3", 8)
    assert mtc.plan_for(cfg, 1, 1).hg == 1
    p64 = mtc.plan_for(cfg, 64, 1)
    assert (p64.hg, p64.splits, p64.clustered) == (12, 2, True)  # cluster of 2 (H200 s9/r4)
    assert (mtc.plan_for(cfg, 32, 1).hg, mtc.plan_for(cfg, 32, 1).splits) == (3, 1)  # plain
    assert mtc.plan_for(cfg, 1, 8).rows == 8
    assert mla.kernel_choice(torch.bfloat16) == "split"  # one token: split (H200 s10/r2)
    assert mla.kernel_choice(torch.bfloat16, "", 1, 1) == "split"
    assert mla.kernel_choice(torch.bfloat16, "", 1, 8) == "split"  # head groups (H200 s15)
    assert mla.kernel_choice(torch.bfloat16, "", 1, 17) == "tc"  # past the split's 16 rows
    assert mla.kernel_choice(torch.bfloat16, "tc", 1, 1) == "tc"
    p88 = mtc.plan_for(cfg, 8, 8)
    assert (p88.hg, p88.splits, p88.clustered) == (2, 2, True)  # s9/r4: 93.9 -> 54.7 us
    assert mla.kernel_choice(torch.float8_e4m3fn) == "simt"
    with pytest.raises(ValueError, match="heads_per_cta"):
        mtc.plan_for(cfg, 1, 8, heads_per_cta=4)


def test_multi_token_compiles_tiny():
    cfg = get_config("tiny", 1)
    assert kda.compile_plan(kda.plan_for(cfg, 8, 8)) is not None
    assert mla.compile_plan(mla.plan_for(cfg, 1, 8)) is not None


def _layer(cfg, kind: str, batch: int, tokens: int, seed: int):
    spec = LayerSpec(3 if kind == "kda" else 7, kind, "moe")
    w = W.make_layer_weights(cfg, spec, seed=seed)
    st = W.make_state(cfg, spec, batch, tokens, seed=seed)
    x, r = W.make_inputs(cfg, batch * tokens, seed=seed)
    return spec, w, st, x, r


@pytest.mark.parametrize("kind", ["kda", "mla"])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (3, 1), (2, 3)])
def test_refs_match_float64_reference(kind, batch, tokens):
    cfg = get_config("tiny", 1)
    seed = 11 * batch + tokens + (0 if kind == "kda" else 1000)
    spec, w, st, x, r = _layer(cfg, kind, batch, tokens, seed)
    r_out, h, new_state = attention_ref(cfg, spec, w, st, x, r, tokens)

    h64, r64 = R.attn_res_ref(x, r, w["attn_norm"], cfg.eps)
    if kind == "kda":
        a64, s64, c64 = R.kda_attn_ref(cfg, w, h64, st["kda_state"], st["conv_state"], tokens)
        assert R.rel_l2(new_state["kda_state"], s64) < 1e-2
        assert R.rel_l2(new_state["conv_state"], c64) < 1e-2
    else:
        a64, cache64 = R.mla_attn_ref(cfg, w, h64, st["kv_cache"], tokens)
        ctx = cfg.context_len
        assert R.rel_l2(new_state["kv_cache"][:, ctx:], cache64[:, ctx:]) < 2e-2
    hm64, rm64 = R.attn_res_ref(a64, r64, w["mlp_norm"], cfg.eps)
    assert R.rel_l2(r_out, rm64) < 2e-2
    assert R.rel_l2(h, hm64) < 2e-2


def test_skinny_gemm_ref_rounding():
    """The GEMM reference: residual add, norm and epilogue at the documented rounding points."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 64, generator=g).bfloat16()
    r = torch.randn(5, 64, generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    wt = (torch.randn(32, 64, generator=g) / 8).bfloat16()
    (o,), rout = sg.skinny_gemm_ref(x, [wt], residual=r, norm_weight=nw, eps=1e-5)
    h = x.double() + r.double()
    ref = R.rmsnorm_ref(h, nw.double(), 1e-5) @ wt.double().T
    assert torch.equal(rout, (x.float() + r.float()).bfloat16())
    assert R.rel_l2(o, ref) < 1e-2


@pytest.mark.parametrize("rt,ks", [(2, 8), (4, 4)])
def test_gemm_sweep_variants_compile(rt, ks):
    """The tilings the GPU script sweeps compile too (odd tile counts: the last CTA clamps)."""
    cfg = get_config("kimi-k3", 8)
    p = sg.GemmPlan(m=8, k=cfg.hidden, segments=(cfg.kda_in_proj_out,), norm=True,
                    add_residual=True, rt_force=rt, ks_force=ks)  # fmt: skip
    assert p.grid == -(-(cfg.kda_in_proj_out // 16) // rt)
    assert sg.compile_plan(p) is not None


@pytest.mark.parametrize("preset,tp", [("kimi-k3", 8), ("tiny", 1)])
def test_mla_fp8_cache_compiles(preset, tp):
    cfg = get_config(preset, tp, kv_cache_dtype="fp8_e4m3")
    p = mla.plan_for(cfg, 2, 1)
    assert p.cache_dtype == "fp8_e4m3"
    assert mla.compile_plan(p) is not None


@pytest.mark.parametrize("batch,tokens", [(1, 1), (2, 3)])
def test_mla_fp8_ref_matches_float64_reference(batch, tokens):
    cfg = get_config("tiny", 1, kv_cache_dtype="fp8_e4m3")
    spec, w, st, x, r = _layer(cfg, "mla", batch, tokens, 77 + batch)
    r_out, h, new_state = attention_ref(cfg, spec, w, st, x, r, tokens)
    h64, r64 = R.attn_res_ref(x, r, w["attn_norm"], cfg.eps)
    a64, cache64 = R.mla_attn_ref(cfg, w, h64, st["kv_cache"], tokens)
    hm64, rm64 = R.attn_res_ref(a64, r64, w["mlp_norm"], cfg.eps)
    assert R.rel_l2(r_out, rm64) < 2e-2
    assert R.rel_l2(h, hm64) < 2e-2
    ctx = cfg.context_len
    assert R.rel_l2(new_state["kv_cache"][:, ctx:], cache64[:, ctx:]) < 6e-2


def test_rmsnorm_residual_variant_compiles_and_ref():
    assert rms.compile_plan(rms.NormPlan(64, 7168, 1e-5, residual=True)) is not None
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(4, 256, generator=g).bfloat16(), torch.randn(4, 256, generator=g).bfloat16()
    w = (1 + 0.1 * torch.randn(256, generator=g)).bfloat16()
    ref = R.rmsnorm_ref(x.double() + r.double(), w.double(), 1e-5)
    assert R.rel_l2(rms.rmsnorm_ref(x, w, 1e-5, residual=r), ref) < 1e-2


@pytest.mark.parametrize("preset,tp,hpc", [("kimi-k3", 8, 4), ("kimi-k3", 16, 2), ("tiny", 1, 2)])
def test_mla_heads_per_cta_compiles(preset, tp, hpc):
    import dataclasses

    cfg = get_config(preset, tp)
    p = dataclasses.replace(mla.plan_for(cfg, 8, 1), heads_per_cta=hpc)
    assert p.keys_per_split * p.splits >= cfg.context_len
    assert mla.compile_plan(p) is not None


def test_placeholder_is_shared_and_cached():
    """The GEMM launchers pass one cached zero tensor per (device, shape, dtype) for the kernel
    arguments a plan does not read."""
    a = itf.placeholder("cpu", (16, 16))
    assert a is itf.placeholder("cpu", (16, 16)) and a.dtype == torch.bfloat16
    assert not a.any() and tuple(a.shape) == (16, 16)
    assert itf.placeholder("cpu", (4,), torch.float32) is not a


@pytest.mark.parametrize("tp,m", [(8, 256), (16, 512)])
def test_rmsnorm_wide_variants_compile_and_ref(tp, m):
    """A chunked step's token-parallel ops over all rows (``step.tokens_once``): the RMSNorm over
    256 / 512 rows with a residual (the input projections), of the strided ``q_a`` slice (q_b),
    and of the FP32 latent sum (the MoE back: ``bf16(x * rstd * w)``, one rounding), compiled
    for sm_90a; the FP32 reference against float64."""
    cfg = get_config("kimi-k3", tp)
    assert rms.compile_plan(rms.NormPlan(m, cfg.hidden, cfg.eps, residual=True)) is not None
    q = cfg.mla.q_lora_rank
    assert rms.compile_plan(rms.NormPlan(m, q, cfg.eps), cfg.mla_qkv_a_out) is not None
    assert rms.compile_plan(rms.NormPlan(m, cfg.expert_dim, cfg.eps, x_f32=True)) is not None
    with pytest.raises(ValueError, match="FP32 input takes no residual"):
        rms.RMSNorm(rms.NormPlan(m, 256, residual=True, x_f32=True))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 256, generator=g) * torch.tensor([[0.1], [1.0], [10.0], [3.0]])
    w = (1 + 0.1 * torch.randn(256, generator=g)).bfloat16()
    y = rms.rmsnorm_ref(x, w, 1e-5)
    assert y.dtype == torch.bfloat16
    assert R.rel_l2(y, R.rmsnorm_ref(x.double(), w.double(), 1e-5)) < 4e-3


@pytest.mark.parametrize("tp,m", [(8, 256), (16, 512)])
def test_rmsnorm_side_cast_compiles_and_checks(tp, m):
    """``DECODESCOPE_WIDE_BACK=addmm``: the MoE back's latent RMSNorm launch that also rounds
    the shared experts' FP32 sum ``[M, hidden]`` to BF16 (``NormPlan.side``) compiles for
    sm_90a at 256 / 512 rows; its PTX has the side's FP32 loads and BF16 stores beside the
    norm's; the launcher refuses what the compiled layout cannot take."""
    cfg = get_config("kimi-k3", tp)
    plain = rms.NormPlan(m, cfg.expert_dim, cfg.eps, x_f32=True)
    side = rms.NormPlan(m, cfg.expert_dim, cfg.eps, x_f32=True, side=cfg.hidden)
    assert rms.compile_plan(side) is not None

    def count(p):
        ptx = itf.ptx_text(rms.RMSNorm(p), *rms._fake_args(p))
        return [len(re.findall(rf"^\s*{op}\b", ptx, re.M))
                for op in (r"ld\.global\.v4\.b32", r"st\.global\.v4\.b32",
                           r"cvt\.rn\.bf16x2\.f32")]  # fmt: skip

    # per thread, ceil(hidden / 8 / 128) vectors of 8: two 16-byte FP32 loads, four packed
    # conversions and one 16-byte BF16 store each, on top of the norm's own
    it = -(-cfg.hidden // (8 * rms.THREADS))
    (l0, s0, c0), (l1, s1, c1) = count(plain), count(side)
    assert (l1 - l0, s1 - s0, c1 - c0) == (2 * it, it, 4 * it)
    with pytest.raises(ValueError, match="multiple of 8"):
        rms.RMSNorm(rms.NormPlan(m, 256, x_f32=True, side=12))
    x = torch.zeros(m, cfg.expert_dim)
    y = torch.empty(m, cfg.expert_dim, dtype=torch.bfloat16)
    w = torch.ones(cfg.expert_dim, dtype=torch.bfloat16)
    s_in = torch.zeros(m, cfg.hidden)
    for kw, msg in (
        ({"side_in": s_in}, "takes side_in and side_out"),
        ({"side_in": s_in, "side_out": torch.empty(m, cfg.hidden)}, "float32 -> bfloat16"),
        ({"side_in": s_in, "side_out": torch.empty(m, 8, dtype=torch.bfloat16)}, "for 256 rows"
         if m == 256 else "for 512 rows"),
        ({"side_in": s_in.t().contiguous().t(),
          "side_out": torch.empty(m, cfg.hidden, dtype=torch.bfloat16)}, "contiguous"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            rms.rmsnorm(x, w, y, cfg.eps, **kw)


@pytest.mark.parametrize("tp,m", [(8, 256), (16, 512), (8, 512)])
def test_situ_mul_compiles_and_ref(tp, m):
    """The dense MLP's activation over all rows of a chunked step (``dense_mlp.
    DenseMLPAllTokens``): :mod:`.situ_mul` compiled for sm_90a at the kimi-k3 dense shapes;
    its reference (one BF16 rounding after FP32 math) against the float64 SiTU, and the plan's
    checks."""
    from decodescope.kernels.specialized import situ_mul as sm

    cfg = get_config("kimi-k3", tp)
    betas = (float(cfg.model.situ_beta), float(cfg.model.situ_linear_beta))
    p = sm.SituPlan(m, cfg.dense_inter, *betas)
    assert p.col_blocks * sm.THREADS * sm.VEC >= cfg.dense_inter
    assert sm.compile_plan(p) is not None
    g = torch.Generator().manual_seed(tp + m)
    gu = (torch.randn(6, 2 * 64, generator=g) * 3).bfloat16()
    y = sm.situ_mul_ref(gu, betas)
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (6, 64)
    want = R.situ_ref(gu[:, :64].double(), gu[:, 64:].double(), *betas)
    assert R.rel_l2(y, want) < 4e-3
    with pytest.raises(ValueError, match="multiple of 8"):
        sm.SituPlan(4, 12, *betas)
    with pytest.raises(ValueError, match=r"must be \[M, 2 \* Dn\]"):
        sm.situ_mul(gu[:, :100].contiguous(), torch.empty(6, 64, dtype=torch.bfloat16), betas)


@pytest.mark.parametrize("tp", [8, 16])
def test_decode_kernels_compile_over_all_sequences(tp):
    """``DECODESCOPE_CHUNK_DECODE=once`` (``step.decode_once``): the KDA recurrence and the MLA
    decode (the split kernel's head groups) over all 64 sequences of a 64 x (1+7) verify step,
    compiled for sm_90a."""
    from decodescope.kernels.specialized import mla_decode as mla

    cfg = get_config("kimi-k3", tp)
    assert kda.compile_plan(kda.plan_for(cfg, 64, 8)) is not None
    assert mla.kernel_choice(torch.bfloat16, "", 64, 8, cfg) == "split"
    assert mla.compile_for(cfg, 64, 8) is not None
