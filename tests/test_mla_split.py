"""The three-phase MLA decode (:mod:`decodescope.kernels.specialized.mla_decode_split`,
``DECODESCOPE_MLA_KERNEL=split``).

CPU: compiles for sm_90a (no GPU) at the kimi-k3 TP8 / TP16 shapes at 1, 8 and 32 sequences of
one token; the plan's work split (items per phase, shared memory, CTAs per SM) and its knobs
(one-line errors); the kernel choice.
GPU (``pytest -m gpu``, H200): vs ``mla_decode_ref`` with the output and the new cache rows
poisoned with NaN, three launches (the counters reset themselves), the error word zero, then a
CUDA graph replayed twice.
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
# the package's interface module first: it sets CUTE_DSL_ARCH (sm_90a) before cutlass loads
pytest.importorskip("decodescope.kernels.specialized.interface")

from decodescope.kernels.config import LayerSpec, get_config  # noqa: E402
from decodescope.kernels.reference import rel_l2  # noqa: E402
from decodescope.kernels.specialized import interface as itf  # noqa: E402
from decodescope.kernels.specialized import mla_decode as mla  # noqa: E402
from decodescope.kernels.specialized import mla_decode_split as msp  # noqa: E402

KNOBS = (
    "DECODESCOPE_MLA_SPLIT_SPLITS",
    "DECODESCOPE_MLA_SPLIT_ACHUNKS",
    "DECODESCOPE_MLA_SPLIT_VROWS",
    "DECODESCOPE_MLA_SPLIT_NBUF",
    "DECODESCOPE_MLA_SPLIT_TRACE",
    "DECODESCOPE_MLA_SPLIT_DIAG",
    "DECODESCOPE_MLA_SPLIT_FUSE",
    "DECODESCOPE_MLA_SPLIT_L2PRE",
    "DECODESCOPE_MLA_SPLIT_UVFAST",
    "DECODESCOPE_MLA_SPLIT_TAIL",
    "DECODESCOPE_MLA_SPLIT_LL",
    "DECODESCOPE_MLA_SPLIT_EARLYABS",
    "DECODESCOPE_MLA_SPLIT_WAVES",
    "DECODESCOPE_MLA_KERNEL",
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("tp,batch", [(8, 1), (8, 8), (8, 32), (16, 8)])
def test_compiles_k3(tp, batch):
    p = msp.plan_for(get_config("kimi-k3", tp), batch, 1)
    assert p.smem_bytes <= msp.SMEM_MAX
    assert msp.compile_plan(p) is not None


def test_compiles_knobs():
    """Two key buffers with one CTA per SM and several blocks per split; absorption items of
    the whole latent width; W_UV items of 8 rows and all output columns; the trace stores."""
    p = msp.plan_for(get_config("kimi-k3", 8), 8, 1)
    p = dataclasses.replace(
        p, splits_force=4, nbuf_force=2, achunks_force=1, vrows_force=8, trace=1
    )
    assert (p.blk_max, p.ctas_per_sm, p.vchunks, p.cw) == (5, 1, 1, 512)
    assert msp.compile_plan(p) is not None


def test_plans_tp8():
    """The default work split at TP8 (12 heads), the H200 s10/r2 choices: 1x1 17 splits of one
    key block (one buffer, two CTAs per SM), 8x1 8 splits, 32x1 4, 64x1 2 (two buffers, one
    CTA per SM), the absorption fused into the attention CTAs where they pass one wave (32x1,
    64x1); 24 absorption items of 256 columns, ~96 W_UV items."""
    cfg = get_config("kimi-k3", 8)
    got = {}
    for b in (1, 8, 32, 64):  # 17 blocks of 64 keys (1024 cached + 1 new)
        p = msp.plan_for(cfg, b, 1)
        got[b] = (p.splits, p.blk_max, p.nbuf, p.ctas_per_sm, p.fused, p.n_att, p.n_uv, p.grid)
        assert p.rows == 12 and p.nblk_all == 17 and p.n_abs == 24
    assert got == {
        1: (17, 1, 1, 2, False, 17, 24, 65),
        8: (8, 3, 2, 1, False, 64, 96, 184),
        32: (4, 5, 2, 1, True, 128, 96, 224),
        64: (2, 9, 2, 1, True, 128, 96, 224),
    }
    p = dataclasses.replace(msp.plan_for(cfg, 8, 1), splits_force=17)
    assert p.smem_bytes <= msp.SMEM_TWO_CTAS and p.vchunks == 2 and p.vrows == 2


@pytest.mark.parametrize(
    "tp,batch,tokens,want",
    [(8, 1, 8, (2, 6, 16, 17, 102, 102, 2)), (8, 8, 8, (2, 6, 16, 2, 12, 12, 1)),
     (8, 1, 2, (6, 2, 12, 17, 34, 34, 2)), (16, 1, 8, (2, 3, 16, 17, 51, 51, 2)),
     (16, 1, 2, (6, 1, 12, 17, 17, 17, 2))],
)  # fmt: skip
def test_head_groups(tp, batch, tokens, want):
    """Several tokens per sequence (the verify step): the heads split into groups of ``hg``
    (``hg x tokens <= 16`` MMA rows, ``hg`` dividing the heads), each group its own attention
    items and partials (``groups x splits`` per sequence); with groups the splits' rule
    aims at 128 attention items. One group where every head fits (TP16 1+1 tokens: 6 x 2 = 12
    rows), as at one token. Compiles for sm_90a."""
    p = msp.plan_for(get_config("kimi-k3", tp), batch, tokens)
    got = (p.hg, p.groups, p.rows, p.splits, p.psplits, p.n_att // batch, p.ctas_per_sm)
    assert got == want
    assert p.smem_bytes <= msp.SMEM_MAX
    assert msp.compile_plan(p) is not None


def test_fuse_plan_compiles():
    """``DECODESCOPE_MLA_SPLIT_FUSE``: 1 no CTAs of their own for the absorption (32x1: 128
    attention + 96 W_UV CTAs), not where the attention items are fewer (1x1: 17 < 24); 0
    never; unset where the absorption + attention CTAs pass one wave."""
    cfg = get_config("kimi-k3", 8)
    p = msp.plan_for(cfg, 32, 1)
    assert p.fuse_abs == -1 and p.fused and p.a_ctas == 0 and p.grid == 128 + 96
    assert not dataclasses.replace(p, fuse_abs=0).fused
    assert dataclasses.replace(msp.plan_for(cfg, 8, 1), fuse_abs=1).fused
    assert not msp.plan_for(cfg, 8, 1).fused  # 24 + 64 CTAs: one wave
    assert not dataclasses.replace(msp.plan_for(cfg, 1, 1), fuse_abs=1).fused
    assert msp.compile_plan(p) is not None


@pytest.mark.parametrize("batch", [1, 32])
def test_l2pre_ptx(batch, monkeypatch):
    """``DECODESCOPE_MLA_SPLIT_L2PRE=1``: L2 prefetches (of w_uk / w_uv) ahead of the PDL
    wait, nothing else moves (the ticket after it); unset: no prefetch at all. 32x1 is the
    fused plan."""
    monkeypatch.delenv("DECODESCOPE_NO_PDL", raising=False)
    res = []
    for l2pre in (0, 1):
        p = dataclasses.replace(msp.plan_for(get_config("kimi-k3", 8), batch, 1), l2pre=l2pre)
        assert p.pdl and p.fused == (batch == 32)
        ptx = itf.ptx_text(msp.MLADecodeSplit(p), *msp._fake_args(p))
        w = ptx.find("griddepcontrol.wait")
        assert w > 0 and ptx.count("griddepcontrol.wait") == 1
        pre = ptx[:w]
        res.append((pre.count("prefetch.global.L2"), ptx.count("prefetch"), pre.count("atom.")))
    assert res[0] == (0, 0, 0)
    assert res[1][0] >= 1 and res[1][0] == res[1][1] and res[1][2] == 0


def test_earlyabs_plans(monkeypatch):
    """``DECODESCOPE_MLA_SPLIT_EARLYABS`` (default 1) takes effect where the absorption has CTAs of its own
    and the grid is one wave: TP8 at 1 and 2 sequences (65 / 106 CTAs, two per SM), TP16 at 1
    and 8 (132 CTAs, one per SM); not at TP8 8x1 (184 CTAs) nor where the absorption is fused
    into the attention CTAs (32 and 64 sequences)."""
    for tp, batch, tokens, on in [(8, 1, 1, True), (8, 2, 1, True), (16, 1, 1, True),
                                  (16, 8, 1, True), (8, 8, 1, False), (8, 32, 1, False),
                                  (8, 64, 1, False), (16, 64, 1, False)]:  # fmt: skip
        p = dataclasses.replace(msp.plan_for(get_config("kimi-k3", tp), batch, tokens), earlyabs=1)
        assert p.early_abs == on, (tp, batch, tokens)
        assert not dataclasses.replace(p, earlyabs=0).early_abs
        if on:
            assert p.a_ctas and p.grid <= msp.NUM_SMS * p.ctas_per_sm
    cfg = get_config("kimi-k3", 16)
    assert msp.plan_for(cfg, 8, 1).early_abs  # the default
    # the residency test counts the GPU's own SMs: fewer than the grid needs, not in effect
    assert not dataclasses.replace(msp.plan_for(cfg, 8, 1), sms=114).early_abs
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_EARLYABS", "0")
    assert not msp.plan_for(cfg, 8, 1).early_abs


@pytest.mark.parametrize("tp,batch", [(8, 1), (16, 8), (8, 32)])
def test_earlyabs_ptx(tp, batch, monkeypatch):
    """``EARLYABS=1``: the absorption CTAs' ``w_uk`` cp.async copies issued ahead of the PDL
    wait, no atomic (ticket) before it; the ticket's atomic still there for the other CTAs.
    Where it is not in effect (32x1: fused) the PTX is the default's."""
    monkeypatch.delenv("DECODESCOPE_NO_PDL", raising=False)
    out = []
    for e in (0, 1):
        p = dataclasses.replace(msp.plan_for(get_config("kimi-k3", tp), batch, 1), earlyabs=e)
        ptx = itf.ptx_text(msp.MLADecodeSplit(p), *msp._fake_args(p))
        w = ptx.find("griddepcontrol.wait")
        assert w > 0 and ptx.count("griddepcontrol.wait") == 1
        out.append((ptx, ptx[:w].count("cp.async"), ptx[:w].count("atom.")))
    (ptx0, pre0, at0), (ptx1, pre1, at1) = out
    assert pre0 == 0 and at0 == at1 == 0
    if batch == 32:
        assert ptx1 == ptx0
    else:
        assert pre1 > 0 and "atom.global" in ptx1[ptx1.find("griddepcontrol.wait") :]
        assert msp.compile_plan(p) is not None  # through ptxas for sm_90a


