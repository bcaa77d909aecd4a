"""The TMA skinny GEMM (kernels/specialized/tma_gemm.py).

CPU: the kernel compiles for sm_90a at the projections it would serve (KDA in_proj, o_proj with
its residual epilogue, MLA q_b, the dense MLP's gate_up / down; TP8 / TP16; 16 / 32 / 33 / 64
tokens; one split and split-K; 64- and 128-row tiles); its PTX issues the weight's TMA copies
before ``griddepcontrol.wait`` and the activations' after; the plan's rules and errors; the
knob ``DECODESCOPE_PROJ_TMA`` (off by default) moves the cuBLAS-served projections onto it and
their op implementation with them. GPU (``-m gpu``): the kernel against its torch reference
on fresh random inputs with NaN-poisoned outputs, twice in a row (the split-K counters come
back to zero), inside a CUDA graph replayed with new inputs, the residual epilogue in place.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("decodescope.kernels.specialized.interface")  # CUTE_DSL_ARCH first

from decodescope.kernels.config import get_config  # noqa: E402
from decodescope.kernels.specialized import interface as itf  # noqa: E402
from decodescope.kernels.specialized import tile_gemm as tg  # noqa: E402
from decodescope.kernels.specialized import tma_gemm as tm  # noqa: E402

CFGS = {tp: get_config("kimi-k3", tp) for tp in (8, 16)}


def _shapes(cfg) -> dict[str, tuple[int, int, bool]]:
    """op -> (weight rows, k, residual epilogue): the GPU script's cases."""
    from tile_fakes import load_script

    return load_script("gpu_tma_gemm").shapes(cfg)


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("op", ["in_proj", "o_proj", "q_b", "gate_up", "down"])
@pytest.mark.parametrize("m", [16, 33, 64])
def test_compiles(tp, op, m):
    n, k, res = _shapes(CFGS[tp])[op]
    p = tm.plan(m, k, n, residual_epilogue=res)
    assert p.smem_bytes <= 113 * 1024  # two CTAs per SM
    assert p.ctas <= tm.occupancy(p) * tm.NUM_SMS  # one wave
    assert tm.compile_plan(p) is not None


def test_pack_weight():
    """Tile (row tile r, chunk c) of the packed weight is the block at rows (r * kt + c) * bm;
    the rows past n are zeros (synthetic small weight)."""
    w = torch.randn(100, 128).to(torch.bfloat16)
    wp = tm.pack_weight(w, 64)
    assert wp.shape == (2 * 2 * 64, 64)
    assert torch.equal(wp[0:64], w[0:64, 0:64]) and torch.equal(wp[64:128], w[0:64, 64:128])
    assert torch.equal(wp[128:164], w[64:100, 0:64]) and not wp[164:192].any()
    assert tm.pack_weight(w, 64, cm=4).shape == (4 * 2 * 64, 64)


@pytest.mark.parametrize("kw", [{"splits": 1}, {"bm": 128}, {"stages": 2}, {"splits": 7},
                                {"bk": 128, "stages": 3}, {"bk": 256, "stages": 2, "bm": 128},
                                {"cm": 2}, {"cm": 4, "splits": 1}, {"packed": True},
                                {"packed": True, "cm": 2, "bm": 128}, {"csplit": True},
                                {"csplit": True, "bk": 128, "stages": 3}, {"wsp": True},
                                {"wsp": True, "csplit": True, "cm": 1, "stages": 6}])  # fmt: skip
def test_compiles_variants(kw):
    cfg = CFGS[16]
    p = tm.plan(32, cfg.hidden, cfg.kda_in_proj_out, **kw)
    assert tm.compile_plan(p) is not None


