"""``kernels/specialized/grouped_w13_tile.py`` (``DECODESCOPE_MOE_GROUPED_W13=tile``): compiles for
sm_90a on the CPU at the kimi-k3 TP8 / TP16 shapes (8, 32, 64 tokens) and at the sweep points
of its knobs; its index math replayed in Python (every ``h`` element stored once, every lane
reading the K columns its fragment stands for from the swizzled stages); the knobs' parsing;
the wiring into ``moe_grouped``; on a GPU (``-m gpu``) the checks of
``scripts/gpu_specialized_moe.py`` with the tile kernel (``h`` itself, routed sum, block)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest
import torch

from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.specialized import grouped_w13_tile as gt
from decodescope.kernels.specialized import interface as itf  # sets CUTE_DSL_ARCH first
from decodescope.kernels.specialized import moe_grouped as mg
from decodescope.kernels.weights import make_layer_weights


def _dims(tp: int):
    cfg = get_config("kimi-k3", tp)
    e = cfg.moe
    return cfg, (e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter, cfg.shared_inter)


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("T", [8, 32, 64])
def test_compiles_default(tp, T):
    """The default tiling through ``moe_grouped``'s builder (the path ``moe_grouped`` takes)."""
    cfg, (E, K, L, Ie, S) = _dims(tp)
    op, args = mg._build_w13(T, E, K, L, Ie, S, 4.0, 25.0, True, "tile", 132, gt.TileConfig())
    assert isinstance(op, gt.GroupedW13Tile)
    assert op.grid == min(mg.n_slots(T, E, K) * op.NRT, mg.CTAS_PER_SM * 132)
    assert itf.compile_only(op, *args) is not None


@pytest.mark.parametrize("tp,T", [(1, 3), (2, 8)])
def test_compiles_tiny(tp, T):
    """The tiny preset (the CPU / GPU tests' shapes): Ie 64 / 32, the latter smaller than R
    (one partial item per expert)."""
    cfg = get_config("tiny", tp)
    e = cfg.moe
    op, args = gt.build(T, e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter,
                        cfg.shared_inter, 4.0, 25.0, True)  # fmt: skip
    assert op.partial == (cfg.expert_inter % op.R != 0)
    assert itf.compile_only(op, *args) is not None


# sweep points the GPU script names (grouped_w13tile_r.._k.._s.._t..); TP16 R 128: a partial item
@pytest.mark.parametrize(
    "tp,rows,bk,stages,rt",
    [
        (8, 64, 64, 4, 1),
        (8, 32, 128, 3, 1),
        (8, 128, 64, 3, 2),
        (8, 128, 64, 3, 1),
        (8, 64, 64, 2, 1),
        (16, 128, 64, 3, 2),
        (16, 32, 256, 3, 1),
    ],
)
@pytest.mark.parametrize("persist", [0, 2])
def test_compiles_sweep(tp, rows, bk, stages, rt, persist):
    cfg, (E, K, L, Ie, S) = _dims(tp)
    c = gt.TileConfig(rows, bk, stages, rt, persist)
    op, args = gt.build(64, E, K, L, Ie, S, 4.0, 25.0, True, 132, c)
    assert op.partial == (Ie % rows != 0)
    assert itf.compile_only(op, *args) is not None


@pytest.mark.parametrize(
    "tp,T,cfg",
    [
        (8, 256, gt.TileConfig(mt=2)),
        (8, 512, gt.TileConfig(mt=2, stages=2)),
        (16, 256, gt.TileConfig(mt=2)),
        (16, 512, gt.TileConfig(mt=4, stages=2)),
        (8, 256, gt.TileConfig(mt=2, persist=2)),
    ],
)
def test_compiles_token_tiles(tp, T, cfg):
    """Several 8-token tiles per pass (``DECODESCOPE_MOE_W13T_MT``) at the chunked verify
    steps' token counts (the experts once over 256 / 512 tokens)."""
    _, (E, K, L, Ie, S) = _dims(tp)
    op, args = mg._build_w13(T, E, K, L, Ie, S, 4.0, 25.0, True, "tile", 132, cfg)
    assert cfg.mt == op.MT and 8 * cfg.mt == op.TP
    assert op.cfg.smem_bytes == cfg.stages * (2 * 64 * 128 * 2 + 8 * cfg.mt * 128 * 4)
    assert itf.compile_only(op, *args) is not None


