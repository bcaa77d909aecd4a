"""The tensor-core MLA decode (:mod:`decodescope.kernels.specialized.mla_decode_tc`): its
``ldmatrix`` variant and knobs.

CPU: both fragment-load variants compile for sm_90a (no GPU) at the kimi-k3 TP8 / TP16 shapes
at 8, 32 and 64 sequences (and draft tokens), and at the tiny preset (an odd number of k-steps
and of n-tiles per warp: the ``x2`` tails); the environment knobs parse with one-line errors.
GPU (``pytest -m gpu``, H200): each variant vs ``mla_decode_ref`` with the output and the new
cache rows poisoned with NaN, then a CUDA graph replayed twice (the split counters reset).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
# the package's interface module first: it sets CUTE_DSL_ARCH (sm_90a) before cutlass loads
pytest.importorskip("decodescope.kernels.specialized.interface")

import dataclasses  # noqa: E402

from decodescope.kernels.config import LayerSpec, get_config  # noqa: E402
from decodescope.kernels.reference import rel_l2  # noqa: E402
from decodescope.kernels.specialized import mla_decode as mla  # noqa: E402
from decodescope.kernels.specialized import mla_decode_tc as mtc  # noqa: E402

KNOBS = (
    "DECODESCOPE_MLA_TC_LDSM",
    "DECODESCOPE_MLA_TC_SPLITS",
    "DECODESCOPE_MLA_TC_DIAG",
    "DECODESCOPE_MLA_TC_CLUSTER",
    "DECODESCOPE_MLA_TC_CLUSTER_SEQS",
    "DECODESCOPE_MLA_TC_UNROLL",
    "DECODESCOPE_MLA_TC_NBUF",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in (*KNOBS, "DECODESCOPE_MLA_HEADS_PER_CTA"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("ldsm", [False, True])
@pytest.mark.parametrize(
    "tp,batch,tokens", [(8, 8, 1), (8, 32, 1), (8, 64, 1), (16, 8, 1), (16, 32, 1), (16, 64, 1)]
)
def test_compiles_k3(tp, batch, tokens, ldsm, monkeypatch):
    monkeypatch.setenv("DECODESCOPE_MLA_TC_LDSM", "1" if ldsm else "0")
    p = mtc.plan_for(get_config("kimi-k3", tp), batch, tokens)
    assert p.ldsm is ldsm
    assert p.smem_bytes <= mtc.SMEM_MAX
    assert mtc.compile_plan(p) is not None


@pytest.mark.parametrize(
    "preset,tp,batch,tokens,hg",
    [("kimi-k3", 8, 8, 8, 0), ("kimi-k3", 8, 1, 8, 0), ("kimi-k3", 8, 64, 1, 12),
     ("tiny", 1, 2, 3, 0), ("tiny", 1, 8, 1, 4), ("tiny", 2, 8, 8, 0)],
)  # fmt: skip
def test_ldsm_compiles_rows_and_tails(preset, tp, batch, tokens, hg):
    """Rows > 8 (``x4`` A loads: 8x8 at 2 heads, 64x1 at 12 heads), rows <= 8 (``x2``), and the
    tiny preset's 5 k-steps (576 -> 80 latent) and 1 n-tile per warp (odd: ``x2`` tails)."""
    p = mtc.plan_for(get_config(preset, tp), batch, tokens, heads_per_cta=hg)
    p = dataclasses.replace(p, ldsm=True)
    assert mtc.compile_plan(p) is not None