@pytest.mark.parametrize("tp,batch,tokens", [(8, 1, 1), (8, 8, 1), (8, 32, 1), (8, 1, 8),
                                             (16, 8, 1)])  # fmt: skip
def test_uvfast_ptx(tp, batch, tokens):
    """``DECODESCOPE_MLA_SPLIT_UVFAST=1``: the gate's loads move ahead of the W_UV phase's
    wait, the merge reads every split's ``(m, l)`` as one 8-byte load (and, one row per item,
    its two ``O`` columns too: 2 x splits reads where the default has 4 x splits), the MMA
    count stays; the rest of the kernel is untouched (the absorption / attention loads)."""
    p0 = dataclasses.replace(msp.plan_for(get_config("kimi-k3", tp), batch, tokens), uvfast=0)
    p1 = dataclasses.replace(p0, uvfast=1)
    ptx0, ptx1 = (itf.ptx_text(msp.MLADecodeSplit(p), *msp._fake_args(p)) for p in (p0, p1))
    assert ptx1.count("mma.sync") == ptx0.count("mma.sync")
    assert ptx1.count("cp.async.cg") == ptx0.count("cp.async.cg")
    v2 = ptx1.count("ld.global.cg.v2.f32")
    assert ptx0.count("ld.global.cg.v2.f32") == 0
    S = p0.splits
    if p0.uv_pairs:
        assert (tp, batch) != (8, 32)
        assert v2 == 2 * S and ptx1.count("ld.global.cg") == 2 * S
        assert ptx0.count("ld.global.cg") == 4 * S
    else:
        assert v2 == S  # (m, l) once; O still as four-wide loads
        assert ptx1.count("ld.global.cg.v4.f32") == ptx0.count("ld.global.cg.v4.f32")
    assert msp.compile_plan(p1) is not None
    if (tp, batch, tokens) == (8, 1, 1):  # four chains: the same loads and MMAs
        p2 = dataclasses.replace(p0, uvfast=2)
        ptx2 = itf.ptx_text(msp.MLADecodeSplit(p2), *msp._fake_args(p2))
        for k in ("mma.sync", "ld.global.cg", "ldmatrix", "cp.async.cg"):
            assert ptx2.count(k) == ptx1.count(k), k


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 1), (32, 1), (64, 1), (1, 8), (8, 8)])
def test_tail_blocks(tp, batch, tokens):
    """``tail``: the splits' block ranges tile ``[0, nblk_all)``, the last split holds the
    tail (the block of the new rows) and has the fewest cached blocks, no split is longer than
    the cached blocks' ceiling; one more split where those divide evenly and the grid stays
    one wave (TP16 8x1: 9 of <= 2)."""
    p0 = dataclasses.replace(msp.plan_for(get_config("kimi-k3", tp), batch, tokens), tail=0)
    p1 = dataclasses.replace(p0, tail=1)
    for p in (p0, p1):
        r = [p.block_range(s) for s in range(p.splits)]
        assert r[0][0] == 0 and r[-1][1] == p.nblk_all
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(r, r[1:], strict=False))
        assert p.blk_max == max(e - b for b, e in r)
    F = p1.full_blocks
    assert F == 16 and p1.nblk_all == 17
    r = [p1.block_range(s) for s in range(p1.splits)]
    cached = [min(e, F) - b for b, e in r]
    assert cached[-1] == min(cached) and max(cached) == -(-F // p1.splits)
    assert p1.blk_max <= p0.blk_max
    alt = dataclasses.replace(p1, splits_force=p0.splits + 1)
    if F % p0.splits == 0 and p0.splits < F and alt.grid <= msp.NUM_SMS * alt.ctas_per_sm:
        assert p1.splits == p0.splits + 1 and p1.blk_max < p0.blk_max
    else:  # no extra split past one wave (TP8 8x1: 192 CTAs at one per SM)
        assert p1.splits == p0.splits
    if (tp, batch, tokens) == (16, 8, 1):  # 132 CTAs: one wave
        assert (p0.splits, p0.blk_max, p1.splits, p1.blk_max, p1.grid) == (8, 3, 9, 2, 132)
    if (tp, batch, tokens) in ((8, 8, 1), (8, 32, 1), (8, 64, 1)):
        assert p1.splits == p0.splits
    # a forced split count stays as it is
    pf = dataclasses.replace(p0, tail=1, splits_force=p0.splits)
    assert pf.splits == p0.splits


@pytest.mark.parametrize("batch,tokens", [(1, 1), (8, 1), (1, 8)])
def test_tail_compiles(batch, tokens):
    """``tail``: compiles (sm_90a, CPU) at TP8 1x1 (17 one-block splits), 8x1 (9 splits, two
    key buffers) and 1x8 (head groups); the fill of the first block moves ahead of the
    absorption wait (one more ``bar.sync``), the MMA count stays."""
    p0 = msp.plan_for(get_config("kimi-k3", 8), batch, tokens)
    p1 = dataclasses.replace(p0, tail=1)
    ptx0, ptx1 = (itf.ptx_text(msp.MLADecodeSplit(p), *msp._fake_args(p)) for p in (p0, p1))
    assert ptx1.count("mma.sync") == ptx0.count("mma.sync")
    assert ptx1.count("bar.sync") == ptx0.count("bar.sync") + 1
    assert msp.compile_plan(p1) is not None


@pytest.mark.parametrize("tp,batch", [(8, 1), (16, 1), (8, 8), (8, 32)])
def test_ll_ptx(tp, batch):
    """``DECODESCOPE_MLA_SPLIT_LL=1`` where one thread per (row, pair) merges (``uv_pairs``):
    the partials as (value, epoch) pairs (16-byte volatile stores and loads, an int32
    workspace twice as wide), the attention CTAs' fence gone (the absorption keeps its own),
    the epoch kept in the counters; elsewhere (32x1: 4 rows per W_UV item) the knob changes
    nothing."""
    p0 = msp.plan_for(get_config("kimi-k3", tp), batch, 1)
    p1 = dataclasses.replace(p0, ll=1)
    ptx0, ptx1 = (itf.ptx_text(msp.MLADecodeSplit(p), *msp._fake_args(p)) for p in (p0, p1))
    if not p0.uv_pairs:
        assert not p1.ll_parts and p1.part_words == p0.part_words and ptx1 == ptx0
        return
    assert p1.ll_parts and p1.part_words == 2 * p0.part_words
    assert ptx0.count("fence.acq_rel.gpu") == 2 and ptx1.count("fence.acq_rel.gpu") == 1
    assert "st.volatile.global.v4.b32" in ptx1 and "ld.volatile.global.v4.b32" in ptx1
    assert "volatile" not in ptx0 and ptx1.count("ld.global.cg") == 0
    assert ptx1.count("mma.sync") == ptx0.count("mma.sync")
    assert msp.compile_plan(p1) is not None
    part = msp.workspace(p1, "cpu")[1]
    assert part.dtype == torch.int32 and not bool(part.any())  # epoch 0 is never a launch's


def test_trace_summary_synthetic():
    """A synthetic trace buffer (no GPU; made up for the exact corner): the phases' marks in
    time order, the three attention items that ended last named by (sequence, group, split)."""
    p = dataclasses.replace(msp.plan_for(get_config("kimi-k3", 8), 2, 1), trace=1)
    assert not p.fused and p.groups == 1
    tr = msp.workspace(p, "cpu")[3]
    A, n_att = p.a_ctas, p.n_att
    t0 = 1_000_000
    for tk in range(p.grid):
        tr[tk, 0] = tk
        tr[tk, 1] = t0 + 10 * tk
        tr[tk, 3] = t0 + 5000 + 10 * tk
        tr[tk, 4:8] = t0 + 100
        if tk >= A:
            tr[tk, 2] = t0 + 3000
    tr[A + n_att - 1, 3] = t0 + 9000  # the last item of sequence 1 ends last
    tl = msp.trace_summary(p, "cpu")
    assert tl["att_start"].startswith(f"{A * 10 / 1e3:.1f}/")
    first = tl["att_last"].split()[0]
    assert first.startswith(f"b1g0s{p.splits - 1}@") and first.endswith("/9.0")
    assert len(tl["att_last"].split()) == 3


def test_wave_splits(monkeypatch):
    """``DECODESCOPE_MLA_SPLIT_WAVES=1`` (the default since session 39; ``=0`` the rule): the
    wave model's splits differ from the rule only at
    TP8 32x8 and TP16 64x8 (192 items per split on 132 SMs at one CTA each: 2 splits, 3 waves of
    9 + 2 blocks against 2 waves of 17 + 2), nowhere at one token; its plan compiles; a bad
    value is a one-line error."""
    points = [(b, t) for t in (8, 1) for b in (1, 8, 16, 32, 64)]
    default = {(tp, b, t): msp.plan_for(get_config("kimi-k3", tp), b, t).splits
               for tp in (8, 16) for b, t in points}  # fmt: skip
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_WAVES", "0")
    rule = {(tp, b, t): msp.plan_for(get_config("kimi-k3", tp), b, t).splits
            for tp in (8, 16) for b, t in points}  # fmt: skip
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_WAVES", "1")
    waves = {(tp, b, t): msp.plan_for(get_config("kimi-k3", tp), b, t).splits
             for tp in (8, 16) for b, t in points}  # fmt: skip
    assert {k: (rule[k], v) for k, v in waves.items() if v != rule[k]} == {
        (8, 32, 8): (1, 2),
        (16, 64, 8): (1, 2),
    }
    assert waves == default
    p = msp.plan_for(get_config("kimi-k3", 8), 32, 8)
    assert (p.splits, p.n_att, p.sms, p.ctas_per_sm) == (2, 384, 132, 1)
    assert msp.compile_plan(p) is not None
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_SPLITS", "3")  # a forced count wins
    assert msp.plan_for(get_config("kimi-k3", 8), 32, 8).splits == 3
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_WAVES", "2")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_SPLIT_WAVES: 0 or 1, got 2"):
        msp.plan_for(get_config("kimi-k3", 8), 32, 8)


