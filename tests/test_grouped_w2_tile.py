"""The tile w2 kernel (``kernels/specialized/grouped_w2_tile.py``, ``DECODESCOPE_MOE_GROUPED_W2=
tile``).

CPU: it compiles for sm_90a at the kimi-k3 TP8 and TP16 shapes (8 / 32 / 64 tokens), at the
knob settings the H200 sweep uses and at the tiny presets; the knobs' environment parsing and
errors; a Python replay of the kernel's data movement (its own ``piece`` / ``swizzle`` /
``read_unit`` index functions, the ``mma.sync.m16n8k16`` fragment layout, NaN in every
shared-memory slot it does not write) equals ``w2[e] @ h`` per item; a replay of the item
loops shows every (pair, latent row) product and every shared output produced exactly once;
``moe_grouped`` routes ``tile`` to this kernel with the knobs in the compile key. GPU
(``-m gpu``): the block's checks of ``scripts/gpu_specialized_moe.py`` with the tile w2.
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# the package's interface module first: it sets CUTE_DSL_ARCH (sm_90a) before cutlass loads
pytest.importorskip("decodescope.kernels.specialized.interface")

from decodescope.kernels.config import LayerSpec, get_config  # noqa: E402
from decodescope.kernels.specialized import grouped_w2_tile as gt  # noqa: E402
from decodescope.kernels.specialized import interface as itf  # noqa: E402
from decodescope.kernels.specialized import moe_grouped as mg  # noqa: E402


def _kv_id(v):
    """Test ids that name the knobs (``order-col``), so that ``-k`` can pick them."""
    if isinstance(v, dict):
        return "_".join(f"{k}-{x}" for k, x in v.items()) or "defaults"
    return None


def _dims(preset: str, tp: int):
    cfg = get_config(preset, tp)
    e = cfg.moe
    return (e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter, cfg.hidden,
            cfg.shared_inter)  # fmt: skip


@pytest.mark.parametrize(
    "preset,tp,T,kv",
    [
        ("kimi-k3", 8, 8, {}),
        ("kimi-k3", 8, 32, {}),
        ("kimi-k3", 8, 64, {}),
        ("kimi-k3", 16, 8, {}),
        ("kimi-k3", 16, 32, {}),
        ("kimi-k3", 16, 64, {}),
        ("kimi-k3", 8, 64, {"rt": 2}),
        ("kimi-k3", 8, 64, {"warps": 2}),
        ("kimi-k3", 8, 64, {"mt": 2}),
        ("kimi-k3", 8, 64, {"bk": 64, "stages": 3}),
        ("kimi-k3", 8, 64, {"stages": 2}),
        ("kimi-k3", 8, 64, {"warps": 8, "cap": 512}),
        ("kimi-k3", 8, 64, {"order": "block"}),
        ("kimi-k3", 8, 64, {"order": "block", "load": "bulk"}),
        ("kimi-k3", 8, 64, {"snj": 2, "shared": "regs"}),
        ("kimi-k3", 8, 64, {"snj": 4, "shared": "regs"}),
        ("kimi-k3", 16, 32, {"snj": 4, "shared": "regs"}),
        ("kimi-k3", 8, 64, {"order": "stride", "shared": "regs"}),  # the defaults before s10
        ("kimi-k3", 16, 64, {"order": "stride", "shared": "regs"}),
        ("kimi-k3", 8, 1, {}),
        ("kimi-k3", 16, 1, {}),
        ("kimi-k3", 8, 8, {"order": "col"}),
        ("kimi-k3", 8, 64, {"order": "col"}),
        ("kimi-k3", 16, 32, {"order": "col"}),
        ("kimi-k3", 16, 64, {"order": "col"}),
        ("kimi-k3", 8, 32, {"order": "col", "early": 1}),
        ("kimi-k3", 8, 64, {"order": "col", "early": 1}),
        ("kimi-k3", 16, 64, {"order": "col", "early": 1}),
        ("tiny", 1, 5, {"order": "col", "early": 1}),
        ("kimi-k3", 8, 64, {"order": "col", "early": 1, "cap": 64}),  # capped: CTAs loop
        ("kimi-k3", 8, 8, {"shared": "tile"}),
        ("kimi-k3", 8, 32, {"shared": "tile", "order": "col"}),
        ("kimi-k3", 8, 64, {"shared": "tile", "order": "col", "early": 1}),
        ("kimi-k3", 8, 64, {"shared": "spread", "order": "col", "early": 1}),
        ("kimi-k3", 16, 32, {"shared": "spread", "order": "col"}),
        ("kimi-k3", 16, 64, {"shared": "tile", "order": "col", "early": 1}),
        ("tiny", 2, 8, {"shared": "tile"}),
        ("tiny", 1, 5, {}),
        ("tiny", 2, 8, {}),
        ("kimi-k3", 8, 8, {"load": "bulk"}),
        ("kimi-k3", 8, 64, {"load": "bulk"}),
        ("kimi-k3", 16, 64, {"load": "bulk"}),
        ("kimi-k3", 8, 64, {"load": "bulk", "warps": 2, "stages": 4}),
        ("kimi-k3", 8, 32, {"load": "bulk", "mt": 2, "rt": 2}),
        ("tiny", 2, 3, {"load": "bulk"}),
    ],
    ids=_kv_id,
)
def test_compiles(preset, tp, T, kv):
    E, K, L, Ie, H, S = _dims(preset, tp)
    op, args = gt.build(T, E, K, L, Ie, H, S, True, 132, gt.TileKnobs(**kv))
    assert op.smem <= gt.SMEM_MAX and op.nbuf <= op.stages
    assert itf.compile_only(op, *args) is not None


def test_geometry_tp8():
    """TP8 defaults: 64 rows x 128 K per stage, all 3 chunks of an item in flight (3 buffers,
    54 KB: 4 CTAs per SM), 56 items per expert, 56 shared CTAs first, the routed grid the worst
    case itself (one item per CTA)."""
    E, K, L, Ie, H, S = _dims("kimi-k3", 8)
    op = gt.GroupedW2Tile(64, E, K, L, Ie, H, S)
    assert (op.R, op.BK, op.NCH, op.stages, op.nbuf, op.MP) == (64, 128, 3, 4, 3, 8)
    assert op.smem == 3 * 72 * 128 * 2 and 4 * (op.smem + 256 + 1024) <= 228 * 1024
    assert (op.CE, op.nr) == (56, 896 * 56)
    # the defaults since s10/r2: col order, the shared expert as 64-row x 8-token tiles, early
    assert (op.order, op.shared, op.early, op.CS) == ("col", "tile", True, 7168 // 64 * 8)
    old = gt.GroupedW2Tile(64, E, K, L, Ie, H, S, kn=gt.TileKnobs(order="stride", shared="regs"))
    assert (old.order, old.shared, old.early, old.CS) == ("stride", "regs", False, 56)
    bulk = gt.GroupedW2Tile(64, E, K, L, Ie, H, S, kn=gt.TileKnobs(load="bulk"))
    assert (bulk.order, bulk.shared, bulk.early) == ("stride", "regs", False)  # auto
    assert gt.GroupedW2Tile(64, E, K, L, Ie, H, S, kn=gt.TileKnobs(cap=64)).nr == 64 * 132
    assert gt.GroupedW2Tile(8, E, K, L, Ie, H, S).nr == 128 * 56
    one = gt.GroupedW2Tile(64, E, K, L, Ie, H, S, kn=gt.TileKnobs(cap=512))
    assert one.nr == 896 * 56  # the worst case itself: one item per CTA
    t16 = gt.GroupedW2Tile(64, *_dims("kimi-k3", 16))
    assert (t16.BK, t16.NCH, t16.nbuf) == (64, 3, 3)


def test_knobs_env(monkeypatch):
    for v in gt._ENV.values():
        monkeypatch.delenv(v[0], raising=False)
    assert gt.knobs() == gt.TileKnobs()
    # unset mt, by the launch's tokens: two token tiles per pass above 256 (the 64x8 verify
    # step's experts), one up to it
    assert gt.knobs(256) == gt.knobs(64) == gt.TileKnobs()
    assert gt.knobs(257) == gt.knobs(512) == gt.TileKnobs(mt=2)
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_MT", "1")
    assert gt.knobs(512) == gt.TileKnobs()  # the knob wins
    monkeypatch.delenv("DECODESCOPE_MOE_W2T_MT")
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_RT", "2")
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_STAGES", "3")
    assert gt.knobs() == gt.TileKnobs(rt=2, stages=3)
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_LOAD", "bulk")
    assert gt.knobs().load == "bulk"
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_LOAD", "tma")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_W2T_LOAD"):
        gt.knobs()
    monkeypatch.delenv("DECODESCOPE_MOE_W2T_LOAD")
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_ORDER", "block")
    assert gt.knobs().order == "block"
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_ORDER", "col")
    assert gt.knobs().order == "col"
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_ORDER", "random")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_W2T_ORDER"):
        gt.knobs()
    monkeypatch.delenv("DECODESCOPE_MOE_W2T_ORDER")
    for var, bad in (("DECODESCOPE_MOE_W2T_RT", "3"), ("DECODESCOPE_MOE_W2T_BK", "x"),
                     ("DECODESCOPE_MOE_W2T_STAGES", "9"), ("DECODESCOPE_MOE_W2T_CAP", "0")):  # fmt: skip
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=var):
            gt.knobs()
        monkeypatch.delenv(var)
    E, K, L, Ie, H, S = _dims("kimi-k3", 8)
    with pytest.raises(ValueError, match="K chunk"):
        gt.GroupedW2Tile(8, E, K, L, Ie, H, S, kn=gt.TileKnobs(bk=256))  # 384 % 256
    with pytest.raises(ValueError, match="shared memory"):
        gt.GroupedW2Tile(8, E, K, L, Ie, H, S, kn=gt.TileKnobs(warps=8, rt=4, stages=4))
    with pytest.raises(ValueError, match="expert_inter"):
        gt.GroupedW2Tile(8, E, K, L, 40, H, S)
    with pytest.raises(ValueError, match="order 'col'"):
        gt.GroupedW2Tile(8, E, K, L, Ie, H, S, kn=gt.TileKnobs(order="col", load="bulk"))
    with pytest.raises(ValueError, match="early needs"):
        gt.GroupedW2Tile(8, E, K, L, Ie, H, S, kn=gt.TileKnobs(order="stride", early=1))
    with pytest.raises(ValueError, match="shared 'tile'"):
        gt.GroupedW2Tile(8, E, K, L, Ie, H, S, kn=gt.TileKnobs(shared="spread", load="bulk"))
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_SHARED", "tile")
    assert gt.knobs().shared == "tile"
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_SHARED", "smem")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_W2T_SHARED"):
        gt.knobs()
    monkeypatch.delenv("DECODESCOPE_MOE_W2T_SHARED")
    with pytest.raises(ValueError, match="shared 'tile'"):
        gt.GroupedW2Tile(8, E, K, L, Ie, H, S, kn=gt.TileKnobs(shared="tile", load="bulk"))
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_EARLY", "1")
    assert gt.knobs().early == 1
    monkeypatch.delenv("DECODESCOPE_MOE_W2T_EARLY")


# -- the kernel's data movement and MMAs replayed in Python ---------------------------------


def _set_a(lo, hi, s):
    """``mma_common.set_a``: the A fragment of K half ``s``."""
    return [lo[4 * s], lo[4 * s + 1], hi[4 * s], hi[4 * s + 1], lo[4 * s + 2], lo[4 * s + 3],
            hi[4 * s + 2], hi[4 * s + 3]]  # fmt: skip


def _mma(frags_a, frags_b):
    """m16n8k16 from the 32 lanes' fragments (PTX ISA layout): returns D [16, 8]."""
    A = torch.zeros(16, 16, dtype=torch.float64)
    B = torch.zeros(16, 8, dtype=torch.float64)
    for lane in range(32):
        g, c = lane // 4, lane % 4
        a, b = frags_a[lane], frags_b[lane]
        A[g, 2 * c], A[g, 2 * c + 1], A[g + 8, 2 * c], A[g + 8, 2 * c + 1] = a[0:4]
        A[g, 2 * c + 8], A[g, 2 * c + 9], A[g + 8, 2 * c + 8], A[g + 8, 2 * c + 9] = a[4:8]
        B[2 * c, g], B[2 * c + 1, g], B[2 * c + 8, g], B[2 * c + 9, g] = b
    return A @ B