@pytest.mark.parametrize(
    "tp,batch,tokens", [(8, 8, 1), (8, 16, 1), (8, 32, 1), (8, 64, 1), (16, 32, 1), (16, 64, 1),
                        (8, 8, 8)],
)  # fmt: skip
def test_cluster_compiles_k3(tp, batch, tokens, monkeypatch):
    """The cluster variant (with the ldmatrix loads): splits of a (sequence, group) in one
    cluster of <= 8, about one CTA per SM, all heads per CTA where they fit 16 rows."""
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER", "1")
    monkeypatch.setenv("DECODESCOPE_MLA_TC_LDSM", "1")
    cfg = get_config("kimi-k3", tp)
    p = mtc.plan_for(cfg, batch, tokens)
    assert p.clustered and 1 < p.splits <= mtc.CLUSTER_MAX
    assert p.hs * p.csize >= p.hg and p.rows <= mtc.ROWS
    assert p.groups * p.batch * p.splits <= mtc.NUM_SMS
    if tokens == 1 and cfg.mla_heads <= mtc.ROWS:
        assert p.hg == cfg.mla_heads  # the cache read once per sequence
    assert p.smem_bytes <= mtc.SMEM_MAX
    assert mtc.compile_plan(p) is not None


@pytest.mark.parametrize(
    "tp,batch,seqs", [(8, 64, 2), (8, 64, 4), (8, 32, 2), (8, 16, 2), (16, 64, 4), (16, 32, 2)]
)
def test_cluster_seqs_compiles_k3(tp, batch, seqs, monkeypatch):
    """Clusters over several sequences too (``DECODESCOPE_MLA_TC_CLUSTER_SEQS``): a CTA absorbs
    and applies W_UV for its share of the heads for all of them (cluster <= 8 CTAs)."""
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER", "1")
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER_SEQS", str(seqs))
    p = mtc.plan_for(get_config("kimi-k3", tp), batch, 1)
    assert p.clustered and p.cs_seqs == seqs and p.csize <= mtc.CLUSTER_MAX
    assert p.hs * p.csize >= p.hg and p.arows <= mtc.ROWS
    assert p.smem_bytes <= mtc.SMEM_MAX
    assert mtc.compile_plan(p) is not None


@pytest.mark.parametrize(
    "preset,tp,batch,tokens,cluster,seqs",
    [("kimi-k3", 8, 64, 1, "0", "1"), ("kimi-k3", 8, 64, 1, "1", "4"), ("kimi-k3", 8, 8, 8, "0", "1"),
     ("tiny", 1, 8, 1, "1", "2")],
)  # fmt: skip
def test_unroll_compiles(preset, tp, batch, tokens, cluster, seqs, monkeypatch):
    """``DECODESCOPE_MLA_TC_UNROLL``: the w_uk / w_uv loads of a group issued before its FMAs
    (plain and cluster paths; per-unit row counts below the unroll at the tiny preset)."""
    monkeypatch.setenv("DECODESCOPE_MLA_TC_UNROLL", "32")
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER", cluster)
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER_SEQS", seqs)
    p = mtc.plan_for(get_config(preset, tp), batch, tokens)
    assert p.unroll == 32
    assert mtc.compile_plan(p) is not None


@pytest.mark.parametrize(
    "tp,batch,cluster", [(8, 64, "0"), (8, 32, "0"), (8, 64, "1"), (8, 32, "1"), (16, 64, "1")]
)
def test_nbuf1_compiles(tp, batch, cluster, monkeypatch):
    """``DECODESCOPE_MLA_TC_NBUF=1``: one key buffer, <= 113 KB and 128 registers (two CTAs
    per SM), about two CTAs per SM in the grid."""
    monkeypatch.setenv("DECODESCOPE_MLA_TC_NBUF", "1")
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER", cluster)
    p = mtc.plan_for(get_config("kimi-k3", tp), batch, 1)
    assert p.nbuf == 1 and p.ctas_per_sm == 2 and p.smem_bytes <= mtc.SMEM_TWO_CTAS
    assert mtc.NUM_SMS < p.groups * p.batch * p.splits <= 2 * mtc.NUM_SMS
    assert mtc.compile_plan(p) is not None