def test_splits_spread_blocks():
    """Splits need not divide the 17 blocks: each split gets 1-2 (16 splits) blocks, all covered."""
    p = msp.plan_for(get_config("kimi-k3", 8), 4, 1)
    assert p.splits == 16
    S, NBA = p.splits, p.nblk_all
    spans = [((s + 1) * NBA // S) - (s * NBA // S) for s in range(S)]
    assert sum(spans) == NBA and min(spans) >= 1 and max(spans) == p.blk_max == 2


def test_knob_errors(monkeypatch):
    cfg = get_config("kimi-k3", 8)
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_SPLITS", "x")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_SPLIT_SPLITS: an integer"):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_SPLITS", "6")
    assert msp.plan_for(cfg, 8, 1).splits == 6
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_FUSE", "2")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_SPLIT_FUSE: 0 or 1"):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.delenv("DECODESCOPE_MLA_SPLIT_FUSE")
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_ACHUNKS", "3")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_SPLIT_ACHUNKS: 1, 2 or 4"):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_ACHUNKS", "4")
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_VROWS", "17")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_SPLIT_VROWS: 0-16"):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_VROWS", "4")
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_NBUF", "3")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_SPLIT_NBUF: 0, 1 or 2"):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.delenv("DECODESCOPE_MLA_SPLIT_NBUF")
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_EARLYABS", "2")
    with pytest.raises(ValueError, match="DECODESCOPE_MLA_SPLIT_EARLYABS: 0 or 1, got 2"):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.delenv("DECODESCOPE_MLA_SPLIT_EARLYABS")
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_TRACE", "2")
    with pytest.raises(
        ValueError, match="SPLIT_TRACE / _DIAG / _L2PRE / _UVFAST / _TAIL / _LL: 0 or 1 "
    ):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.delenv("DECODESCOPE_MLA_SPLIT_TRACE")
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_L2PRE", "2")
    with pytest.raises(ValueError, match="_TAIL auto\\), got 0 / 0 / 2 / 1 / auto / 0"):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.delenv("DECODESCOPE_MLA_SPLIT_L2PRE")
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_UVFAST", "3")
    with pytest.raises(ValueError, match="got 0 / 0 / 0 / 3 / auto / 0"):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_UVFAST", "2")
    assert msp.plan_for(cfg, 8, 1).uvfast == 2
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_UVFAST", "0")
    assert msp.plan_for(cfg, 8, 1).uvfast == 0
    monkeypatch.delenv("DECODESCOPE_MLA_SPLIT_UVFAST")
    assert msp.plan_for(cfg, 8, 1).uvfast == 1  # the default since session 16
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_TAIL", "2")
    with pytest.raises(ValueError, match="got 0 / 0 / 0 / 1 / 2 / 0"):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_TAIL", "often")
    with pytest.raises(
        ValueError, match="DECODESCOPE_MLA_SPLIT_TAIL='often': expected 0, 1 or auto"
    ):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.delenv("DECODESCOPE_MLA_SPLIT_TAIL")
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_LL", "3")
    with pytest.raises(ValueError, match="got 0 / 0 / 0 / 1 / auto / 3"):
        msp.plan_for(cfg, 8, 1)
    monkeypatch.delenv("DECODESCOPE_MLA_SPLIT_LL")
    with pytest.raises(ValueError, match="1..16 tokens per sequence, got 17"):
        dataclasses.replace(msp.plan_for(cfg, 8, 1), tokens=17)