def test_plan_rules():
    cfg = CFGS[16]
    p = tm.plan(64, cfg.hidden, cfg.kda_in_proj_out)  # N 3216: 51 row tiles of 64
    assert (p.bn, p.kt, p.row_tiles, p.npad) == (64, 112, 51, 3264)
    assert tm.occupancy(p) == 3 and p.stages == 4
    assert p.splits == 7 and p.ctas == 357  # one wave at three CTAs per SM (396 slots)
    assert tm.plan(64, cfg.hidden, cfg.kda_in_proj_out, bk=128, stages=3).ctas == 255  # 2 / SM
    assert tm.plan(1, 1536, 7168).bn == 16 and tm.plan(17, 1536, 7168).bn == 32
    assert tm.plan(64, cfg.hidden, cfg.kda_in_proj_out, cm=4).row_tiles == 52  # whole clusters
    for bad, msg in [
        (dict(m=65, k=1536, n=7168), "m=65"),
        (dict(m=8, k=1500, n=7168), "multiple of 64"),
        (dict(m=8, k=1536, n=7166), "multiple of 64, n=7166 of 8"),
        (dict(m=8, k=1536, n=7168, bk=96), "bk=96"),
        (dict(m=8, k=1600, n=7168, bk=128), "k=1600 must be a multiple of 128"),
        (dict(m=8, k=1536, n=7168, bm=96), "bm=96"),
        (dict(m=8, k=1536, n=7168, splits=25), r"splits=25 \(1..24\)"),
        (dict(m=8, k=1536, n=7168, stages=1), "stages=1"),
        (dict(m=16, k=1536, n=7168, cm=4), r"cm=4 \(1, 2 or 4; at most bn/8 = 2"),
        (dict(m=64, k=1536, n=7168, cm=2, rotate=True), "no rotate"),
        (dict(m=64, k=1536, n=7168, csplit=True), r"csplit takes 2..8 splits \(got 1\)"),
        (dict(m=64, k=1536, n=7168, csplit=True, splits=2, stages=2), "within the weight"),
    ]:
        with pytest.raises(ValueError, match=msg):
            tm.TmaPlan(**bad)


def test_ptx_copy_warp():
    """``wsp``: a fifth warp (160 threads) issues the copies; the same four MMAs per chunk."""
    cfg = CFGS[16]
    p = tm.plan(64, cfg.hidden, cfg.kda_in_proj_out, wsp=True)
    assert p.threads == 160 and tm.plan(64, cfg.hidden, cfg.kda_in_proj_out).threads == 128
    ptx = itf.ptx_text(tm.TmaGemm(p), *tm._fake_args(p))
    assert ".reqntid 160" in ptx or ".maxntid 160" in ptx
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 4


def test_ptx_weight_before_wait():
    """The weight's copies of the first stages precede the PDL wait; the activations' follow."""
    cfg = CFGS[8]
    p = tm.plan(64, cfg.hidden, cfg.kda_in_proj_out)
    ptx = itf.ptx_text(tm.TmaGemm(p), *tm._fake_args(p))
    wait = ptx.index("griddepcontrol.wait")
    copies = [mt.start() for mt in re.finditer(r"cp\.async\.bulk\.tensor\.2d", ptx)]
    assert len(copies) == 4  # weight before the wait, activation after, both in the loop
    assert copies[0] < wait < copies[1]
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16", ptx)) == 4
    assert "ld.global.cg.v4.f32" in ptx  # the split-K reduction


def test_knob(monkeypatch):
    """Off by default; ``oproj`` moves the residual-epilogue projection (o_proj) only, ``1``
    every cuBLAS-served one, where :func:`takes` says so; a bad value is a one-line error."""
    monkeypatch.delenv(tm.ENV, raising=False)
    assert not tm.enabled() and not tm.serves(True)
    monkeypatch.setenv(tm.ENV, "oproj")
    assert tm.serves(True) and not tm.serves(False)
    monkeypatch.setenv(tm.ENV, "1")
    assert tm.serves(True) and tm.serves(False)
    monkeypatch.setenv(tm.ENV, "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_PROJ_TMA='yes'"):
        tm.enabled()
    cfg = CFGS[8]
    assert tm.plan(64, cfg.kda_dim, cfg.hidden, True, **tm.KNOB_TILING).splits >= 2
    x = torch.zeros(32, 1536, dtype=torch.bfloat16)
    w = torch.zeros(7168, 1536, dtype=torch.bfloat16)
    o = torch.zeros(32, 7168, dtype=torch.bfloat16)
    assert not tm.takes(x, w, o)  # CPU tensors: cuBLAS's path (torch on the CPU) keeps them
    assert not tm.takes(x[:, :1500], w[:, :1500], o)


def test_step_op_impl(monkeypatch):
    """With the knob the ops cuBLAS served at 64 tokens become the kernels' own: ``oproj`` the
    o_proj, ``1`` the input projection too."""
    from decodescope.kernels.specialized import step as S

    def impl():
        p = S.plan(preset="kimi-k3", tp_shape=8, batch=64, tokens_per_seq=1,
                   layers="dense,kda,mla", seed=0, front_norm=0)  # fmt: skip
        return p.op_impl()

    inp = "attn.input_residual_norm+qkv_proj+f_b_proj"
    monkeypatch.delenv(tm.ENV, raising=False)
    before = impl()
    assert before["attn.o_proj"] == before[inp] == tg.CUBLAS_IMPL
    monkeypatch.setenv(tm.ENV, "oproj")
    got = impl()
    assert got["attn.o_proj"] == S.CUTE and got[inp] == tg.CUBLAS_IMPL
    monkeypatch.setenv(tm.ENV, "1")
    assert set(impl().values()) == {S.CUTE}