def test_default_cluster_choice():
    """Unset ``DECODESCOPE_MLA_TC_CLUSTER``: clusters of 2 from 64 query rows where the grid
    covers at least half the SMs (H200 s9/r4, TP8: 64x1 75.7 -> 61.5 us, 8x8 93.9 -> 54.7; 32x1
    lost: 60.0 -> 65.3); elsewhere exactly the plain plan."""
    import dataclasses

    for tp, b, t, on in [(8, 64, 1, True), (8, 8, 8, True), (16, 64, 1, True), (8, 32, 1, False),
                         (8, 16, 1, False), (8, 1, 8, False), (8, 128, 1, False),
                         (16, 8, 8, False)]:  # fmt: skip
        p = mtc.plan_for(get_config("kimi-k3", tp), b, t)
        assert p.clustered is on, (tp, b, t)
        if on:
            assert p.csize == 2 and p.hg * t <= mtc.ROWS
        else:
            q = dataclasses.replace(p, cluster=0)
            assert (p.hg, p.splits) == (q.hg, q.splits), (tp, b, t)
    p = mtc.plan_for(get_config("kimi-k3", 8), 64, 1)
    assert (p.hg, p.splits) == (12, 2)


def test_cluster_plans_tp8(monkeypatch):
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER", "1")
    cfg = get_config("kimi-k3", 8)
    got = {b: (mtc.plan_for(cfg, b, 1).splits, mtc.plan_for(cfg, b, 1).nblk) for b in (16, 32, 64)}
    assert got == {16: (6, 3), 32: (4, 5), 64: (2, 9)}
    assert not mtc.plan_for(cfg, 128, 1).clustered  # one split: the plain path


def test_cluster_tiny_compiles(monkeypatch):
    """Uneven heads per split (tiny TP1: 4 heads over 3 splits) and the x2 tails."""
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER", "1")
    monkeypatch.setenv("DECODESCOPE_MLA_TC_LDSM", "1")
    p = mtc.plan_for(get_config("tiny", 1), 4, 1, splits=3)
    assert p.clustered and p.splits == 3 and p.hs == 2
    assert mtc.compile_plan(p) is not None


def test_knobs(monkeypatch):
    cfg = get_config("kimi-k3", 8)
    p = mtc.plan_for(cfg, 64, 1)
    assert p.ldsm and p.cluster == -1  # the defaults (ldmatrix since s9/r2, clusters by size)
    monkeypatch.setenv("DECODESCOPE_MLA_TC_LDSM", "0")
    assert not mtc.plan_for(cfg, 64, 1).ldsm
    monkeypatch.setenv("DECODESCOPE_MLA_TC_LDSM", "1")
    monkeypatch.setenv("DECODESCOPE_MLA_TC_SPLITS", "2")
    p = mtc.plan_for(cfg, 64, 1)
    assert p.ldsm and p.splits == 2
    assert mtc.plan_for(cfg, 64, 1, splits=3).splits == 3  # an explicit argument wins
    monkeypatch.setenv("DECODESCOPE_MLA_TC_LDSM", "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_TC_LDSM: an integer"):
        mtc.plan_for(cfg, 64, 1)
    monkeypatch.setenv("DECODESCOPE_MLA_TC_LDSM", "2")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_TC_LDSM: 0 or 1"):
        mtc.plan_for(cfg, 64, 1)
    monkeypatch.setenv("DECODESCOPE_MLA_TC_LDSM", "0")
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER", "x")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_TC_CLUSTER: an integer"):
        mtc.plan_for(cfg, 64, 1)
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER", "1")
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER_SEQS", "3")
    with pytest.raises(ValueError, match="CLUSTER_SEQS=3 must divide the batch"):
        mtc.plan_for(cfg, 64, 1)
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER_SEQS", "1")
    monkeypatch.setenv("DECODESCOPE_MLA_TC_NBUF", "3")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_TC_NBUF: 1 or 2"):
        mtc.plan_for(cfg, 64, 1)


# -- GPU -------------------------------------------------------------------------------------