def test_kernel_choice():
    """The default for a BF16 cache with one token per sequence where the plan fits (H200
    s10/r2); several tokens (verify steps) in head groups at TP8 / TP16 (s15), tc at TP2;
    shapes the split kernel refuses (kimi-k3 TP2: 48 heads; the tiny preset's dimensions) as
    before; FP8 on simt."""
    k3 = get_config("kimi-k3", 8)
    for b in (1, 8, 32, 64):
        assert mla.kernel_choice(torch.bfloat16, "", b, 1, k3) == "split"
    assert mla.kernel_choice(torch.bfloat16, "", 8, 1, get_config("kimi-k3", 16)) == "split"
    assert mla.kernel_choice(torch.bfloat16, "", 1, 8, k3) == "split"  # head groups (s15)
    assert mla.kernel_choice(torch.bfloat16, "", 8, 8, k3) == "split"
    assert mla.kernel_choice(torch.bfloat16, "", 1, 8, get_config("kimi-k3", 16)) == "split"
    assert mla.kernel_choice(torch.bfloat16, "", 8, 1, get_config("kimi-k3", 2)) == "simt"
    assert mla.kernel_choice(torch.bfloat16, "", 1, 8, get_config("kimi-k3", 2)) == "tc"
    assert mla.kernel_choice(torch.bfloat16, "", 1, 17, k3) == "tc"  # past 16 MMA rows
    k3tp2 = get_config("kimi-k3", 2)  # 48 heads: three groups, so not the default there
    assert not mla.split_fits(k3tp2, 8, 1, one_group=True) and mla.split_fits(k3tp2, 8, 1)
    assert mla.split_fits(k3, 1, 8) and not mla.split_fits(k3, 1, 8, one_group=True)
    assert mla.kernel_choice(torch.bfloat16, "", 64, 1, get_config("kimi-k3", 2)) == "tc"
    assert mla.kernel_choice(torch.bfloat16, "", 2, 1, get_config("tiny", 1)) == "simt"
    assert mla.kernel_choice(torch.bfloat16, "", 8, 1) == "split"  # no cfg: assumed to fit
    assert mla.kernel_choice(torch.bfloat16, "tc", 8, 1, k3) == "tc"
    assert mla.kernel_choice(torch.bfloat16, "simt", 8, 1, k3) == "simt"
    assert mla.kernel_choice(torch.float8_e4m3fn, "", 8, 1, k3) == "simt"
    with pytest.raises(NotImplementedError, match="mla_decode_split: BF16 latent cache only"):
        mla.kernel_choice(torch.float8_e4m3fn, "split", 8, 1)


