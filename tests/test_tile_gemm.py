"""The tiled cp.async GEMM (:mod:`decodescope.kernels.specialized.tile_gemm`).

CPU: it compiles for sm_90a at the kimi-k3 TP8 attention projections (in_proj with the norm
launch, MLA qkv_a + g_proj, the strided q_b input, o_proj's residual epilogue) at 8 and 64
tokens; the plan's split choice and errors; ``DECODESCOPE_ATTN_GEMM`` routes the layers'
projections to it and leaves the default alone. GPU (``-m gpu``): every shape vs the torch
reference with NaN-poisoned outputs, including forced split counts, stage and warp counts, each
with the warpgroup MMAs (``wgmma``) too; CPU: the wgmma path compiles at every plan kind.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
# the package's interface module first: it sets CUTE_DSL_ARCH (sm_90a) before cutlass loads, so
# that this file compiles for Hopper when it runs alone too
pytest.importorskip("decodescope.kernels.specialized.interface")

from decodescope.kernels.config import get_config  # noqa: E402
from decodescope.kernels.specialized import interface as itf  # noqa: E402
from decodescope.kernels.specialized import norm_qkv_proj as nqp  # noqa: E402
from decodescope.kernels.specialized import oproj_residual_norm as op  # noqa: E402
from decodescope.kernels.specialized import splitk_gemm as sk  # noqa: E402
from decodescope.kernels.specialized import tile_gemm as tg  # noqa: E402
from decodescope.kernels.specialized.skinny_gemm import skinny_gemm_ref  # noqa: E402

CFG = get_config("kimi-k3", 8)


cases = tg.attention_cases


@pytest.mark.parametrize(
    "name,m", [("in_proj", 64), ("in_proj", 8), ("qkv_a_g", 64), ("q_b", 64), ("o_proj", 64),
               ("o_proj", 8)],
)  # fmt: skip
def test_compiles(name, m):
    p = tg.TilePlan(m=m, **cases(CFG)[name])
    assert p.row_ctas * p.splits >= tg.NUM_SMS
    assert p.smem_bytes <= 114 * 1024  # two CTAs per SM
    assert tg.compile_plan(p) is not None


@pytest.mark.parametrize(
    "name,m", [("in_proj", 64), ("qkv_a_g", 33), ("q_b", 64), ("o_proj", 8), ("front", 64)],
)  # fmt: skip
def test_compiles_wgmma(name, m):
    """The warpgroup-MMA path compiles for sm_90a at every plan kind (norm launch, residual
    epilogue, rms_fold, FP32 out), the buffers still leave two CTAs per SM."""
    kw = dict(cases(CFG))
    kw["front"] = dict(k=CFG.hidden, segments=(5248,), out_f32=True)
    p = tg.TilePlan(m=m, wgmma=True, **kw[name])
    assert p.wgmma and p.smem_bytes <= 114 * 1024
    assert tg.compile_plan(p) is not None


def test_wgmma_plan_and_ptx(monkeypatch):
    """``DECODESCOPE_TILE_WGMMA`` resolves into the plan (part of its key); the chunk's PTX has
    RT x 4 MMAs of the padded token count, K steps 32 bytes apart, M blocks 8 KB apart."""
    monkeypatch.delenv(tg.WGMMA_ENV, raising=False)
    base = dict(m=64, **cases(CFG)["q_b"])
    assert tg.WGMMA_MIN_M == 32
    assert tg.TilePlan(**base).wgmma and tg.TilePlan(**dict(base, m=32)).wgmma
    assert not tg.TilePlan(**dict(base, m=31)).wgmma  # from WGMMA_MIN_M (32) tokens
    fold = dict(base, norm=False, rms_fold=True)
    assert tg.TilePlan(**fold).wgmma  # the folded norm too (with the cluster split-K, s25)
    assert not tg.TilePlan(**dict(fold, m=8)).wgmma
    monkeypatch.setenv(tg.WGMMA_ENV, "1")
    assert tg.TilePlan(**base).wgmma and tg.TilePlan(**fold).wgmma
    assert not tg.TilePlan(**dict(base, warps=2)).wgmma  # not a warpgroup: the mma.sync path
    with pytest.raises(ValueError, match="warps=4"):
        tg.TilePlan(**dict(base, warps=2, wgmma=True))
    monkeypatch.setenv(tg.WGMMA_ENV, "0")
    assert not tg.TilePlan(**base).wgmma
    monkeypatch.setenv(tg.WGMMA_ENV, "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_TILE_WGMMA"):
        tg.TilePlan(**base)
    ptx = tg.wgmma_chunk_ptx(40, 2, 64)
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n40k16.f32.bf16.bf16") == 8
    assert "add.s64 da, {$r0}, 514;" in ptx and "add.s64 db, {$r1}, 6;" in ptx
    assert "{$w39}" in ptx and "{$w40}" not in ptx and "{$r41}" in ptx
    with pytest.raises(ValueError, match="multiple of 8"):
        tg.wgmma_chunk_ptx(36, 2, 64)


def test_squares_in_the_wgmma_block(monkeypatch):
    """``TilePlan.sq_in_mma`` (``DECODESCOPE_TILE_SQ_MMA=1``; off by default: no gain on the
    H200): a folded norm on wgmma without a residual sums each chunk's squares inside the chunk's
    MMA block, between the commit and the wait (one 16-byte load and 8 FMAs per activation slot,
    elements in order: low half first); unset or ``0``, before the chunk's barrier."""
    ptx = tg.wgmma_chunk_ptx(64, 2, 64, squares=2)
    body = ptx[ptx.index("wgmma.commit_group") : ptx.index("wgmma.wait_group")]
    assert body.count("ld.shared.v4.b32") == 2 and body.count("fma.rn.f32") == 16
    assert "mov.f32 {$w64}, {$r66};" in body and "[{$r68}]" in body and "[{$r69}]" in body
    assert body.index("shl.b32 sb, sx0, 16;") < body.index("and.b32 sb, sx0, 0xffff0000;")
    assert "ld.shared" not in tg.wgmma_chunk_ptx(64, 2, 64)
    monkeypatch.delenv(tg.SQ_MMA_ENV, raising=False)
    qb = dict(m=64, **cases(CFG)["q_b"], wgmma=True)
    assert not tg.TilePlan(**dict(qb, norm=False, rms_fold=True)).sq_in_mma  # off by default
    monkeypatch.setenv(tg.SQ_MMA_ENV, "1")
    fold = tg.TilePlan(**dict(qb, norm=False, rms_fold=True))
    assert fold.sq_in_mma and not tg.TilePlan(**qb).sq_in_mma
    assert not tg.TilePlan(**dict(qb, norm=False, rms_fold=True, wgmma=False)).sq_in_mma
    ptx = itf.ptx_text(tg.TileGemm(fold), *tg._fake_args(fold))
    i = ptx.index("wgmma.commit_group")
    assert "ld.shared.v4.b32" in ptx[i : ptx.index("wgmma.wait_group", i)]
    monkeypatch.setenv(tg.SQ_MMA_ENV, "0")
    off = tg.TilePlan(**dict(qb, norm=False, rms_fold=True))
    assert not off.sq_in_mma and off != fold  # part of the plan's key
    ptx = itf.ptx_text(tg.TileGemm(off), *tg._fake_args(off))
    i = ptx.index("wgmma.commit_group")
    assert "ld.shared.v4.b32" not in ptx[i : ptx.index("wgmma.wait_group", i)]
    monkeypatch.setenv(tg.SQ_MMA_ENV, "yes")
    with pytest.raises(ValueError, match=tg.SQ_MMA_ENV):
        tg.TilePlan(**qb)


