"""The grouped route kernel's threshold top-k (``kernels/specialized/route_topk.py``,
``DECODESCOPE_MOE_GROUPED_ROUTE=thresh``): its selection emulated in torch against
``router_topk_ref`` (random logits, ties, adversarial lanes, the fallback past ``CAP``
candidates); the route kernel compiled for sm_90a at the kimi-k3 TP8 / TP16 shapes (8, 32, 64
tokens) and the tiny preset."""

from __future__ import annotations

import pytest
import torch

from decodescope.kernels.config import get_config
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import moe_grouped as mg
from decodescope.kernels.specialized import route_topk as rk
from decodescope.kernels.specialized import router_topk as rt


def _sel(logits: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logits.float()) + bias.float()


def _ref_ids(sel: torch.Tensor, k: int) -> torch.Tensor:
    """Selection order of the kernels: larger value, then lower index (stable sort)."""
    return torch.sort(-sel.double(), dim=1, stable=True).indices[:, :k]


@pytest.mark.parametrize("E,k,T", [(896, 16, 64), (32, 4, 13), (64, 8, 9), (896, 32, 8)])
def test_emulation_matches_reference_random(E, k, T):
    g = torch.Generator().manual_seed(E + k + T)
    logits = 3 * torch.randn(T, E, generator=g)
    bias = 0.1 * torch.randn(E, generator=g)
    sel = _sel(logits, bias)
    ids, n, fb = rk.thresh_topk_emulate(sel, k)
    assert torch.equal(ids, _ref_ids(sel, k))
    assert bool((n >= k).all())
    if E == 896 and k == 16:  # few candidates for random logits: the fast path
        assert not bool(fb.any()) and int(n.max()) <= rk.CAP
    # the set equals router_topk_ref's (which ranks in float64: same order barring ties)
    ids_r, _ = rt.router_topk_ref(logits, bias, k)
    assert torch.equal(ids.sort(1).values, ids_r.long().sort(1).values)


def test_emulation_ties_and_adversarial():
    E, k = 896, 16
    # exact ties everywhere: every expert is a candidate -> the fallback, lower index first
    sel = torch.zeros(3, E)
    ids, n, fb = rk.thresh_topk_emulate(sel, k)
    assert bool(fb.all()) and torch.equal(ids[0], torch.arange(k))
    # ties across the threshold: quantized scores (many equal values)
    g = torch.Generator().manual_seed(7)
    sel = torch.randint(0, 40, (32, E), generator=g).float() / 40
    ids, n, fb = rk.thresh_topk_emulate(sel, k)
    assert torch.equal(ids, _ref_ids(sel, k))
    # one lane holds all the large scores (experts 5 + 32 i): the lane maxima say little
    sel = torch.rand(4, E, generator=g)
    sel[:, 5::32] += 10.0
    ids, n, fb = rk.thresh_topk_emulate(sel, k)
    assert torch.equal(ids, _ref_ids(sel, k))
    # a large bias on a block of experts
    sel = torch.rand(4, E, generator=g)
    sel[:, 100:140] += 1.0
    ids, n, fb = rk.thresh_topk_emulate(sel, k)
    assert torch.equal(ids, _ref_ids(sel, k))
    # just past the candidate cap: the fallback gives the same ids
    sel = torch.rand(2, E, generator=g)
    sel[:, : rk.CAP + 1] = 5.0
    ids, n, fb = rk.thresh_topk_emulate(sel, k)
    assert bool(fb.all()) and torch.equal(ids, _ref_ids(sel, k))


def _dims(tp: int, preset: str = "kimi-k3"):
    cfg = get_config(preset, tp)
    e = cfg.moe
    return cfg, (e.num_experts, e.top_k, cfg.expert_dim, cfg.shared_inter)