# -- GPU ----------------------------------------------------------------------------------------


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("op", ["in_proj", "o_proj", "gate_up"])
@pytest.mark.parametrize("m,kw", [(64, {}), (32, {}), (17, {}), (64, {"splits": 1}),
                                  (64, {"bm": 128}), (8, {"stages": 2}),
                                  (64, {"bk": 128, "stages": 3}),
                                  (33, {"bk": 256, "stages": 2, "bm": 128}),
                                  (64, {"rotate": True}),
                                  (17, {"rotate": True, "splits": 1}),
                                  (64, {"cm": 2}), (32, {"cm": 4}),
                                  (64, {"cm": 4, "splits": 1, "bk": 128, "stages": 3}),
                                  (64, {"packed": True}), (17, {"packed": True, "bm": 128}),
                                  (64, {"packed": True, "cm": 2, "splits": 1}),
                                  (64, {"csplit": True}),
                                  (33, {"csplit": True, "packed": True, "stages": 6}),
                                  (64, {"csplit": True, "bk": 128, "stages": 3}),
                                  (64, {"wsp": True}),
                                  (33, {"wsp": True, "csplit": True, "packed": True}),
                                  (64, {"wsp": True, "splits": 1, "stages": 8, "cm": 2})])  # fmt: skip
def test_gpu_vs_ref(tp, op, m, kw):
    n, k, res = _shapes(CFGS[tp])[op]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(n + m)
    bf = torch.bfloat16
    w = (torch.randn(n, k, device=dev, generator=gen) * k**-0.5).to(bf)
    wk = tm.pack_weight(w, kw.get("bm", 64), kw.get("cm", 1)) if kw.get("packed") else w
    for _ in range(2):  # fresh inputs; the second launch finds the counters zeroed
        x = torch.randn(m, k, device=dev, generator=gen).to(bf)
        e = torch.randn(m, n, device=dev, generator=gen).to(bf) if res else None
        ref = tm.tma_gemm_ref(x, w, e)
        out = torch.full((m, n), float("nan"), device=dev, dtype=bf)
        tm.tma_gemm(x, wk, out, e, **kw)
        torch.cuda.synchronize()
        assert torch.isfinite(out.float()).all()
        assert _rel(out, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [8, 16])
def test_gpu_graph_in_place(tp):
    """o_proj's residual epilogue in place (``out`` is the residual) inside a CUDA graph, replayed
    three times with new inputs copied in: each replay equals the reference."""
    n, k, _ = _shapes(CFGS[tp])["o_proj"]
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(tp)
    bf = torch.bfloat16
    w = (torch.randn(n, k, device=dev, generator=gen) * k**-0.5).to(bf)
    x = torch.zeros(64, k, device=dev, dtype=bf)
    r = torch.zeros(64, n, device=dev, dtype=bf)
    tm.tma_gemm(x, w, r, r)  # compile and allocate outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tm.tma_gemm(x, w, r, r)
    for _ in range(3):
        xi = torch.randn(64, k, device=dev, generator=gen).to(bf)
        ri = torch.randn(64, n, device=dev, generator=gen).to(bf)
        ref = tm.tma_gemm_ref(xi, w, ri)
        x.copy_(xi)
        r.copy_(ri)
        g.replay()
        torch.cuda.synchronize()
        assert _rel(r, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m", [32, 64])
def test_gpu_project_knob(m, monkeypatch):
    """KDA in_proj (norm launch + GEMM) and o_proj through ``tile_gemm.project`` with the knob
    against cuBLAS's path on the same inputs."""
    from tile_fakes import attn_projections

    run = attn_projections(CFGS[16], m, torch.device("cuda"))
    outs = {}
    for mode in ("0", "1", "oproj"):
        monkeypatch.setenv(tm.ENV, mode)
        outs[mode] = run()
    for mode in ("1", "oproj"):
        for a, b in zip(outs[mode], outs["0"], strict=True):
            assert torch.isfinite(a.float()).all()
            assert _rel(a, b) < 1e-2