def test_cluster_plan(monkeypatch):
    """``DECODESCOPE_TILE_CLUSTER`` resolves into the plan: off by default (``CLUSTER_MIN_M``
    None), and with ``1`` the splits of a row tile form one cluster, at most ``CLUSTER_MAX``
    of them (q_b's 24 at 64 tokens become 8), no workspace; plans that cannot take it fall back
    unless asked for explicitly."""
    monkeypatch.delenv(tg.CLUSTER_ENV, raising=False)
    c = cases(CFG)
    front = dict(k=CFG.hidden, segments=(6016,), out_f32=True)
    assert tg.TilePlan(m=64, **front).cluster != (tg.CLUSTER_MIN_M is None)
    monkeypatch.setenv(tg.CLUSTER_ENV, "1")
    p = tg.TilePlan(m=64, **front)
    assert p.cluster and p.splits == 4 and not p.uses_ws and p.ws_rows == 8
    assert tg.cluster_launch(p) == {"cluster": [1, 4, 1]}
    qb16 = dict(c["q_b"], segments=(1152,), norm=False, rms_fold=True)  # TP16: 9 row tiles
    qb = tg.TilePlan(m=64, **qb16)
    assert qb.cluster and qb.splits == 8 and qb.ssq_rows == 0
    assert qb.part_bytes <= qb.stages * qb.cta_rows * tg.BK * 2
    monkeypatch.setenv(tg.CLUSTER_ENV, "0")
    qb0 = tg.TilePlan(m=64, **qb16)
    assert not qb0.cluster and qb0.splits == 24 and qb0.uses_ws and qb0.ssq_rows > 0
    assert tg.cluster_launch(qb0) == {}
    monkeypatch.setenv(tg.CLUSTER_ENV, "1")
    # 16 splits forced: no cluster (falls back), or an error where the plan asks for it
    assert not tg.TilePlan(m=64, splits_force=16, **c["in_proj"]).cluster
    assert not tg.TilePlan(m=64, splits_force=1, **c["in_proj"]).cluster
    with pytest.raises(ValueError, match="cluster needs"):
        tg.TilePlan(m=64, splits_force=16, cluster=True, **c["in_proj"])
    with pytest.raises(ValueError, match="cluster needs"):  # the partial tile: 2 stages, 1 warp
        tg.TilePlan(m=64, k=7168, segments=(32,), warps=1, stages=2, cluster=True)
    monkeypatch.setenv(tg.CLUSTER_ENV, "on")
    with pytest.raises(ValueError, match=tg.CLUSTER_ENV):
        tg.TilePlan(m=64, **c["in_proj"])