def _inputs(cfg, batch: int, tokens: int, seed: int):
    """The kernel's weights (``make_layer_weights``' distributions, without the rest of the
    layer), a cache from ``make_state`` and random a / q / g."""
    from decodescope.kernels.weights import make_state

    g = torch.Generator(device="cuda").manual_seed(seed)
    m, nh = cfg.mla, cfg.mla_heads

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * std).to(torch.bfloat16)

    s = m.kv_lora_rank**-0.5
    w = {"kv_a_norm": (1 + 0.1 * torch.randn(m.kv_lora_rank, device="cuda", generator=g)).to(
            torch.bfloat16),
         "w_uk": rnd(nh, m.qk_nope_head_dim, m.kv_lora_rank, std=s),
         "w_uv": rnd(nh, m.kv_lora_rank, m.v_head_dim, std=s)}  # fmt: skip
    st = make_state(cfg, LayerSpec(7, "mla", "moe"), batch, tokens, seed=seed, device="cuda")
    N = batch * tokens
    return (
        w,
        st["kv_cache"],
        rnd(N, cfg.mla_qkv_a_out),
        rnd(N, cfg.mla_q_b_out),
        rnd(N, cfg.mla_v_dim),
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "ldsm,cluster,seqs,unroll,nbuf",
    [("0", "0", "1", "", ""), ("1", "0", "1", "", ""), ("1", "1", "1", "", ""),
     ("0", "1", "1", "", ""), ("1", "1", "2", "", ""), ("1", "1", "4", "", ""),
     ("1", "0", "1", "32", ""), ("1", "1", "4", "32", ""), ("1", "0", "1", "", "1"),
     ("1", "1", "1", "", "1"), ("", "", "", "", "")],
)  # fmt: skip
@pytest.mark.parametrize(
    "tp,batch,tokens,splits", [(8, 8, 1, 0), (8, 16, 1, 0), (8, 32, 1, 0), (8, 64, 1, 0),
                               (8, 64, 1, 3), (16, 64, 1, 0), (8, 8, 8, 0), (8, 1, 8, 0)],
)  # fmt: skip
def test_gpu_vs_reference(
    tp, batch, tokens, splits, ldsm, cluster, seqs, unroll, nbuf, monkeypatch
):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if seqs not in ("", "1") and (tokens > 1 or batch % int(seqs) or splits):
        pytest.skip("clusters over sequences: one token, batch divisible, the plan's splits")
    if nbuf == "1" and tokens > 1:
        pytest.skip("one key buffer: one token (the shared memory of 8 tokens does not fit)")
    monkeypatch.setenv("DECODESCOPE_MLA_TC_LDSM", ldsm)
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER", cluster)
    monkeypatch.setenv("DECODESCOPE_MLA_TC_CLUSTER_SEQS", seqs)
    monkeypatch.setenv("DECODESCOPE_MLA_TC_UNROLL", unroll)
    monkeypatch.setenv("DECODESCOPE_MLA_TC_NBUF", nbuf)
    cfg = get_config("kimi-k3", tp)
    w, cache0, a, q, g = _inputs(cfg, batch, tokens, 100 + batch + tokens)
    ctx = cfg.context_len
    ref, rcache = mla.mla_decode_ref(cfg, w, a, q, g, cache0, tokens)
    out = torch.empty_like(ref)
    cache = cache0.clone()
    for _ in range(3):  # the split counters reset themselves between launches
        out.fill_(float("nan"))
        cache[:, ctx:].fill_(float("nan"))
        mtc.mla_decode_tc(cfg, w, a, q, g, cache, out, tokens, splits=splits)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(out).all())
        assert rel_l2(out, ref) < 2e-2
        assert rel_l2(cache[:, ctx:], rcache[:, ctx:]) < 1e-2
        assert torch.equal(cache[:, :ctx], cache0[:, :ctx])
    out_g = torch.full_like(out, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mtc.mla_decode_tc(cfg, w, a, q, g, cache, out_g, tokens, splits=splits)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert rel_l2(out_g, out) < 1e-6