def test_geometry_tp8():
    """TP8 defaults: 64 gate + 64 up rows per CTA, 4 warps, 6 items per expert, 28 chunks of
    128 K, 108 KB of shared memory (2 CTAs per SM), 16 weight pieces + 2 z pieces per thread."""
    _, (E, K, L, Ie, S) = _dims(8)
    op = gt.GroupedW13Tile(64, E, K, L, Ie, 4.0, 25.0)
    assert (op.R, op.BK, op.S, op.RT, op.NW, op.NT) == (64, 128, 3, 1, 4, 128)
    assert (op.NRT, op.NCH, op.WP, op.ZP, op.partial) == (6, 28, 16, 2, False)
    assert op.cfg.smem_bytes == 3 * (128 * 128 * 2 + 8 * 128 * 4) == 110592
    assert op.grid == min(896 * 6, 64 * 132)
    assert gt.GroupedW13Tile(8, E, K, L, Ie, 4.0, 25.0).grid == 128 * 6


def _coverage(op: gt.GroupedW13Tile, nact: int, slot_n: list[int]) -> Counter:
    """The kernel's item / pass / warp / lane loops replayed: how often each ``(slot, token
    slot, h row)`` is stored."""
    out: Counter = Counter()
    for bid in range(op.grid):
        for item in range(bid, nact * op.NRT, op.grid):
            a, rt = item // op.NRT, item % op.NRT
            n = slot_n[a]
            for ps in range(-(-n // op.TP)):
                nn = min(n - ps * op.TP, op.TP)
                for warp in range(op.NW):
                    for lane in range(32):
                        g, c = lane // 4, lane % 4
                        for t, q in ((t, q) for t in range(op.MT) for q in range(op.RT)):
                            for hh in range(2):
                                row = rt * op.R + warp * 16 * op.RT + q * 16 + g + 8 * hh
                                for s in range(2):
                                    col = 8 * t + 2 * c + s
                                    if col < nn and (not op.partial or row < op.Ie):
                                        out[(a, ps * op.TP + col, row)] += 1
    return out


@pytest.mark.parametrize(
    "tp,T,nsm,cfg",
    [
        (8, 8, 2, gt.TileConfig()),
        (8, 12, 3, gt.TileConfig(32, 128, 4, 1)),
        (16, 6, 2, gt.TileConfig(128, 64, 3, 2)),  # partial last item (192 = 128 + 64)
        (8, 40, 3, gt.TileConfig(mt=2)),  # 16 tokens a pass: 40 on expert 5, three passes
        (16, 21, 2, gt.TileConfig(128, 64, 2, 2, mt=4)),  # 32 a pass, partial item
    ],
)
def test_every_h_written_once(tp, T, nsm, cfg):
    """Grids capped (few SMs: CTAs walk several items), an expert with more than a pass's
    tokens (8 x mt: several passes): every ``h`` element of every pair is stored exactly once,
    and the library's own replay (``coverage``) agrees."""
    _, (E, K, L, Ie, S) = _dims(tp)
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[:, 0] = 5  # expert 5 chosen by every token: > 8 tokens when T > 8
    se, so, sn, nact, pairs = mg.lists_from_ids(ids, E)
    op = gt.GroupedW13Tile(T, E, K, L, Ie, 4.0, 25.0, nsm=nsm, cfg=cfg)
    assert op.grid < nact * op.NRT  # the item loop runs
    out = _coverage(op, nact, sn.tolist())
    assert len(out) == int(sn.sum()) * Ie and set(out.values()) == {1}
    assert gt.coverage(op, nact, sn.tolist()) == out


def _persist_trace(op: gt.GroupedW13Tile, bid: int, total: int, slot_n: list[int]):
    """``GroupedW13Tile._persist``'s loader / consumer state machine transcribed: the chunks the
    loader issues (``(item, pass, chunk)`` in order), the chunks the consumer multiplies, the
    passes it stores, and for each consumer step how many chunks had been issued."""
    S, NCH, NRT = op.S, op.NCH, op.NRT

    def n_of(item):
        return slot_n[min(item, total - 1) // NRT]

    loads, cons, epis, issued_at = [], [], [], []
    l_item, l_ps, l_kc = bid, 0, 0

    def load_step():
        nonlocal l_item, l_ps, l_kc
        loads.append((l_item, l_ps, l_kc))
        l_kc += 1
        if l_kc == NCH:
            l_kc, l_ps = 0, l_ps + 1
            if l_ps * op.TP >= n_of(l_item):
                l_ps, l_item = 0, l_item + op.grid

    for _ in range(S - 1):
        if l_item < total:
            load_step()
    c_item, c_ps, c_kc = bid, 0, 0
    while c_item < total:
        if l_item < total:
            load_step()
        issued_at.append(len(loads))
        cons.append((c_item, c_ps, c_kc))
        c_kc += 1
        if c_kc == NCH:
            epis.append((c_item, c_ps))
            c_kc, c_ps = 0, c_ps + 1
            if c_ps * op.TP >= n_of(c_item):
                c_ps, c_item = 0, c_item + op.grid
    return loads, cons, epis, issued_at


@pytest.mark.parametrize("cfg", [gt.TileConfig(persist=2), gt.TileConfig(64, 64, 4, 1, 3),
                                 gt.TileConfig(32, 128, 2, 1, 1),
                                 gt.TileConfig(persist=2, mt=2)])  # fmt: skip
def test_persist_pipeline_order(cfg):
    """Persistent CTAs (few SMs: several items each, one expert with 2 passes): the consumer
    multiplies exactly the chunks the loader issued, in the same order (so chunk g is in stage
    g % S and commit group g), the loader stays S - 1 chunks ahead until it runs out, and every
    (item, pass) of the CTA is stored once."""
    _, (E, K, L, Ie, S) = _dims(8)
    T = 12 * cfg.mt
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[:, 0] = 7  # 12 x mt tokens on expert 7: two passes
    se, so, sn, nact, pairs = mg.lists_from_ids(ids, E)
    op = gt.GroupedW13Tile(T, E, K, L, Ie, 4.0, 25.0, nsm=3, cfg=cfg)
    total = nact * op.NRT
    assert op.grid == min(mg.n_slots(T, E, K) * op.NRT, cfg.persist * 3) < total
    seen = Counter()
    for bid in range(op.grid):
        loads, cons, epis, issued_at = _persist_trace(op, bid, total, sn.tolist())
        assert loads == cons
        for gidx, n_issued in enumerate(issued_at):
            assert n_issued == min(gidx + op.S, len(loads))  # chunk gidx + S - 1 issued
        want = [(it, ps) for it in range(bid, total, op.grid)
                for ps in range(-(-int(sn[it // op.NRT]) // op.TP))]  # fmt: skip
        assert epis == want
        seen.update(epis)
    assert sum(seen.values()) == sum(-(-int(sn[it // op.NRT]) // op.TP) for it in range(total))
    assert set(seen.values()) == {1}


@pytest.mark.parametrize("cfg", [gt.TileConfig(), gt.TileConfig(64, 64, 4, 1),
                                 gt.TileConfig(128, 64, 3, 2), gt.TileConfig(32, 256, 3, 1),
                                 gt.TileConfig(mt=2), gt.TileConfig(64, 64, 2, 2, mt=4)])  # fmt: skip
def test_stage_layout_matches_fragments(cfg):
    """The loader's thread -> (row, unit) map and the swizzles, replayed for one chunk: every
    (row, K unit) of the ``2R`` rows and every (token, FP32 unit) of z is written exactly once,
    and each lane's fragment reads (rows ``g``, ``g + 8`` of its gate and up tiles at stored unit
    ``w_unit(4h + c, g)``; z of token ``g`` at ``z_unit(8h + 2c + v, g)``) find K columns
    ``32h + 8c .. + 7`` of those rows / that token: the columns the MMA pairs them as."""
    _, (E, K, L, Ie, S) = _dims(8)
    op = gt.GroupedW13Tile(64, E, K, L, Ie, 4.0, 25.0, cfg=cfg)
    R, UPR = op.R, op.UPR
    stored = {}  # (local row, stored unit) -> K unit of that row
    for tid in range(op.NT):
        u, r_t = tid % UPR, tid // UPR
        for i in range(op.WP):
            rl = r_t + i * op.RS
            assert rl % 2 == r_t % 2  # the swizzle parity the kernel uses (r_t's)
            key = (rl, gt.w_unit(u, r_t))
            assert key not in stored
            stored[key] = u
    assert len(stored) == 2 * R * UPR and all(0 <= k[1] < UPR for k in stored)
    zst = {}
    for tid in range(op.NT):
        uz = tid % op.UZ
        for i in range(op.ZP):
            m = tid // op.UZ + i * (op.NT // op.UZ)
            if m < op.TP:
                key = (m, gt.z_unit(uz, m))
                assert key not in zst
                zst[key] = uz
    assert len(zst) == op.TP * op.UZ
    for warp in range(op.NW):
        for lane in range(32):
            g, c = lane // 4, lane % 4
            for h in range(op.BK // 32):
                for q in range(op.RT):
                    rg = warp * 16 * op.RT + q * 16 + g
                    for r in (rg, rg + 8, R + rg, R + rg + 8):
                        assert stored[(r, gt.w_unit(4 * h + c, g))] == 4 * h + c  # 8 bf16
                for t, v in ((t, v) for t in range(op.MT) for v in range(2)):
                    m = 8 * t + g  # token tile t's slot of the lane's column
                    assert zst[(m, gt.z_unit(8 * h + 2 * c + v, m))] == 8 * h + 2 * c + v
    # quarter-warp bank check of the weight reads: lanes 8j..8j+7 read 8 distinct 16-byte
    # bank groups (rows g, g + 1 at units c: the swizzle puts them in opposite halves)
    for j in range(4):
        for h in range(op.BK // 32):
            banks = set()
            for lane in range(8 * j, 8 * j + 8):
                g, c = lane // 4, lane % 4
                byte = g * op.BK * 2 + gt.w_unit(4 * h + c, g) * 16
                banks.add((byte % 128) // 16)
            assert len(banks) == 8


def test_knobs(monkeypatch):
    for var in gt.ENV.values():
        monkeypatch.delenv(var, raising=False)
    assert gt.tile_config() == gt.TileConfig() == gt.TileConfig(64, 128, 3, 1, 0)
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_BK", "64")
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_STAGES", "4")
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_ROWS", "")  # empty: the default
    assert gt.tile_config() == gt.TileConfig(64, 64, 4, 1)
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_MT", "2")
    assert gt.tile_config() == gt.TileConfig(64, 64, 4, 1, mt=2)
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_MT", "")
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_BK", "")
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_STAGES", "")
    # unset, by the launch's tokens (the chunked steps' experts above 64): up to 64 the module
    # defaults; 65-256 two token tiles per pass and 4 stages; above 256 four tiles, 3 stages
    assert gt.tile_config(64) == gt.TileConfig()
    assert gt.tile_config(65) == gt.tile_config(256) == gt.TileConfig(mt=2, stages=4)
    assert gt.tile_config(257) == gt.tile_config(512) == gt.TileConfig(mt=4)
    assert gt.TileConfig(mt=4, stages=4).smem_bytes <= gt.SMEM_MAX  # a knob on top still fits
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_MT", "1")
    assert gt.tile_config(256) == gt.TileConfig(mt=1, stages=4)  # the knob wins, per field
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_STAGES", "3")
    assert gt.tile_config(256) == gt.TileConfig(mt=1)
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_MT", "")
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_STAGES", "")
    for var, bad, msg in (
        ("DECODESCOPE_MOE_W13T_BK", "96", "bk=96"),
        ("DECODESCOPE_MOE_W13T_BK", "x", "DECODESCOPE_MOE_W13T_BK='x'"),
        ("DECODESCOPE_MOE_W13T_ROWS", "48", "rows=48"),
        ("DECODESCOPE_MOE_W13T_RT", "3", "rt=3"),
        ("DECODESCOPE_MOE_W13T_STAGES", "9", "stages=9"),
        ("DECODESCOPE_MOE_W13T_PERSIST", "9", "persist=9"),
        ("DECODESCOPE_MOE_W13T_MT", "3", "mt=3"),
    ):
        monkeypatch.setenv(var, bad)
        with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
            gt.tile_config()
        monkeypatch.setenv(var, "")
    with pytest.raises(ValueError, match="shared memory"):
        gt.TileConfig(128, 256, 4, 1)
    with pytest.raises(ValueError, match="multiple of bk"):
        gt.GroupedW13Tile(8, 32, 4, 160, 64, 4.0, 25.0, cfg=gt.TileConfig(32, 64, 2, 1))
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W13", "tile")
    assert mg.w13_mode() == "tile"
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W13", "")
    assert mg.w13_mode() == "tile"  # the default since the H200 A/B s9/r2
    monkeypatch.delenv("DECODESCOPE_MOE_GROUPED_W13")
    assert mg.w13_mode() == "tile"
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W13", "ring")
    assert mg.w13_mode() == "ring"


def test_block_wiring(monkeypatch):
    """``DECODESCOPE_MOE_GROUPED_W13=tile``: the block's expert step builds the tile kernel, with
    the knobs in the compile key (CPU: launches recorded, builds run, nothing compiled)."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE

    keys, built = [], []

    def fake_compiled(key, build):
        keys.append(key)
        op, _ = build()
        built.append(op)
        return lambda *a: None

    monkeypatch.setattr(itf, "compiled", fake_compiled)
    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")
    monkeypatch.delenv("DECODESCOPE_MOE_GROUPED_W13", raising=False)  # the default: tile
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_STAGES", "3")
    cfg = get_config("tiny", 1)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=1)
    blk = SpecializedMoE(cfg, w, 5)
    try:
        blk.experts()
    except ValueError as e:  # the tiny preset's shapes may not fit the tile kernel: say so
        pytest.skip(f"tiny preset: {e}")
    w13 = [(k, op) for k, op in zip(keys, built, strict=True) if k[0] == "moe_grouped_w13"]
    assert len(w13) == 1
    key, op = w13[0]
    assert isinstance(op, gt.GroupedW13Tile) and op.S == 3
    assert key[-1] == gt.TileConfig(stages=3)


def test_script_variants():
    """The GPU script's ``grouped_w13tile[_r..][_k..][_s..][_t..]`` variants set the knobs
    (empty: the default) on top of the current defaults; unknown names are refused."""
    spec = importlib.util.spec_from_file_location("gpu_specialized_moe_w13t", _SCRIPT)
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    env = gs.variant_env("grouped_w13tile_k128_s3")
    assert env["DECODESCOPE_MOE_GROUPED_W13"] == "tile"
    assert env["DECODESCOPE_MOE_EXPERTS"] == "grouped"
    assert env["DECODESCOPE_MOE_W13T_BK"] == "128" and env["DECODESCOPE_MOE_W13T_STAGES"] == "3"
    assert env["DECODESCOPE_MOE_W13T_ROWS"] == "" and env["DECODESCOPE_MOE_W13T_RT"] == ""
    assert gs.variant_env("grouped_w13tile_r128_t2")["DECODESCOPE_MOE_W13T_RT"] == "2"
    assert gs.variant_env("grouped_w13tile_k64_s4_p3")["DECODESCOPE_MOE_W13T_PERSIST"] == "3"
    assert env["DECODESCOPE_MOE_W13T_PERSIST"] == ""
    assert gs.variant_name("grouped_w13tile") == "grouped_w13tile"
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        gs.variant_name("grouped_w13tile_q3")


# -- GPU (the lead's H200 runs: pytest -m gpu tests/test_grouped_w13_tile.py) -----------------

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_specialized_moe.py"


@pytest.fixture(scope="module")
def gsm():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = importlib.util.spec_from_file_location("gpu_specialized_moe", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.gpu
@pytest.mark.parametrize("tp,n_tokens", [(8, 8), (8, 32), (8, 64), (16, 32)])
def test_w13_tile_gpu(gsm, tp, n_tokens, monkeypatch):
    """h (poisoned first) vs bf16(SiTU(w13 z)) per pair, lists, routed sum, shared output and the
    block vs the references, with ``DECODESCOPE_MOE_GROUPED_W13=tile``, two fresh draws."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE

    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W13", "tile")
    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=n_tokens, device="cuda")
    blk = SpecializedMoE(cfg, w, n_tokens)
    gsm.RESULTS.clear()
    for draw in range(2):
        ctx = {"preset": "kimi-k3", "tp": tp, "tokens": n_tokens, "draw": draw,
               "experts": "grouped_w13tile"}  # fmt: skip
        gsm.run_checks(cfg, w, blk, n_tokens, ctx, seed=11 * n_tokens + draw, front_norm=False,
                       fronts=False)  # fmt: skip
    bad = [r for r in gsm.RESULTS if r.get("status") in ("FAIL", "error")]
    assert not bad, bad
    assert any(r.get("check") == "grouped_h_w13tile" for r in gsm.RESULTS)


@pytest.mark.gpu
@pytest.mark.parametrize("tp,n_tokens,mt", [(8, 256, 2), (16, 512, 2), (8, 64, 4)])
def test_w13_tile_token_tiles_gpu(gsm, tp, n_tokens, mt, monkeypatch):
    """As :func:`test_w13_tile_gpu` with ``mt`` 8-token tiles per pass
    (``DECODESCOPE_MOE_W13T_MT``) at the chunked verify steps' token counts."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE

    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W13", "tile")
    monkeypatch.setenv("DECODESCOPE_MOE_W13T_MT", str(mt))
    cfg = get_config("kimi-k3", tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=n_tokens, device="cuda")
    blk = SpecializedMoE(cfg, w, n_tokens, chunk=min(n_tokens, 64))
    gsm.RESULTS.clear()
    for draw in range(2):
        ctx = {"preset": "kimi-k3", "tp": tp, "tokens": n_tokens, "draw": draw,
               "experts": f"grouped_w13tile_m{mt}"}  # fmt: skip
        gsm.run_checks(cfg, w, blk, n_tokens, ctx, seed=11 * n_tokens + draw, front_norm=False,
                       fronts=False)  # fmt: skip
    bad = [r for r in gsm.RESULTS if r.get("status") in ("FAIL", "error")]
    assert not bad, bad
    assert any(r.get("check") == "grouped_h_w13tile" for r in gsm.RESULTS)