@pytest.mark.parametrize(
    "name,m,wgmma", [("front", 64, True), ("qkv_a_g", 33, False), ("q_b_fold", 64, False),
                     ("o_proj", 64, True), ("in_proj", 8, False), ("fold_res", 32, False)],
)  # fmt: skip
def test_compiles_cluster(name, m, wgmma):
    """The cluster split-K compiles for sm_90a at every plan kind (FP32 out, two segments,
    the folded norm, the residual epilogue, the folded norm with its residual add): the PTX
    reads the partials through ``mapa`` + ``ld.shared::cluster`` between cluster barriers,
    with no counter atomics and no workspace stores of partials."""
    from decodescope.kernels.specialized import interface as itf

    kw = dict(cases(CFG))
    kw["front"] = dict(k=CFG.hidden, segments=(6016,), out_f32=True)
    kw["q_b_fold"] = dict(kw["q_b"], norm=False, rms_fold=True)
    kw["fold_res"] = dict(k=CFG.hidden, segments=(1024,), rms_fold=True, add_residual=True)
    p = tg.TilePlan(m=m, wgmma=wgmma, cluster=True, **kw[name])
    res = p.add_residual
    op_ = tg.TileGemmFoldRes(p) if res else tg.TileGemm(p)
    ptx = itf.ptx_text(op_, *(tg._fake_args_res(p) if res else tg._fake_args(p)))
    per = -(-m // p.splits) * (p.cta_rows // 4)  # items of one CTA of the cluster
    loads = -(-per // p.threads) * p.splits * len(p.segments)
    if p.rms_fold:
        loads *= 2  # and the sums of squares
    assert ptx.count("ld.shared::cluster") == ptx.count("mapa.shared::cluster") == loads
    assert (
        ptx.count("barrier.cluster.arrive")
        == ptx.count("barrier.cluster.wait")
        == 2 * len(p.segments)
    )
    assert "atom." not in ptx
    assert tg.compile_plan(p) is not None


def test_plan_choice_and_errors():
    c = cases(CFG)
    p = tg.TilePlan(m=64, **c["in_proj"])
    assert (p.row_ctas, p.splits, p.chunks) == (50, 4, 28)
    assert tg.TilePlan(m=64, **c["o_proj"]).splits == 3
    assert tg.TilePlan(m=8, **c["q_b"]).mp == 8
    assert tg.TilePlan(m=33, **c["q_b"]).mp == 40
    with pytest.raises(ValueError, match="1..64 tokens"):
        tg.TilePlan(m=65, **c["o_proj"])
    with pytest.raises(ValueError, match="multiple of 64"):
        tg.TilePlan(m=8, k=1000, segments=(16,))
    with pytest.raises(ValueError, match="multiple of 16"):
        tg.TilePlan(m=8, k=1024, segments=(24,))
    with pytest.raises(ValueError, match="does not divide"):
        tg.TilePlan(m=8, k=1024, segments=(16,), splits_force=3)
    with pytest.raises(ValueError, match="shared memory"):
        tg.TilePlan(m=64, k=1024, segments=(16,), warps=8, stages=8)


def test_selection(monkeypatch):
    monkeypatch.setenv("DECODESCOPE_ATTN_GEMM", "default")
    assert isinstance(nqp.plan_for(CFG, "kda", 64), sk.SplitKPlan)  # the old choice
    assert not isinstance(op.plan_for(CFG, "kda", 64), tg.TilePlan)
    monkeypatch.delenv("DECODESCOPE_ATTN_GEMM", raising=False)  # auto since the H200 A/B
    assert not isinstance(nqp.plan_for(CFG, "kda", 1), tg.TilePlan)  # AUTO_MIN_M = 8
    assert not isinstance(op.plan_for(CFG, "kda", 1), tg.TilePlan)
    assert not isinstance(op.q_b_plan(CFG, 1), tg.TilePlan)
    assert isinstance(nqp.plan_for(CFG, "kda", 8), tg.TilePlan)
    assert isinstance(op.plan_for(CFG, "mla", 8), tg.TilePlan)
    assert not isinstance(op.q_b_plan(CFG, 8), tg.TilePlan)  # q_b: its own norm launch
    qb = op.q_b_plan(CFG, 64)  # from 16 tokens the norm folded in: no 12th MLA launch
    assert isinstance(qb, tg.TilePlan) and qb.rms_fold and not qb.norm
    monkeypatch.setenv("DECODESCOPE_TILE_NORM", "launch")  # the old choice
    assert not isinstance(op.q_b_plan(CFG, 64), tg.TilePlan)
    monkeypatch.delenv("DECODESCOPE_TILE_NORM")
    monkeypatch.setenv("DECODESCOPE_ATTN_GEMM", "tile")
    for m in (1, 8, 64):
        assert isinstance(nqp.plan_for(CFG, "kda", m), tg.TilePlan)
        assert isinstance(op.plan_for(CFG, "mla", m), tg.TilePlan)
        qb = op.q_b_plan(CFG, m)
        assert isinstance(qb, tg.TilePlan) and qb.ldx == CFG.mla_qkv_a_out
        assert (qb.norm, qb.rms_fold) == ((True, False) if m < tg.FOLD_MIN_M else (False, True))
    monkeypatch.setenv("DECODESCOPE_ATTN_GEMM", "auto")
    monkeypatch.setattr(tg, "AUTO_MIN_M", 8)
    assert not isinstance(nqp.plan_for(CFG, "kda", 4), tg.TilePlan)
    assert isinstance(nqp.plan_for(CFG, "kda", 8), tg.TilePlan)
    monkeypatch.setenv("DECODESCOPE_ATTN_GEMM", "bogus")
    with pytest.raises(ValueError, match="DECODESCOPE_ATTN_GEMM"):
        tg.selected(8, 7168)


# -- GPU -----------------------------------------------------------------------------------


def _inputs(cfg, name, m, dev, gen):
    kw = cases(cfg)[name]
    k = kw["k"]

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(torch.bfloat16)

    ldx = kw.get("x_stride", 0) or k
    x = rnd(m, ldx)[:, :k]
    ws = [rnd(n, k, scale=k**-0.5) for n in kw["segments"]]
    args = dict(eps=kw.get("eps", 1e-5))
    if kw.get("norm"):
        args["norm_weight"] = rnd(k, scale=0.2) + 1.0
    if kw.get("add_residual"):
        args["residual"] = rnd(m, k)
    if kw.get("residual_epilogue"):
        args["epilogue_residual"] = rnd(m, kw["segments"][0])
    return x, ws, args


def check_tile(cfg, name, m, dev, seed=0, **force):
    """Run the tile GEMM once on fresh inputs into NaN-poisoned outputs; returns the max
    relative error (vs the reference's max |value|) over all outputs."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    x, ws, args = _inputs(cfg, name, m, dev, gen)
    outs = [torch.full((m, w.shape[0]), float("nan"), dtype=torch.bfloat16, device=dev)
            for w in ws]  # fmt: skip
    rout = None
    if "residual" in args:
        rout = torch.full_like(args["residual"], float("nan"))
        args["residual_out"] = rout
    tg.tile_gemm(x, ws, outs, **args, **force)
    torch.cuda.synchronize()
    ref_args = {k: v for k, v in args.items() if k != "residual_out"}
    refs, rref = skinny_gemm_ref(x, ws, **ref_args)
    err = 0.0
    for o, r in zip(outs, refs, strict=True):
        if not torch.isfinite(o).all():
            return float("inf")
        err = max(err, ((o.float() - r.float()).abs().max() / r.float().abs().max()).item())
    if rout is not None:
        err = max(err, (rout.float() - rref.float()).abs().max().item())
    return err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["in_proj", "qkv_a_g", "q_b", "o_proj"])
@pytest.mark.parametrize("m", [1, 8, 33, 64])
@pytest.mark.parametrize("wgmma", [False, True])
def test_tile_gemm_gpu(name, m, wgmma):
    assert check_tile(CFG, name, m, "cuda", seed=m, wgmma=wgmma) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["in_proj", "qkv_a_g", "q_b", "o_proj"])
@pytest.mark.parametrize("m", [1, 8, 33, 64])
@pytest.mark.parametrize("wgmma", [False, True])
def test_tile_gemm_cluster_gpu(name, m, wgmma):
    """The cluster split-K against the reference, three launches in a row on fresh inputs
    (no counter to reset: each launch stands alone); q_b also with its norm folded."""
    for rep in range(3):
        assert (
            check_tile(CFG, name, m, "cuda", seed=100 * rep + m, wgmma=wgmma, cluster=True) < 2e-2
        )
    if name == "q_b":
        assert check_fold(CFG, m, "cuda", seed=m, wgmma=wgmma, cluster=True) < 2e-2
        if wgmma:  # the squares inside the MMA block (DECODESCOPE_TILE_SQ_MMA=1); no cluster
            assert check_fold(CFG, m, "cuda", seed=m, wgmma=True, cluster=True, sq_mma=True) < 2e-2
            assert check_fold(CFG, m, "cuda", seed=m, wgmma=True, cluster=False) < 2e-2


def check_fold(cfg, m, dev, seed=0, **force):
    """q_b with its RMSNorm folded (``rms_fold``) into NaN-poisoned outputs against the norm
    + GEMM reference; returns the max relative error. The tokens' rows are scaled 0.2x..3x, so
    a sum of squares taken from another token's row shows in the error."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    x, ws, args = _inputs(cfg, "q_b", m, dev, gen)
    x.mul_(
        torch.linspace(0.2, 3.0, m, device=dev)[torch.randperm(m, generator=gen, device=dev)][
            :, None
        ].to(x.dtype)
    )
    g = args["norm_weight"]
    out = torch.full((m, ws[0].shape[0]), float("nan"), dtype=torch.bfloat16, device=dev)
    tg.tile_gemm(x, [tg.fold_norm_weight(ws[0], g)], [out], rms_fold=True, eps=args["eps"],
                 **force)  # fmt: skip
    torch.cuda.synchronize()
    (ref,), _ = skinny_gemm_ref(x, ws, **args)
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("force", [dict(splits=2), dict(splits=8), dict(stages=3), dict(warps=2)])
def test_tile_gemm_cluster_variants_gpu(force):
    assert check_tile(CFG, "in_proj", 64, "cuda", seed=5, cluster=True, **force) < 2e-2
    assert check_tile(CFG, "o_proj", 17, "cuda", seed=6, cluster=True, **force) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "force", [dict(splits=1), dict(splits=2), dict(splits=8), dict(stages=2), dict(stages=6), dict(warps=2),
              dict(warps=8, stages=3)],
)  # fmt: skip
def test_tile_gemm_variants_gpu(force):
    assert check_tile(CFG, "in_proj", 64, "cuda", seed=1, **force) < 2e-2
    assert check_tile(CFG, "o_proj", 17, "cuda", seed=2, **force) < 2e-2
    if force.get("warps", 4) == 4:  # the warpgroup path with the same tilings
        assert check_tile(CFG, "in_proj", 64, "cuda", seed=3, wgmma=True, **force) < 2e-2
        assert check_tile(CFG, "o_proj", 17, "cuda", seed=4, wgmma=True, **force) < 2e-2