@pytest.mark.parametrize(
    "preset,tp,T",
    [("kimi-k3", 8, 8), ("kimi-k3", 8, 32), ("kimi-k3", 8, 64), ("kimi-k3", 16, 8),
     ("kimi-k3", 16, 32), ("kimi-k3", 16, 64), ("tiny", 1, 3), ("tiny", 1, 13)],
)  # fmt: skip
def test_thresh_route_compiles(preset, tp, T):
    cfg, (E, K, L, S) = _dims(tp, preset)
    op, args = mg._build_route(T, E, K, L, S, 1.0, 4.0, 25.0, True, True, "thresh")
    assert op.topk == "thresh" and op.NTK == -(-T // op.NW) and op.split == (op.NTK > 1)
    assert itf.compile_only(op, *args) is not None


def test_route_mode_env(monkeypatch):
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_ROUTE", "thresh")
    assert mg.route_mode() == "thresh" and mg.route_split()
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_ROUTE", "one")
    assert mg.route_mode() == "one" and not mg.route_split()
    monkeypatch.delenv("DECODESCOPE_MOE_GROUPED_ROUTE")
    assert mg.route_mode() == "thresh"  # the default since the H200 A/B of s8/r4
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_ROUTE", "radix")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_GROUPED_ROUTE"):
        mg.route_mode()
    with pytest.raises(ValueError, match="route top-k"):
        mg.GroupedRoute(8, 32, 4, 128, 64, 1.0, 4.0, 25.0, topk="radix")


def _run_route(y, bias, T, E, K, L, S, split, topk, bufs):
    """The route kernel alone on ``y [T, E + L + 2S]``: ``(ids, tw)`` (lists in ``bufs``)."""
    dev = y.device
    key = ("test_route_topk", T, E, K, L, S, split, topk)
    fn = itf.compiled(key, lambda: mg._build_route(T, E, K, L, S, 1.0, 4.0, 25.0, True, split,
                                                   topk))  # fmt: skip
    ids = torch.full((T * K,), -1, dtype=torch.int32, device=dev)
    tw = torch.full((T * K,), float("nan"), dtype=torch.float32, device=dev)
    acc = torch.empty(T * L, dtype=torch.float32, device=dev)  # the route's acc (not zeroed)
    b = bufs
    for _ in range(3):  # the split's arrival counter resets itself
        fn(y, bias, ids, tw, b.pairs, b.slot_e, b.slot_off, b.slot_n, b.nact, b.hs, b.ctr,
           acc)  # fmt: skip
    torch.cuda.synchronize()
    return ids.view(T, K).cpu(), tw.view(T, K).cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("tp,T", [(8, 8), (8, 64), (16, 32), (8, 13)])
@pytest.mark.parametrize("inputs", ["random", "ties"])
def test_thresh_route_identical_on_gpu(tp, T, inputs):
    """``thresh`` against the rounds of ``split``: ids and weights bit for bit, lists equal to
    ``lists_from_ids``; ``ties``: logits in quarters, zero bias, token 0 all tied (fallback)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    cfg, (E, K, L, S) = _dims(tp)
    g = torch.Generator().manual_seed(T + tp)
    y = torch.randn(T, E + L + 2 * S, generator=g)
    bias = 0.1 * torch.randn(E, generator=g)
    if inputs == "ties":
        y[:, :E] = torch.round(y[:, :E] * 4) / 4
        y[0, :E] = 0.0
        bias.zero_()
    y, bias = y.to(dev), bias.to(dev)
    out = {}
    for topk in ("rounds", "thresh"):
        bufs = mg.GroupedBuffers(T, E, K, S, dev)
        out[topk] = (*_run_route(y, bias, T, E, K, L, S, True, topk, bufs), bufs)
    (ia, wa, _), (ib, wb, b) = out["rounds"], out["thresh"]
    assert torch.equal(ia, ib)
    assert torch.equal(wa.view(torch.int32), wb.view(torch.int32))
    se, so, sn, nact, pairs = mg.lists_from_ids(ib, E)
    assert int(b.nact[0]) == nact
    gso, gsn = b.slot_off[:nact].cpu(), b.slot_n[:nact].cpu()
    assert torch.equal(b.slot_e[:nact].cpu(), se)
    assert torch.equal(gso, so) and torch.equal(gsn, sn)
    assert torch.equal(mg.canonical_pairs(b.pairs.cpu(), gso, gsn), pairs)
    ids_r, tw_r = rt.router_topk_ref(y[:, :E].cpu(), bias.cpu(), K)
    if inputs == "random":  # float64 reference: a near-tie at the K-th place may differ
        rows = (ib.sort(1).values == ids_r.sort(1).values).all(1)
        assert float(rows.float().mean()) >= 0.95
        assert float((wb[rows] - tw_r[rows]).abs().max()) < 1e-5