def test_kernel_choice_env(monkeypatch):
    monkeypatch.setenv("DECODESCOPE_MLA_KERNEL", "split")
    assert mla.kernel_choice(torch.bfloat16, "", 32, 1) == "split"
    monkeypatch.setenv("DECODESCOPE_MLA_KERNEL", "splt")
    with pytest.raises(ValueError, match="one of"):
        mla.kernel_choice(torch.bfloat16, "", 32, 1)


# -- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tp,batch,knobs",
    [(8, 1, {}), (8, 8, {}), (8, 32, {}), (8, 64, {}), (16, 8, {}), (16, 2, {}),
     (8, 8, {"DECODESCOPE_MLA_SPLIT_SPLITS": "8", "DECODESCOPE_MLA_SPLIT_NBUF": "1"}),
     (8, 8, {"DECODESCOPE_MLA_SPLIT_SPLITS": "4", "DECODESCOPE_MLA_SPLIT_ACHUNKS": "1",
             "DECODESCOPE_MLA_SPLIT_VROWS": "8"}),
     (8, 32, {"DECODESCOPE_MLA_SPLIT_ACHUNKS": "4", "DECODESCOPE_MLA_SPLIT_VROWS": "1"}),
     (8, 8, {"DECODESCOPE_MLA_SPLIT_TRACE": "1"}),
     (8, 32, {"DECODESCOPE_MLA_SPLIT_FUSE": "1", "DECODESCOPE_MLA_SPLIT_TRACE": "1"}),
     (8, 8, {"DECODESCOPE_MLA_SPLIT_FUSE": "1", "DECODESCOPE_MLA_SPLIT_SPLITS": "8",
             "DECODESCOPE_MLA_SPLIT_NBUF": "1"}),
     (8, 1, {"DECODESCOPE_MLA_SPLIT_L2PRE": "1"}), (16, 1, {"DECODESCOPE_MLA_SPLIT_L2PRE": "1"}),
     (8, 32, {"DECODESCOPE_MLA_SPLIT_L2PRE": "1"}),
     (8, 1, {"DECODESCOPE_MLA_SPLIT_UVFAST": "1"}), (16, 1, {"DECODESCOPE_MLA_SPLIT_UVFAST": "1"}),
     (8, 8, {"DECODESCOPE_MLA_SPLIT_UVFAST": "1"}), (8, 32, {"DECODESCOPE_MLA_SPLIT_UVFAST": "1"}),
     (8, 64, {"DECODESCOPE_MLA_SPLIT_UVFAST": "1", "DECODESCOPE_MLA_SPLIT_TRACE": "1"}),
     (8, 1, {"DECODESCOPE_MLA_SPLIT_UVFAST": "0"}), (8, 8, {"DECODESCOPE_MLA_SPLIT_UVFAST": "0"}),
     (8, 1, {"DECODESCOPE_MLA_SPLIT_TAIL": "1"}), (16, 1, {"DECODESCOPE_MLA_SPLIT_TAIL": "1"}),
     (8, 8, {"DECODESCOPE_MLA_SPLIT_TAIL": "1"}), (16, 8, {"DECODESCOPE_MLA_SPLIT_TAIL": "1"}),
     (8, 32, {"DECODESCOPE_MLA_SPLIT_TAIL": "1"}),
     (8, 64, {"DECODESCOPE_MLA_SPLIT_TAIL": "1", "DECODESCOPE_MLA_SPLIT_TRACE": "1"}),
     (8, 8, {"DECODESCOPE_MLA_SPLIT_TAIL": "1", "DECODESCOPE_MLA_SPLIT_SPLITS": "8"}),
     (8, 1, {"DECODESCOPE_MLA_SPLIT_LL": "1"}), (16, 1, {"DECODESCOPE_MLA_SPLIT_LL": "1"}),
     (8, 2, {"DECODESCOPE_MLA_SPLIT_LL": "1"}), (16, 8, {"DECODESCOPE_MLA_SPLIT_LL": "1"}),
     (8, 8, {"DECODESCOPE_MLA_SPLIT_LL": "1", "DECODESCOPE_MLA_SPLIT_TAIL": "1",
             "DECODESCOPE_MLA_SPLIT_TRACE": "1"}),
     (8, 1, {"DECODESCOPE_MLA_SPLIT_LL": "1", "DECODESCOPE_MLA_SPLIT_TRACE": "1"})],
)  # fmt: skip
def test_gpu_vs_reference(tp, batch, knobs, monkeypatch):
    _gpu_check(tp, batch, 1, knobs, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,batch,trace", [(8, 1, 0), (8, 2, 0), (16, 1, 0), (16, 8, 0),
                                            (8, 1, 1)])  # fmt: skip
