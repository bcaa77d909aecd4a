"""The grouped expert kernels (``kernels/specialized/moe_grouped.py``, ``DECODESCOPE_MOE_EXPERTS=
grouped``): compile for sm_90a on the CPU at the kimi-k3 TP8 shapes (8, 32, 64 tokens), TP16 and
the tiny preset; the torch references of the routing lists and of the grouped computation order
against ``router_topk_ref`` / ``moe_experts_ref``; on a GPU (``-m gpu``) the kernels against
``moe_experts_ref`` through the checks of ``scripts/gpu_specialized_moe.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from decodescope.kernels.config import LayerSpec, get_config
from decodescope.kernels.reference import rel_l2
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import moe_experts as me
from decodescope.kernels.specialized import moe_grouped as mg
from decodescope.kernels.specialized import router_topk as rt
from decodescope.kernels.weights import make_layer_weights


def _dims(preset: str, tp: int):
    cfg = get_config(preset, tp)
    e = cfg.moe
    d = (e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter, cfg.hidden, cfg.shared_inter)
    return cfg, d


@pytest.mark.parametrize(
    "preset,tp,T,mode",
    [
        ("kimi-k3", 8, 8, "w4"),
        ("kimi-k3", 8, 32, "w4"),
        ("kimi-k3", 8, 64, "w4"),
        ("kimi-k3", 8, 64, "w8"),
        ("kimi-k3", 16, 32, "w4"),
        ("tiny", 1, 3, "w4"),
        ("tiny", 2, 8, "w8"),
    ],
)
def test_grouped_kernels_compile(preset, tp, T, mode):
    cfg, (E, K, L, Ie, H, S) = _dims(preset, tp)
    builds = mg.build_all(T, E, K, L, Ie, H, S, 1.0, cfg.model.situ_beta,
                          cfg.model.situ_linear_beta, True, mode)  # fmt: skip
    for op, args in builds:
        assert itf.compile_only(op, *args) is not None


@pytest.mark.parametrize(
    "preset,tp,T", [("kimi-k3", 8, 1), ("kimi-k3", 8, 64), ("kimi-k3", 16, 8), ("tiny", 1, 3)]
)
def test_ring_kernels_compile(preset, tp, T):
    """w13 and w2 with their weights streamed through the per-lane cp.async rings."""
    cfg, (E, K, L, Ie, H, S) = _dims(preset, tp)
    builds = mg.build_all(T, E, K, L, Ie, H, S, 1.0, cfg.model.situ_beta,
                          cfg.model.situ_linear_beta, True, "ring", True, "ring")  # fmt: skip
    for op, args in builds[1:]:
        assert op.mode == "ring" and 1 <= op.stages <= mg.RING_STAGES
        assert itf.compile_only(op, *args) is not None


@pytest.mark.parametrize("preset,tp,T", [("kimi-k3", 8, 64), ("kimi-k3", 8, 32), ("tiny", 1, 13)])
def test_split_route_compiles(preset, tp, T):
    """The route kernel with its top-k over ceil(T/8) CTAs and the last-CTA lists."""
    cfg, (E, K, L, Ie, H, S) = _dims(preset, tp)
    op, args = mg._build_route(T, E, K, L, S, 1.0, 4.0, 25.0, True, True)
    assert op.split and op.NTK == -(-T // 8) and op.grid == op.NTK + op.nsh
    assert itf.compile_only(op, *args) is not None


def test_grouped_geometry_kimi_tp8():
    """TP8, 64 tokens: up to min(E, T*k) = 896 slots; 24 w13 items (16 gate + 16 up rows) and
    28 w2 items (128 rows) per expert, grids capped at 64 CTAs per SM (the CTAs loop over the
    items), 56 shared-down CTAs; at 8 tokens the grids are the worst case itself."""
    _, (E, K, L, Ie, H, S) = _dims("kimi-k3", 8)
    w13 = mg.GroupedW13(64, E, K, L, Ie, 4.0, 25.0, nsm=132)
    w2 = mg.GroupedW2(64, E, K, L, Ie, H, S, nsm=132)
    assert (w13.slots, w13.NRT, w13.grid) == (896, 24, 64 * 132)
    assert (w13.NW, w13.CPW, w13.U) == (4, 28, 4)
    assert (w2.CE, w2.CS, w2.nr, w2.grid) == (28, 56, 64 * 132, 64 * 132 + 56)
    assert mg.GroupedW13(8, E, K, L, Ie, 4.0, 25.0).grid == 128 * 24
    assert mg.GroupedW2(8, E, K, L, Ie, H, S).nr == 128 * 28
    assert mg.n_slots(8, E, K) == 128
    assert mg.supported(8, E, K, L, Ie, H, S)
    assert not mg.supported(8, E, K, L, 40, H, S)  # expert_inter not a multiple of 16


def test_bad_shapes_and_env(monkeypatch):
    with pytest.raises(ValueError, match="moe_grouped: expert_inter"):
        mg.GroupedW13(8, 32, 4, 128, 40, 4.0, 25.0)
    with pytest.raises(ValueError, match="w13 mode"):
        mg.GroupedW13(8, 32, 4, 128, 64, 4.0, 25.0, mode="w9")
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W13", "w7")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_GROUPED_W13"):
        mg.w13_mode()
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W13", "w8")
    assert mg.w13_mode() == "w8"
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W13", "ring")
    assert mg.w13_mode() == "ring"
    with pytest.raises(ValueError, match="w2 mode"):
        mg.GroupedW2(8, 32, 4, 128, 64, 128, 64, mode="ringo")
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W2", "rings")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_GROUPED_W2"):
        mg.w2_mode()
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_W2", "ring")
    assert mg.w2_mode() == "ring"
    monkeypatch.delenv("DECODESCOPE_MOE_GROUPED_ROUTE", raising=False)
    assert mg.route_split()  # split CTAs since the H200 run of 2e2fdce
    assert mg.route_mode() == "thresh"  # their threshold top-k since s8/r4
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_ROUTE", "one")
    assert not mg.route_split()
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_ROUTE", "both")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_GROUPED_ROUTE"):
        mg.route_split()
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_ROUTE", "split")
    assert mg.route_split()
    assert not mg.GroupedRoute(8, 32, 4, 128, 64, 1.0, 4.0, 25.0, split=True).split  # 1 CTA
    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")
    assert mg.selected()
    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "old")
    assert not mg.selected()
    monkeypatch.delenv("DECODESCOPE_MOE_EXPERTS")
    assert mg.AUTO_FROM == 8 and mg.selected(64) and not mg.selected(4)  # auto since the H200
    _, dims = _dims("kimi-k3", 8)
    monkeypatch.setattr(mg, "AUTO_FROM", 8)
    assert mg.selected(8, dims) and not mg.selected(4, dims)
    assert not mg.selected(8, (*dims[:3], 40, *dims[4:]))  # unsupported shapes


@pytest.mark.parametrize("T", [1, 8, 64])
def test_route_ref_lists(T):
    """The route reference equals ``router_topk_ref``, and its lists cover every pair once, in
    expert order, with the counts of the routing."""
    cfg, (E, K, L, Ie, H, S) = _dims("kimi-k3", 8)
    g = torch.Generator().manual_seed(T)
    logits = torch.randn(T, E, generator=g)
    bias = 0.1 * torch.randn(E, generator=g)
    ids, tw, se, so, sn, nact, pairs = mg.route_ref(logits, bias, K, 2.5)
    ids_r, tw_r = rt.router_topk_ref(logits, bias, K, 2.5)
    assert torch.equal(ids, ids_r) and torch.equal(tw, tw_r)
    flat = ids.reshape(-1).long()
    assert nact == len(set(flat.tolist())) == se.numel() <= mg.n_slots(T, E, K)
    assert torch.equal(torch.sort(pairs.long()).values, torch.arange(T * K))
    assert bool((se[1:] > se[:-1]).all())
    assert int(sn.sum()) == T * K and int(so[0]) == 0
    for a in range(nact):
        seg = pairs[int(so[a]) : int(so[a]) + int(sn[a])].long()
        assert bool((flat[seg] == int(se[a])).all())
    shuffled = pairs.clone()
    o, n = int(so[0]), int(sn[0])
    shuffled[o : o + n] = shuffled[o : o + n].flip(0)
    assert torch.equal(mg.canonical_pairs(shuffled, so, sn), pairs)


@pytest.mark.parametrize("T", [1, 5, 16])
def test_grouped_ref_matches_moe_experts_ref(T):
    """The grouped computation order (per expert, all its tokens) equals the pair-by-pair
    reference the expert kernels are checked against (tiny preset, FP32)."""
    cfg = get_config("tiny", 1)
    e = cfg.moe
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=3)
    g = torch.Generator().manual_seed(40 + T)
    E, L, S = e.num_experts, cfg.expert_dim, cfg.shared_inter
    y = torch.randn(T, E + L + 2 * S, generator=g)
    ids, tw = rt.router_topk_ref(y[:, :E], w["router_bias"].float(), e.top_k, e.routed_scaling)
    args = (y[:, E : E + L], y[:, E + L :], ids, tw, w["w13"], w["w2"], w["shared_w2"],
            cfg.model.situ_beta, cfg.model.situ_linear_beta)  # fmt: skip
    acc_g, sh_g = mg.grouped_ref(*args)
    acc_r, sh_r = me.moe_experts_ref(*args)
    assert rel_l2(acc_g, acc_r) < 1e-5
    assert rel_l2(sh_g, sh_r) < 1e-6


# -- GPU (the lead's H200 runs: pytest -m gpu tests/test_moe_grouped.py) ----------------------

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
@pytest.mark.parametrize("route", ["one", "split"])
@pytest.mark.parametrize("preset,tp", [("kimi-k3", 8), ("tiny", 1)])
@pytest.mark.parametrize("n_tokens", [8, 32, 64])
def test_grouped_block_gpu(gsm, preset, tp, n_tokens, route, monkeypatch):
    """Routing, lists, routed sum, shared output and the block (vs ``moe_experts_ref`` and the
    references of the math), outputs poisoned first, two fresh draws."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE

    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_ROUTE", route)
    cfg = get_config(preset, tp)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=n_tokens, device="cuda")
    blk = SpecializedMoE(cfg, w, n_tokens)
    gsm.RESULTS.clear()
    for draw in range(2):
        ctx = {"preset": preset, "tp": tp, "tokens": n_tokens, "draw": draw, "experts": "grouped"}
        gsm.run_checks(cfg, w, blk, n_tokens, ctx, seed=7 * n_tokens + draw, front_norm=False)
    bad = [r for r in gsm.RESULTS if r.get("status") in ("FAIL", "error")]
    assert not bad, bad
    assert any(r.get("check") == "grouped_route_lists" for r in gsm.RESULTS)