def _replay_pass(op, W, Hr, row0, np_, nch=None):
    """One pass of an item as the kernel moves it: returns the [R, np_] products the lanes'
    epilogue would add (row offset from ``row0``, token slot). ``nch``: K chunks (a shared
    item's ``NCHS``; rows of ``W`` past ``op.L`` are then loaded too: every block is full)."""
    R, U, NT, MP, RT, MT = op.R, op.U, op.NT, op.MP, op.RT, op.MT
    lim = op.L if nch is None else W.shape[0]
    accs = {}  # (warp, lane, acc index) -> 4 values
    for kc in range(nch or op.NCH):
        sw = torch.full((R, U, 8), float("nan"), dtype=torch.float64)
        sx = torch.full((MP, U, 8), float("nan"), dtype=torch.float64)
        if op.bulk:  # one copy per row: its units in order, the padding never read
            for r in range(R):
                if row0 + r < op.L:
                    sw[r] = W[row0 + r, kc * op.BK : (kc + 1) * op.BK].reshape(U, 8)
            for t in range(np_):
                sx[t] = Hr[t, kc * op.BK : (kc + 1) * op.BK].reshape(U, 8)
        for tid in range(0 if op.bulk else NT):
            for i in range(R * U // NT):
                r, u = gt.piece(tid + i * NT, U)
                if row0 + r < lim:
                    k = (kc * U + u) * 8
                    sw[r, gt.swizzle(u, r, op.swz)] = W[row0 + r, k : k + 8]
            for i in range(-(-(MP * U) // NT)):
                idx = tid + i * NT
                t, u = gt.piece(idx, U)
                if idx < MP * U and t < np_:
                    k = (kc * U + u) * 8
                    sx[t, gt.swizzle(u, t, op.swz)] = Hr[t, k : k + 8]
        for warp in range(op.NW):
            for j in range(op.BK // 32):
                for q in range(RT):
                    for jt in range(MT):
                        for s in range(2):
                            fa, fb = [], []
                            for lane in range(32):
                                g, c = lane // 4, lane % 4
                                pu = gt.read_unit(j, c, g, op.swz)
                                r = (warp * RT + q) * 16 + g
                                fa.append(_set_a(sw[r, pu], sw[r + 8, pu], s))
                                fb.append(sx[jt * 8 + g, pu][4 * s : 4 * s + 4].tolist())
                            D = _mma(fa, fb)
                            for lane in range(32):
                                g, c = lane // 4, lane % 4
                                key = (warp, lane, q * MT + jt)
                                v = torch.stack([D[g, 2 * c], D[g, 2 * c + 1], D[g + 8, 2 * c],
                                                 D[g + 8, 2 * c + 1]])  # fmt: skip
                                accs[key] = accs.get(key, 0) + v
    out = torch.full((R, np_), float("nan"), dtype=torch.float64)
    for warp in range(op.NW):  # the epilogue's (row, token slot) of each accumulator value
        for lane in range(32):
            g, c = lane // 4, lane % 4
            for jt in range(MT):
                for s2 in range(2):
                    j = jt * 8 + 2 * c + s2
                    if j < np_:
                        for q in range(RT):
                            r = (warp * RT + q) * 16 + g
                            a = accs[(warp, lane, q * MT + jt)]
                            out[r, j] = a[s2]
                            out[r + 8, j] = a[2 + s2]
    return out


@pytest.mark.parametrize(
    "preset,tp,kv,n",
    [
        ("tiny", 1, {}, 3),  # Ie 64: one 64-wide chunk, swizzled
        ("tiny", 2, {}, 8),  # Ie 32: BK 32, unswizzled
        ("tiny", 1, {"bk": 32, "stages": 2, "mt": 2}, 11),
        ("tiny", 1, {"warps": 2, "rt": 2}, 1),
        ("kimi-k3", 16, {}, 2),  # Ie 192: 3 chunks of 64
        ("tiny", 1, {"load": "bulk"}, 9),  # padded rows, unswizzled reads, two passes
        ("tiny", 2, {"load": "bulk", "mt": 2}, 5),
    ],
)
def test_replay_matches_matmul(preset, tp, kv, n):
    E, K, L, Ie, H, S = _dims(preset, tp)
    op = gt.GroupedW2Tile(8, E, K, L, Ie, H, S, kn=gt.TileKnobs(**kv))
    g = torch.Generator().manual_seed(n)
    W = torch.randn(L, Ie, generator=g, dtype=torch.float64)
    Hr = torch.randn(n, Ie, generator=g, dtype=torch.float64)
    row0 = (op.CE - 1) * op.R  # the last row block
    for ps in range(-(-n // op.MP)):
        np_ = min(n - ps * op.MP, op.MP)
        hp = Hr[ps * op.MP : ps * op.MP + np_]
        got = _replay_pass(op, W, hp, row0, np_)
        want = W[row0 : row0 + op.R] @ hp.T
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "preset,tp,kv,T",
    [
        ("tiny", 1, {"shared": "tile"}, 5),  # S 128: 2 chunks of 64, all in flight
        ("tiny", 2, {"shared": "tile", "mt": 2}, 13),  # S 64: 2 chunks of 32, unswizzled
        ("kimi-k3", 16, {"shared": "tile"}, 64),  # S 384: 6 chunks of 64 through a 3-stage ring
    ],
    ids=_kv_id,
)
def test_shared_tile_replay_matches_matmul(preset, tp, kv, T):
    """``shared=tile``: the last token group of the last row block, moved as the kernel moves it
    (``NCHS`` chunks of the shared weights, rows of ``hs``), equals ``shared_w2 @ hs``; the ring
    of ``NSS`` stages only ever uses the ``nbuf`` buffers."""
    E, K, L, Ie, H, S = _dims(preset, tp)
    op = gt.GroupedW2Tile(T, E, K, L, Ie, H, S, kn=gt.TileKnobs(**kv))
    assert {i % op.NSS for i in range(op.NCHS)} <= set(range(op.nbuf))
    assert op.CS == H // op.R * -(-T // op.MP)
    g = torch.Generator().manual_seed(T)
    W = torch.randn(H, S, generator=g, dtype=torch.float64)
    Hs = torch.randn(T, S, generator=g, dtype=torch.float64)
    tg = op.NTG - 1
    t0 = tg * op.MP
    np_ = min(T - t0, op.MP)
    row0 = H - op.R
    got = _replay_pass(op, W, Hs[t0 : t0 + np_], row0, np_, nch=op.NCHS)
    torch.testing.assert_close(got, W[row0:] @ Hs[t0 : t0 + np_].T, rtol=1e-9, atol=1e-9)


def _cta_role(op, bid):
    """The kernel's ``(is_sh, shared index, routed index)`` of CTA ``bid``: the shared CTAs
    first, or (``shared=spread``) at every ``SPS``-th bid."""
    if op.spread:
        q = bid // op.SPS
        return bid % op.SPS == 0 and q < op.CS, q, bid - min(-(-bid // op.SPS), op.CS)
    return bid < op.CS, bid, bid - op.CS


@pytest.mark.parametrize("T,shared", [(64, "spread"), (8, "spread"), (1, "spread"), (64, "tile")])
def test_cta_roles_partition_the_grid(T, shared):
    """Every shared index ``0 .. CS - 1`` and every routed index ``0 .. nr - 1`` is one CTA's."""
    E, K, L, Ie, H, S = _dims("kimi-k3", 8)
    op = gt.GroupedW2Tile(T, E, K, L, Ie, H, S, kn=gt.TileKnobs(shared=shared, order="col"))
    roles = [_cta_role(op, b) for b in range(op.grid)]
    assert sorted(q for sh, q, _ in roles if sh) == list(range(op.CS))
    assert sorted(r for sh, _, r in roles if not sh) == list(range(op.nr))


def _coverage(op, T, K, nact, slot_n):
    """The kernel's item loops and epilogue index math replayed: how often each (slot, pair
    index, latent row) and each (token, hidden row) output is produced."""
    acc_out, sh_out = Counter(), Counter()
    for bid0 in range(op.grid):
        is_sh, bid, rbid = _cta_role(op, bid0)  # bid: the shared index where is_sh
        for warp in range(op.NW):
            if is_sh and op.shtile:  # (row block, token group), token group fastest
                rb, tg = bid // op.NTG, bid % op.NTG
                for lane in range(32):
                    g, c = lane // 4, lane % 4
                    for jt in range(op.MT):
                        for s2 in range(2):
                            tok = tg * op.MP + jt * 8 + 2 * c + s2
                            if tok < T:
                                for q in range(op.RT):
                                    r = rb * op.R + (warp * op.RT + q) * 16 + g
                                    sh_out[(tok, r)] += 1
                                    sh_out[(tok, r + 8)] += 1
                continue
            if is_sh:
                tiles = [(bid * op.NW + warp) * gt.SHARED_RT + q for q in range(gt.SHARED_RT)]
                NJ = op.SNJ
                for ps in range(-(-T // (8 * NJ))):
                    for lane in range(32):
                        g, c = lane // 4, lane % 4
                        for j in range(NJ):
                            for s in range(2):
                                tok = ps * 8 * NJ + j * 8 + 2 * c + s
                                for t in tiles:
                                    if tok < T and t < op.ntH:
                                        for rr in (g, g + 8):
                                            sh_out[(tok, t * 16 + rr)] += 1
                continue
            total = nact * op.CE
            lo, hi = rbid, total
            if op.blocked:
                ipc = -(-total // op.nr)
                lo, hi = lo * ipc, min(lo * ipc + ipc, total)
            if op.col:  # the worst case's items, slot fastest; unselected slots skipped
                items = [(i % op.slots, i // op.slots)
                         for i in range(rbid, op.slots * op.CE, op.nr)]  # fmt: skip
                items = [(a, cb) for a, cb in items if a < nact]
            else:
                items = [(i // op.CE, i % op.CE) for i in range(lo, hi, op.step)]
            for a, cb in items:
                n = slot_n[a]
                for ps in range(-(-n // op.MP)):
                    np_ = min(n - ps * op.MP, op.MP)
                    for lane in range(32):
                        g, c = lane // 4, lane % 4
                        for jt in range(op.MT):
                            for s2 in range(2):
                                j = jt * 8 + 2 * c + s2
                                if j < np_:
                                    for q in range(op.RT):
                                        r = cb * op.R + (warp * op.RT + q) * 16 + g
                                        for rr in (r, r + 8):
                                            if rr < op.L:
                                                acc_out[(a, ps * op.MP + j, rr)] += 1
    return acc_out, sh_out


@pytest.mark.parametrize(
    "preset,tp,T,nsm,kv",
    [
        ("tiny", 1, 8, 2, {}),
        ("tiny", 2, 3, 1, {"mt": 2}),
        ("kimi-k3", 8, 8, 2, {}),
        ("kimi-k3", 16, 16, 1, {"rt": 2, "cap": 4}),
        ("tiny", 1, 8, 1, {"load": "bulk", "warps": 2}),
        ("kimi-k3", 8, 8, 2, {"order": "block"}),
        ("tiny", 2, 13, 1, {"order": "block", "load": "bulk", "cap": 3}),
        ("tiny", 1, 21, 1, {"snj": 2, "shared": "regs"}),
        ("tiny", 1, 13, 1, {"snj": 4, "shared": "regs", "order": "stride"}),
        ("kimi-k3", 8, 8, 2, {"order": "col"}),  # capped: CTAs walk several columns
        ("tiny", 2, 13, 1, {"order": "col", "mt": 2}),
        ("kimi-k3", 16, 3, 512, {"order": "col"}),  # one item per CTA
        ("tiny", 1, 21, 1, {"order": "col", "early": 1}),  # one item per CTA, several passes
        ("tiny", 2, 13, 1, {"order": "col", "early": 1, "cap": 5}),  # first item + columns
        ("tiny", 1, 21, 1, {"shared": "tile"}),
        ("tiny", 2, 13, 1, {"shared": "tile", "mt": 2, "order": "col"}),
        ("kimi-k3", 16, 9, 512, {"shared": "tile", "order": "col", "early": 1, "rt": 2}),
        ("tiny", 1, 21, 1, {"shared": "spread", "order": "col", "early": 1}),
        ("kimi-k3", 8, 8, 2, {"shared": "spread"}),
    ],
    ids=_kv_id,
)
def test_every_output_written_once(preset, tp, T, nsm, kv):
    E, K, L, Ie, H, S = _dims(preset, tp)
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[1:, 0] = ids[0, 0]  # one expert with every token (several passes where T > MP)
    se, so, sn, nact, pairs = mg.lists_from_ids(ids, E)
    op = gt.GroupedW2Tile(T, E, K, L, Ie, H, S, nsm=nsm, kn=gt.TileKnobs(**kv))
    acc_out, sh_out = _coverage(op, T, K, nact, sn.tolist())
    assert len(acc_out) == int(sn.sum()) * L and set(acc_out.values()) == {1}
    assert len(sh_out) == T * H and set(sh_out.values()) == {1}


def test_moe_grouped_routes_tile(monkeypatch):
    """``DECODESCOPE_MOE_GROUPED_W2=tile``: the w2 launch is this kernel, its knobs in the key
    (CPU: launches recorded, not run); unset: the tile (at every token count)."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE
    from decodescope.kernels.weights import make_layer_weights

    keys = []

    def fake_compiled(key, build):
        keys.append((key, build))
        return lambda *a: None

    monkeypatch.setattr(itf, "compiled", fake_compiled)
    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")
    monkeypatch.delenv("DECODESCOPE_MOE_GROUPED_W2", raising=False)
    # the default since the H200 A/Bs s9/r2 and s9/r4: the tile at every token count
    assert mg.W2_TILE_UPTO is None
    assert mg.w2_mode(8) == mg.w2_mode(64) == mg.w2_mode() == "tile"
    monkeypatch.setattr(mg, "W2_TILE_UPTO", 16)  # the s9/r2 boundary still works
    assert mg.w2_mode(16) == "tile" and mg.w2_mode(17) == mg.w2_mode() == "ring"
    monkeypatch.setattr(mg, "W2_TILE_UPTO", None)
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W2", "ring")
    assert mg.w2_mode(8) == "ring"
    cfg = get_config("tiny", 1)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=1)
    blk = SpecializedMoE(cfg, w, 5)
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W2", "tile")
    monkeypatch.setenv("DECODESCOPE_MOE_W2T_MT", "2")
    blk.experts()
    ((key, build),) = [(k, b) for k, b in keys if k[0] == "moe_grouped_w2"]
    assert "tile" in key and gt.TileKnobs(mt=2) in key
    op, args = build()
    assert isinstance(op, gt.GroupedW2Tile) and op.MT == 2 and len(args) == 13
    monkeypatch.delenv("DECODESCOPE_MOE_GROUPED_W2")
    for T, want in ((5, "tile"), (32, "tile")):  # the defaults, by token count
        keys.clear()
        SpecializedMoE(cfg, w, T).experts()
        ((key, _),) = [(k, b) for k, b in keys if k[0] == "moe_grouped_w2"]
        assert want in key and ("ring" if want == "tile" else "tile") not in key


# -- GPU (the lead's H200 runs: pytest -m gpu tests/test_grouped_w2_tile.py) ----------------

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_specialized_moe.py"


@pytest.fixture(scope="module")
def gsm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = importlib.util.spec_from_file_location("gpu_specialized_moe_w2t", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kv",
    [
        {},
        {"DECODESCOPE_MOE_W2T_RT": "2", "DECODESCOPE_MOE_W2T_MT": "2"},
        {"DECODESCOPE_MOE_W2T_LOAD": "bulk"},
        {"DECODESCOPE_MOE_W2T_SHARED": "regs", "DECODESCOPE_MOE_W2T_SNJ": "2"},
        {"DECODESCOPE_MOE_W2T_ORDER": "stride", "DECODESCOPE_MOE_W2T_SHARED": "regs"},
        {"DECODESCOPE_MOE_W2T_SHARED": "spread"},
    ],
)
@pytest.mark.parametrize("preset,tp", [("kimi-k3", 8), ("kimi-k3", 16), ("tiny", 1)])
@pytest.mark.parametrize("n_tokens", [8, 64])
def test_tile_w2_block_gpu(gsm, preset, tp, n_tokens, kv, monkeypatch):
    """Routing lists, routed sum, shared output and the block (vs ``moe_experts_ref`` and the
    references of the math) with the tile w2, outputs poisoned first, two fresh draws."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE
    from decodescope.kernels.weights import make_layer_weights

    for k, v in {**gsm.variant_env("grouped_w2tile"), **kv}.items():
        monkeypatch.setenv(k, v)
    cfg = get_config(preset, tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=n_tokens, device="cuda")
    blk = SpecializedMoE(cfg, w, n_tokens)
    gsm.RESULTS.clear()
    for draw in range(2):
        ctx = {"preset": preset, "tp": tp, "tokens": n_tokens, "draw": draw, "experts": "w2tile"}
        gsm.run_checks(cfg, w, blk, n_tokens, ctx, seed=11 * n_tokens + draw, front_norm=False,
                       fronts=False)  # fmt: skip
    bad = [r for r in gsm.RESULTS if r.get("status") in ("FAIL", "error")]
    assert not bad, bad
    assert any(r.get("check") == "routed_latent_sum" for r in gsm.RESULTS)