def test_gpu_earlyabs(tp, batch, trace, monkeypatch):
    """``EARLYABS=1`` (the absorption CTAs by block index, ``w_uk`` staged before the wait)
    against the reference, eager and graph; with the trace, every CTA's row."""
    knobs = {"DECODESCOPE_MLA_SPLIT_EARLYABS": "1", "DECODESCOPE_MLA_SPLIT_TRACE": str(trace)}
    _gpu_check(tp, batch, 1, knobs, monkeypatch)
    assert msp.plan_for(get_config("kimi-k3", tp), batch, 1).early_abs


@pytest.mark.gpu
@pytest.mark.parametrize("knobs", [{}, {"DECODESCOPE_MLA_SPLIT_EARLYABS": "1"}])
def test_gpu_back_to_back(knobs, monkeypatch):
    """The kernel following itself with nothing between (20 eager launches, then a graph of 8):
    under programmatic dependent launch each launch starts while the one before runs, so
    whatever a launch does before its wait must not touch what the one before still uses (a
    ticket taken before the wait did, s14/r2). Same output every time, error word 0."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_mla_decode_tc import _inputs

    for k, v in knobs.items():
        monkeypatch.setenv(k, v)
    cfg = get_config("kimi-k3", 8)
    plan = msp.plan_for(cfg, 1, 1)
    w, cache0, a, q, g = _inputs(cfg, 1, 1, 201)
    ref, _ = mla.mla_decode_ref(cfg, w, a, q, g, cache0, 1)
    cache, out = cache0.clone(), torch.full_like(ref, float("nan"))
    for _ in range(20):
        msp.mla_decode_split(cfg, w, a, q, g, cache, out, 1)
    torch.cuda.synchronize()
    assert msp.error_word(plan, out.device) == 0 and rel_l2(out, ref) < 2e-2
    out_g = torch.full_like(out, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(8):
            msp.mla_decode_split(cfg, w, a, q, g, cache, out_g, 1)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert msp.error_word(plan, out.device) == 0 and rel_l2(out_g, out) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("tp,batch,tokens", [(8, 1, 8), (8, 8, 8), (8, 2, 2), (16, 1, 8),
                                             (16, 1, 2)])  # fmt: skip
def test_gpu_head_groups(tp, batch, tokens, monkeypatch):
    """The verify step on the split kernel (head groups from 2 tokens at TP8, 8 at TP16),
    causal over the new rows, against the same reference."""
    _gpu_check(tp, batch, tokens, {"DECODESCOPE_MLA_SPLIT_TRACE": "1"}, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,batch,tokens", [(8, 1, 8), (8, 8, 8), (16, 1, 8)])
def test_gpu_head_groups_uvfast(tp, batch, tokens, monkeypatch):
    """The head groups' merge (partials per group) with ``UVFAST=1``."""
    _gpu_check(tp, batch, tokens, {"DECODESCOPE_MLA_SPLIT_UVFAST": "1"}, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,batch,tokens", [(8, 1, 8), (8, 8, 8), (16, 8, 8), (8, 2, 2)])
def test_gpu_head_groups_tail(tp, batch, tokens, monkeypatch):
    """The tail (the block of the 2-8 new rows, causal among them) on the split with the
    fewest cached blocks, filled before the wait."""
    _gpu_check(tp, batch, tokens, {"DECODESCOPE_MLA_SPLIT_TAIL": "1"}, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,batch", [(8, 32), (16, 64)])
def test_gpu_waves(tp, batch, monkeypatch):
    """``DECODESCOPE_MLA_SPLIT_WAVES=1`` at the two verify points where it picks 2 splits."""
    _gpu_check(tp, batch, 8, {"DECODESCOPE_MLA_SPLIT_WAVES": "1"}, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,batch", [(8, 32), (16, 64), (8, 1)])
def test_gpu_strided_a_g(tp, batch):
    """``DECODESCOPE_WIDE_AG``: ``a`` and ``g`` as column slices of one ``[rows, a + g]`` buffer
    (``MLASplitPlan.lda`` / ``ldg``): the same outputs and cache rows, bit for bit, as from
    compact ``a`` and ``g``; the reference holds."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_mla_decode_tc import _inputs

    T = 8
    cfg = get_config("kimi-k3", tp)
    w, cache0, a, q, g = _inputs(cfg, batch, T, 400 + batch)
    na = a.shape[1]
    ag = torch.full((a.shape[0], na + g.shape[1]), float("nan"), dtype=a.dtype, device=a.device)
    ag[:, :na], ag[:, na:] = a, g
    outs, caches = [], []
    for aa, gg in ((a, g), (ag[:, :na], ag[:, na:])):
        out = torch.full((a.shape[0], cfg.mla_v_dim), float("nan"), dtype=a.dtype, device=a.device)
        cache = cache0.clone()
        msp.mla_decode_split(cfg, w, aa, q, gg, cache, out, T)
        torch.cuda.synchronize()
        outs.append(out)
        caches.append(cache)
    plan = dataclasses.replace(msp.plan_for(cfg, batch, T), lda=na + g.shape[1],
                               ldg=na + g.shape[1])  # fmt: skip
    assert msp.error_word(plan, a.device) == 0
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0], caches[1])
    ref, _ = mla.mla_decode_ref(cfg, w, a, q, g, cache0, T)
    assert rel_l2(outs[1], ref) < 2e-2


def _gpu_check(tp, batch, T, knobs, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_mla_decode_tc import _inputs

    for k, v in knobs.items():
        monkeypatch.setenv(k, v)
    cfg = get_config("kimi-k3", tp)
    plan = msp.plan_for(cfg, batch, T)
    w, cache0, a, q, g = _inputs(cfg, batch, T, 200 + batch)
    ctx = cfg.context_len
    ref, rcache = mla.mla_decode_ref(cfg, w, a, q, g, cache0, T)
    out = torch.empty_like(ref)
    cache = cache0.clone()
    for _ in range(3):
        out.fill_(float("nan"))
        cache[:, ctx:].fill_(float("nan"))
        msp.mla_decode_split(cfg, w, a, q, g, cache, out, T)
        torch.cuda.synchronize()
        assert msp.error_word(plan, out.device) == 0
        assert bool(torch.isfinite(out).all())
        assert rel_l2(out, ref) < 2e-2
        assert rel_l2(cache[:, ctx:], rcache[:, ctx:]) < 1e-2
        assert torch.equal(cache[:, :ctx], cache0[:, :ctx])
    if plan.trace:  # every CTA wrote its row; waits end after the phase before them started
        tl = msp.trace_summary(plan, out.device)
        assert tl["span_us"] > 0 and "att_waited" in tl and "uv_end" in tl
        want = {"att_q_lat", "att_keys", "att_partials", "uv_weights", "uv_o_lat", "att_last"}
        if plan.uvfast and plan.uv_pairs:  # the merge weights never pass shared memory
            want.discard("uv_weights")
        assert want <= set(tl)
    out_g = torch.full_like(out, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        msp.mla_decode_split(cfg, w, a, q, g, cache, out_g, T)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert msp.error_word(plan, out.device) == 0
    assert rel_l2(out_g, out) < 1e-6


@pytest.mark.parametrize("tail_env", ["", "auto"])
def test_tail_auto(tail_env, monkeypatch):
    """``DECODESCOPE_MLA_SPLIT_TAIL`` unset / auto: the tail placement only where it buys the
    extra split within one wave (of the TP8 / TP16 points at 1 / 8 / 32 / 64 sequences and 1 /
    8 tokens, TP16 8x1 alone: 9 splits, 132 CTAs; H200 s17/r1 in the layer, decode share 16.9
    -> 15.3 us); 0 / 1 force it."""
    if tail_env:
        monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_TAIL", tail_env)
    on = []
    for tp in (8, 16):
        cfg = get_config("kimi-k3", tp)
        for b in (1, 8, 32, 64):
            for t in (1, 8):
                p = msp.plan_for(cfg, b, t)
                assert p.tail in (0, 1)
                if p.tail:
                    on.append((tp, b, t, p.splits, p.grid))
    assert on == [(16, 8, 1, 9, 132)]
    cfg = get_config("kimi-k3", 16)
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_TAIL", "0")
    assert msp.plan_for(cfg, 8, 1).tail == 0 and msp.plan_for(cfg, 8, 1).splits == 8
    monkeypatch.setenv("DECODESCOPE_MLA_SPLIT_TAIL", "1")
    assert msp.plan_for(cfg, 1, 1).tail == 1


def _spread_q_a(a: torch.Tensor, q_lora: int, gen: torch.Generator) -> torch.Tensor:
    """``a`` with each row's q_a columns scaled by its own factor in [e^-1.4, e^1.4], so that
    every token's rstd differs and a scale on the wrong row shows."""
    f = torch.exp((torch.rand(a.shape[0], 1, generator=gen, device=gen.device) * 2 - 1) * 1.4)
    out = a.float()
    out[:, :q_lora] *= f
    return out.to(a.dtype)


def _shifted_rows(a: torch.Tensor, T: int, q_lora: int, seq: bool) -> torch.Tensor:
    """``a`` whose q_a rows are those of the next token of the same sequence (``seq`` False)
    or of the same token of the next sequence: the reference with them is what a kernel
    scaling each row by another row's rstd would give."""
    n = torch.arange(a.shape[0], device=a.device)
    B = a.shape[0] // T
    idx = (n // T) * T + (n % T + 1) % T if not seq else ((n // T + 1) % B) * T + n % T
    out = a.clone()
    out[:, :q_lora] = a[idx, :q_lora]
    return out


@pytest.mark.parametrize("tp,batch,tokens", [(8, 32, 8), (16, 64, 8), (8, 6, 3)])
def test_qnorm_compiles_and_adds_only_the_rstd(tp, batch, tokens):
    """``qnorm`` (``DECODESCOPE_WIDE_QNORM``): the plan compiles for sm_90a at the verify steps
    past 64 tokens (and at 3 tokens per sequence, where a thread's two score rows are two
    tokens); its PTX adds one ``rsqrt`` (the q_a rstd), one warp reduction (5 shuffles) and the
    four score scalings over the plan without it, which stays as it was."""
    p0 = msp.plan_for(get_config("kimi-k3", tp), batch, tokens)
    p1 = dataclasses.replace(p0, qnorm=1)
    x0 = itf.ptx_text(msp.MLADecodeSplit(p0), *msp._fake_args(p0))
    x1 = itf.ptx_text(msp.MLADecodeSplit(p1), *msp._fake_args(p1))
    assert x1.count("rsqrt") == x0.count("rsqrt") + 1
    assert x1.count("shfl.sync") == x0.count("shfl.sync") + 5
    assert x1.count("mul.f32") == x0.count("mul.f32") + 4
    with pytest.raises(ValueError, match="qnorm 0 or 1"):
        dataclasses.replace(p0, qnorm=2)


def test_qnorm_reference_is_the_normalized_q():
    """The algebra the ``qnorm`` kernel rests on, in the FP32 reference on the CPU (TP16, two
    sequences of 1+7 tokens, random weights, each row's q_a at its own scale): q_b on the raw
    ``q_a`` with the norm weight folded in, the scores times each row's ``q_a`` rstd
    (``q_raw``), gives the output of q_b on the normalized ``q_a``, within BF16 rounding;
    without the rstd, or with another row's (the next token's, the next sequence's), it does
    not. ``mla_decode`` refuses ``q_raw`` for a kernel other than the split one."""
    from decodescope.kernels.specialized.tile_gemm import fold_norm_weight
    from decodescope.kernels.weights import make_state

    cfg = get_config("kimi-k3", 16)
    m, nh, B, T = cfg.mla, cfg.mla_heads, 2, 8
    g = torch.Generator().manual_seed(5)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    s = m.kv_lora_rank**-0.5
    w = {"kv_a_norm": (1 + 0.1 * torch.randn(m.kv_lora_rank, generator=g)).to(torch.bfloat16),
         "w_uk": rnd(nh, m.qk_nope_head_dim, m.kv_lora_rank, std=s),
         "w_uv": rnd(nh, m.kv_lora_rank, m.v_head_dim, std=s),
         "q_a_norm": (1 + 0.1 * torch.randn(m.q_lora_rank, generator=g)).to(torch.bfloat16),
         "q_b": rnd(cfg.mla_q_b_out, m.q_lora_rank, std=m.q_lora_rank**-0.5)}  # fmt: skip
    cache = make_state(cfg, LayerSpec(7, "mla", "moe"), B, T, seed=5)["kv_cache"]
    a = _spread_q_a(rnd(B * T, cfg.mla_qkv_a_out), m.q_lora_rank, g)
    gate = rnd(B * T, cfg.mla_v_dim)
    q_a = a[:, : m.q_lora_rank].float()
    q_a_n = (q_a * torch.rsqrt(q_a.pow(2).mean(-1, keepdim=True) + cfg.eps)).to(torch.bfloat16)
    q_n = ((q_a_n.float() * w["q_a_norm"].float()) @ w["q_b"].float().t()).to(torch.bfloat16)
    q_raw = (q_a @ fold_norm_weight(w["q_b"], w["q_a_norm"]).float().t()).to(torch.bfloat16)
    want, c1 = mla.mla_decode_ref(cfg, w, a, q_n, gate, cache, T)
    got, c2 = mla.mla_decode_ref(cfg, w, a, q_raw, gate, cache, T, q_raw=True)
    assert rel_l2(got, want) < 2e-2 and torch.equal(c1, c2)
    unscaled, _ = mla.mla_decode_ref(cfg, w, a, q_raw, gate, cache, T)
    assert rel_l2(unscaled, want) > 0.2
    for seq in (False, True):
        other = _shifted_rows(a, T, m.q_lora_rank, seq)
        wrong, _ = mla.mla_decode_ref(cfg, w, other, q_raw, gate, cache, T, q_raw=True)
        assert rel_l2(wrong, want) > 0.2
    with pytest.raises(ValueError, match="q_raw needs the split kernel"):
        mla.mla_decode(cfg, w, a, q_raw, gate, cache.clone(), torch.empty_like(want), T,
                       kernel="tc", q_raw=True)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("tp,batch,tokens,strided", [(8, 32, 8, True), (16, 64, 8, True),
                                                     (8, 8, 8, False), (8, 6, 3, False),
                                                     (16, 4, 5, True)])  # fmt: skip
def test_gpu_qnorm(tp, batch, tokens, strided):
    """``qnorm`` on the H200: the kernel with ``q_raw`` against the reference with ``q_raw``,
    each row's q_a at its own scale (a scale on another token's or sequence's row would be
    off by more than 0.2, checked on the reference first), poisoned outputs, three launches and
    a CUDA graph replay; the error word stays 0. ``strided``: ``a`` and ``g`` as column slices
    of one ``[rows, a + g]`` buffer (``DECODESCOPE_WIDE_AG``, the default layout); 3 and 5
    tokens: a thread's two score rows are two tokens, and the padding rows are there."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from test_mla_decode_tc import _inputs

    T = tokens
    cfg = get_config("kimi-k3", tp)
    w, cache0, a, q, g = _inputs(cfg, batch, T, 500 + batch)
    gen = torch.Generator(device="cuda").manual_seed(600 + batch)
    a = _spread_q_a(a, cfg.mla.q_lora_rank, gen)
    ctx = cfg.context_len
    ref, rcache = mla.mla_decode_ref(cfg, w, a, q, g, cache0, T, q_raw=True)
    plain, _ = mla.mla_decode_ref(cfg, w, a, q, g, cache0, T)
    assert rel_l2(plain, ref) > 0.2  # the rstd changes the result
    for seq in (False, True) if batch > 1 else (False,):
        other = _shifted_rows(a, T, cfg.mla.q_lora_rank, seq)
        wrong, _ = mla.mla_decode_ref(cfg, w, other, q, g, cache0, T, q_raw=True)
        assert rel_l2(wrong, ref) > 0.2  # another row's rstd would show
    if strided:
        na = a.shape[1]
        ag = torch.full((a.shape[0], na + g.shape[1]), float("nan"), dtype=a.dtype,
                        device=a.device)  # fmt: skip
        ag[:, :na], ag[:, na:] = a, g
        a, g = ag[:, :na], ag[:, na:]
    plan = msp.plan_for(cfg, batch, T)
    if strided:
        plan = dataclasses.replace(plan, lda=a.stride(0), ldg=g.stride(0))
    plan = dataclasses.replace(plan, qnorm=1)
    out = torch.empty_like(ref)
    cache = cache0.clone()
    for _ in range(3):
        out.fill_(float("nan"))
        cache[:, ctx:].fill_(float("nan"))
        msp.mla_decode_split(cfg, w, a, q, g, cache, out, T, q_raw=True)
        torch.cuda.synchronize()
        assert msp.error_word(plan, out.device) == 0
        assert bool(torch.isfinite(out).all()) and rel_l2(out, ref) < 2e-2
        assert rel_l2(cache[:, ctx:], rcache[:, ctx:]) < 1e-2
    out_g = torch.full_like(out, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        msp.mla_decode_split(cfg, w, a, q, g, cache, out_g, T, q_raw=True)
    graph.replay()
    torch.cuda.synchronize()
    assert msp.error_word(plan, out.device) == 0 and rel_l2(out_g, out) < 1e-6