def test_script_route_list_check_on_cpu():
    """The GPU script's ``grouped_route_lists`` check passes on lists built from the ids (any
    order inside an expert) and fails on a wrong count."""
    spec = importlib.util.spec_from_file_location("gpu_specialized_moe_cpu", _SCRIPT)
    gs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gs)
    E, K, T, S = 32, 4, 6, 64
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).to(torch.int32)

    class Blk:
        topk_ids = ids

    gb = mg.GroupedBuffers(T, E, K, S, "cpu")
    se, so, sn, nact, pairs = mg.lists_from_ids(ids, E)
    gb.slot_e[:nact], gb.slot_off[:nact], gb.slot_n[:nact] = se, so, sn
    gb.nact[0] = nact
    gb.pairs.copy_(pairs)
    gb.pairs[: int(sn[0])] = gb.pairs[: int(sn[0])].flip(0)
    gs.RESULTS.clear()
    gs._grouped_route_check(Blk, gb, E, {"tokens": T})
    gb.nact[0] = nact - 1
    gs._grouped_route_check(Blk, gb, E, {"tokens": T})
    assert [r["status"] for r in gs.RESULTS] == ["pass", "FAIL"]


def _coverage(op13, op2, T, K, nact, slot_n):
    """The w13 and w2 kernels' item loops and tile index math replayed in Python: how often each
    (pair slot, h row), (pair slot, latent row) and (token, hidden row) output is produced."""
    from collections import Counter

    h_out, acc_out, sh_out = Counter(), Counter(), Counter()
    for bid in range(op13.grid):
        for item in range(bid, nact * op13.NRT, op13.grid):
            a, rt = item // op13.NRT, item % op13.NRT
            n = slot_n[a]
            for ps in range(-(-n // 8)):
                for idx in range(mg.ROWS * 8):
                    r, m = idx % mg.ROWS, idx // mg.ROWS
                    if ps * 8 + m < n:
                        h_out[(a, ps * 8 + m, rt * mg.ROWS + r)] += 1
    for bid in range(op2.grid):
        for warp in range(mg.W2_WARPS):
            if bid < op2.nr:
                for item in range(bid, nact * op2.CE, op2.nr):
                    a, cb = item // op2.CE, item % op2.CE
                    tiles = [(cb * mg.W2_WARPS + warp) * mg.W2_RT + q for q in range(mg.W2_RT)]
                    n = slot_n[a]
                    for ps in range(-(-n // 8)):
                        for lane in range(32):
                            g, c = lane // 4, lane % 4
                            for s in range(2):
                                slot = ps * 8 + 2 * c + s
                                for t in tiles:
                                    if slot < n and t < op2.ntL:
                                        for rr in (g, g + 8):
                                            acc_out[(a, slot, t * mg.ROWS + rr)] += 1
            else:
                sb = bid - op2.nr
                tiles = [(sb * mg.W2_WARPS + warp) * mg.W2_RT + q for q in range(mg.W2_RT)]
                for ps in range(-(-T // 8)):
                    for lane in range(32):
                        g, c = lane // 4, lane % 4
                        for s in range(2):
                            tok = ps * 8 + 2 * c + s
                            for t in tiles:
                                if tok < T and t < op2.ntH:
                                    for rr in (g, g + 8):
                                        sh_out[(tok, t * mg.ROWS + rr)] += 1
    return h_out, acc_out, sh_out


@pytest.mark.parametrize("preset,tp,T,nsm", [("tiny", 1, 8, 2), ("tiny", 2, 3, 1),
                                             ("kimi-k3", 8, 8, 4)])  # fmt: skip
def test_every_output_written_once(preset, tp, T, nsm):
    """With grids capped (few SMs, so CTAs loop over several items): every h element, every
    routed (pair, latent row) product and every shared output element is produced once."""
    _, (E, K, L, Ie, H, S) = _dims(preset, tp)
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[0] = ids[-1]  # an expert with at least two tokens
    se, so, sn, nact, pairs = mg.lists_from_ids(ids, E)
    op13 = mg.GroupedW13(T, E, K, L, Ie, 4.0, 25.0, nsm=nsm)
    op2 = mg.GroupedW2(T, E, K, L, Ie, H, S, nsm=nsm)
    if preset == "kimi-k3":  # the item loops are exercised (tiny: one item per CTA or fewer)
        assert op13.grid < nact * op13.NRT and op2.nr < nact * op2.CE
    h_out, acc_out, sh_out = _coverage(op13, op2, T, K, nact, sn.tolist())
    n_pairs = int(sn.sum())
    assert len(h_out) == n_pairs * Ie and set(h_out.values()) == {1}
    assert len(acc_out) == n_pairs * L and set(acc_out.values()) == {1}
    assert len(sh_out) == T * H and set(sh_out.values()) == {1}


def test_block_wiring_and_parts(monkeypatch):
    """``SpecializedMoE.experts`` launches route, w13, w2 (in that order, keys with the env
    choices) under ``DECODESCOPE_MOE_EXPERTS=grouped``, nothing of ``moe_experts``; and
    ``run_block_parts`` launches only the parts asked for (CPU: launches recorded, not run)."""
    from decodescope.kernels.specialized.moe_block import SpecializedMoE

    calls = []

    def fake_compiled(key, build):
        return lambda *a: calls.append(key[0])

    monkeypatch.setattr(itf, "compiled", fake_compiled)
    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")
    cfg = get_config("tiny", 1)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=1)
    blk = SpecializedMoE(cfg, w, 5)
    blk.experts()
    assert calls == ["moe_grouped_route", "moe_grouped_w13", "moe_grouped_w2"]
    assert blk._grouped_bufs.hs.shape == (5, cfg.shared_inter)
    for parts, want in (
        ((1,), ["moe_grouped_w13"]),
        ((0, 2), ["moe_grouped_route", "moe_grouped_w2"]),
    ):
        calls.clear()
        mg.run_block_parts(blk, parts)
        assert calls == want


@pytest.mark.parametrize("stages", [2, 3, 6])
def test_w2_ring_stages_compile(stages):
    """GroupedW2's ring at other depths (``DECODESCOPE_MOE_W2_STAGES``, an A/B knob)."""
    cfg, (E, K, L, Ie, H, S) = _dims("kimi-k3", 8)
    op, args = mg._build_w2(64, E, K, L, Ie, H, S, True, 132, "ring", stages)
    assert op.stages == stages
    assert itf.compile_only(op, *args) is not None


def test_w2_stages_knob(monkeypatch):
    monkeypatch.delenv("DECODESCOPE_MOE_W2_STAGES", raising=False)
    assert mg.w2_stages() == mg.W2_RING_STAGES == 3
    monkeypatch.setenv("DECODESCOPE_MOE_W2_STAGES", "3")
    assert mg.w2_stages() == 3
    for bad in ("0", "9", "x"):
        monkeypatch.setenv("DECODESCOPE_MOE_W2_STAGES", bad)
        with pytest.raises(ValueError, match="DECODESCOPE_MOE_W2_STAGES"):
            mg.w2_stages()
    with pytest.raises(ValueError, match="stages"):
        mg.GroupedW2(8, 32, 4, 128, 64, 128, 64, stages=0)


@pytest.mark.parametrize("front", ["tile", "mma", "simt"])
def test_block_chunked_front_back_experts_once(monkeypatch, front):
    """A block over N rows with ``chunk`` < N (a chunked step with the experts once): the front
    and back kernels launch once per row chunk on that chunk's row views, the grouped expert
    kernels once over all N rows (zeroing ``acc`` themselves after a ``tile`` front), and the
    result is the block's chained torch reference over all rows. CPU: each kernel function
    replaced by its torch reference, recording the rows it was given."""
    from decodescope.kernels.specialized import back_mma as bm
    from decodescope.kernels.specialized import front_mma as fm
    from decodescope.kernels.specialized import moe_block as mb
    from decodescope.kernels.specialized import up_proj_shared_add as up

    monkeypatch.setenv("DECODESCOPE_MOE_EXPERTS", "grouped")
    monkeypatch.setenv("DECODESCOPE_MOE_FRONT", front)
    monkeypatch.setenv("DECODESCOPE_MOE_BACK", "mma")
    cfg = get_config("tiny", 1)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=4)
    N, C = 6, 2
    blk = mb.SpecializedMoE(cfg, w, N, chunk=C)
    assert blk.chunks == 3 and blk.route_zeroes_acc() == (front == "tile")
    E, L = cfg.moe.num_experts, cfg.expert_dim
    calls: list[tuple[str, int]] = []

    def front_ref(x, w_front, y, acc=None, done=None, **kw):
        calls.append(("front", x.shape[0]))
        assert y.shape[0] == x.shape[0] and (acc is None or acc.shape[0] == x.shape[0])
        y.copy_(rt.front_gemv_ref(x, w_front))
        if acc is not None:
            acc.zero_()

    def experts_ref(y, bias, w13, w2, shared_w2, h, acc, shared_out, ids, tw, bufs, *, top_k,
                    scaling, beta, lbeta, zero_acc=False, **kw):  # fmt: skip
        calls.append(("experts", y.shape[0]))
        assert zero_acc == (front == "tile") and bufs.hs.shape[0] == N
        i, t = rt.router_topk_ref(y[:, :E], bias, top_k, scaling)
        a, s = mg.grouped_ref(y[:, E : E + L], y[:, E + L :], i, t, w13, w2, shared_w2, beta,
                              lbeta)  # fmt: skip
        acc.copy_(a)
        shared_out.copy_(s)
        ids.copy_(i)
        tw.copy_(t)

    def back_ref(acc, norm, w_up, shared_out, out, eps):
        calls.append(("back", acc.shape[0]))
        assert shared_out.shape[0] == out.shape[0] == acc.shape[0]
        out.copy_(up.up_proj_shared_add_ref(acc, norm, w_up, shared_out, eps))

    monkeypatch.setattr(fm, "front_tile", front_ref)
    monkeypatch.setattr(fm, "front_mma", front_ref)
    monkeypatch.setattr(rt, "front_gemv", front_ref)
    monkeypatch.setattr(mg, "moe_grouped", experts_ref)
    monkeypatch.setattr(bm, "back_mma", back_ref)
    gen = torch.Generator().manual_seed(2)
    h = torch.randn(N, cfg.hidden, generator=gen).to(torch.bfloat16)
    out = torch.full((N, cfg.hidden), float("nan"), dtype=torch.bfloat16)
    blk.acc.fill_(float("nan"))  # a front that zeroes must zero every chunk's rows
    if front == "tile":
        blk.acc.zero_()  # the route kernel zeroes it (replaced here by the reference)
    blk.forward(h, out)
    assert calls == [("front", C)] * 3 + [("experts", N)] + [("back", C)] * 3
    want, ids = mb.moe_block_ref(cfg, w, h)
    assert torch.equal(torch.sort(blk.topk_ids.long(), 1).values, torch.sort(ids.long(), 1).values)
    assert rel_l2(out, want) < 1e-2
    with pytest.raises(ValueError, match="chunk 4 must divide n_tokens 6"):
        mb.SpecializedMoE(cfg, w, N, chunk=4)
