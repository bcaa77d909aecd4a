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
    assert mg.route_mode() == "split"
    monkeypatch.setenv("DECODESCOPE_MOE_GROUPED_ROUTE", "radix")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_GROUPED_ROUTE"):
        mg.route_mode()
    with pytest.raises(ValueError, match="route top-k"):
        mg.GroupedRoute(8, 32, 4, 128, 64, 1.0, 4.0, 25.0, topk="radix")
