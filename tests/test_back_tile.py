"""The LatentMoE back on the tile GEMM (``back_tile``, ``DECODESCOPE_MOE_BACK=tile``, issue #5).

On the CPU: sm_90a compiles (``CUTE_DSL_ARCH`` set by the package, no GPU) at the kimi-k3 TP8 /
TP16 shapes (the back's L and H are replicated: the same at both) at 32 and 64 tokens, plus 8,
13 tokens and the tiny preset; the plan's geometry and knobs; the selection; the block's wiring
with fake launches; the function in torch (the kernel's arithmetic against
``up_proj_shared_add_ref``); and an emulation of the kernel's shared-memory index math (copy,
in-place conversion, B-fragment reads). The GPU checks: the ``gpu`` test below and
``scripts/gpu_back_tile.py``.
"""

from __future__ import annotations

import pytest
import torch

# the package first: it sets CUTE_DSL_ARCH=sm_90a before anything imports cutlass
from decodescope.kernels import specialized  # noqa: F401
from decodescope.kernels.config import LayerSpec, get_config  # noqa: E402
from decodescope.kernels.reference import rel_l2  # noqa: E402
from decodescope.kernels.specialized import back_mma as bm  # noqa: E402
from decodescope.kernels.specialized import back_tile as bt  # noqa: E402
from decodescope.kernels.specialized import interface as itf  # noqa: E402
from decodescope.kernels.specialized import moe_block as mb  # noqa: E402
from decodescope.kernels.specialized import tile_gemm as tg  # noqa: E402
from decodescope.kernels.specialized.up_proj_shared_add import up_proj_shared_add_ref  # noqa: E402
from decodescope.kernels.weights import make_layer_weights  # noqa: E402

KNOB_VARS = ("DECODESCOPE_MOE_BACK_TILE_STAGES", "DECODESCOPE_MOE_BACK_TILE_SPLITS",
             "DECODESCOPE_MOE_BACK_TILE_WARPS", "DECODESCOPE_MOE_BACK_TILE_ACT",
             "DECODESCOPE_MOE_BACK_TILE_FRAG")  # fmt: skip


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for v in (*KNOB_VARS, "DECODESCOPE_MOE_BACK", bt.LATE_ENV):
        monkeypatch.delenv(v, raising=False)


def _dims(preset: str, tp: int):
    cfg = get_config(preset, tp)
    return cfg, cfg.expert_dim, cfg.hidden


@pytest.mark.parametrize("preset,tp,T", [("kimi-k3", 8, 32), ("kimi-k3", 8, 64),
                                         ("kimi-k3", 16, 32), ("kimi-k3", 16, 64),
                                         ("kimi-k3", 8, 8), ("kimi-k3", 8, 13),
                                         ("tiny", 1, 5)])  # fmt: skip
def test_back_tile_compiles(preset, tp, T):
    cfg, L, H = _dims(preset, tp)
    bp = bt.plan_for(T, L, H, cfg.eps)
    assert bp.smem_bytes <= 227 * 1024
    assert itf.compile_only(bt.BackTile(bp), *bt._fake_args(bp)) is not None


@pytest.mark.parametrize("knobs", [dict(stages=4, splits=7), dict(stages=2, warps=8),
                                   dict(warps=2, splits=2), dict(act="regs"),
                                   dict(act="regs", stages=5),
                                   dict(warps=8, splits=4, stages=4),
                                   dict(act="regs", warps=8, splits=4, stages=5),
                                   dict(lean=True), dict(act="regs", lean=True),
                                   dict(act="regs", ldsm=True, stages=5),
                                   dict(act="regs", ldsm=True, warps=8, splits=4),
                                   dict(act="regs", ldsm=True, splits=7, stages=3),
                                   dict(act="regs", ldsm=True, warps=8, splits=7, stages=2),
                                   dict(act="smem", ldsm=True),
                                   dict(act="smem", ldsm=True, warps=8, splits=7, stages=2)])  # fmt: skip
def test_back_tile_knobs_compile(knobs):
    bp = bt.BackPlan(m=64, k=3584, n=7168, eps=1e-5, **knobs)
    assert itf.compile_only(bt.BackTile(bp), *bt._fake_args(bp)) is not None


def test_back_plan_geometry():
    """TP8 at 64 tokens: 56 row tiles x 4 splits (224 CTAs, 14 chunks each) with 3 stages (two
    CTAs per SM); at 32 tokens 4 stages fit two per SM."""
    p64 = bt.BackPlan(m=64, k=3584, n=7168, eps=1e-5)
    t = p64.tile
    assert (t.row_ctas, t.splits, t.chunks, p64.nstages) == (56, 4, 14, 3)
    assert 2 * (p64.smem_bytes + 1024) <= bt.SM_SMEM
    assert p64.ws_shape == (4 * 64, 56 * 128) and p64.ssq_size == 56 * 4 * 64
    p32 = bt.BackPlan(m=32, k=3584, n=7168, eps=1e-5)
    assert p32.nstages == 4 and 2 * (p32.smem_bytes + 1024) <= bt.SM_SMEM
    assert bt.BackPlan(m=64, k=3584, n=7168, eps=1e-5, stages=4).smem_bytes > 128 * 1024
    r64 = bt.BackPlan(m=64, k=3584, n=7168, eps=1e-5, act="regs")  # FP32 in registers
    assert r64.nstages == 4 and 2 * (r64.smem_bytes + 1024) <= bt.SM_SMEM
    assert r64.x_floats == 64 * 64  # the BF16 double buffer
    with pytest.raises(ValueError, match="act"):
        bt.BackPlan(m=8, k=3584, n=7168, eps=1e-5, act="tma")
    with pytest.raises(ValueError, match="warps"):
        bt.BackPlan(m=8, k=3584, n=7168, eps=1e-5, warps=3)
    with pytest.raises(ValueError, match="1..64 tokens"):
        bt.BackPlan(m=65, k=3584, n=7168, eps=1e-5)
    with pytest.raises(ValueError, match="multiple of 64"):
        bt.BackPlan(m=8, k=3584 + 32, n=7168, eps=1e-5)


@pytest.mark.parametrize("T", [8, 13, 32])
def test_back_tile_ldsm_smem_compiles(T):
    bp = bt.BackPlan(m=T, k=3584, n=7168, eps=1e-5, act="smem", ldsm=True)
    assert itf.compile_only(bt.BackTile(bp), *bt._fake_args(bp)) is not None


@pytest.mark.parametrize("T", [8, 13, 32])
@pytest.mark.parametrize("frag", [{}, {"lean": True}, {"ldsm": True}])
def test_back_tile_regs_compiles(T, frag):
    bp = bt.BackPlan(m=T, k=3584, n=7168, eps=1e-5, act="regs", **frag)
    assert itf.compile_only(bt.BackTile(bp), *bt._fake_args(bp)) is not None


def test_back_tile_ldsm_tiny_compiles():
    bp = bt.BackPlan(m=5, k=128, n=256, eps=1e-5, act="regs", ldsm=True)
    assert itf.compile_only(bt.BackTile(bp), *bt._fake_args(bp)) is not None


@pytest.mark.parametrize("T,kw", [(64, {}), (33, {"act": "regs", "ldsm": True, "wgmma": True}),
                                  (13, {"act": "smem"}), (8, {"act": "regs"})])  # fmt: skip
def test_back_tile_cluster_compiles(T, kw):
    """The cluster split-K (``tile_gemm.TilePlan.cluster``) in the back tile: the splits'
    partials and sums of squares read over distributed shared memory between two cluster
    barriers, no counter atomics, at both activation paths and with wgmma."""
    bp = bt.BackPlan(m=T, k=3584, n=7168, eps=1e-5, cluster=True, **kw)
    t = bp.tile
    assert bp.cluster and t.cluster and 2 <= t.splits <= tg.CLUSTER_MAX
    ptx = itf.ptx_text(bt.BackTile(bp), *bt._fake_args(bp))
    per = -(-T // t.splits) * (t.cta_rows // 4)
    assert ptx.count("ld.shared::cluster") == 2 * -(-per // t.threads) * t.splits
    assert ptx.count("barrier.cluster.arrive") == ptx.count("barrier.cluster.wait") == 2
    assert "atom." not in ptx
    assert itf.compile_only(bt.BackTile(bp), *bt._fake_args(bp)) is not None


def test_back_tile_cluster_plan(monkeypatch):
    monkeypatch.delenv(tg.CLUSTER_ENV, raising=False)
    assert bt.plan_for(64, 3584, 7168, 1e-5).cluster == (tg.CLUSTER_MIN_M is not None)
    monkeypatch.setenv(tg.CLUSTER_ENV, "1")
    assert bt.plan_for(64, 3584, 7168, 1e-5).cluster
    assert not bt.plan_for(64, 3584, 7168, 1e-5, splits=14).cluster  # 14 > a cluster's 8
    with pytest.raises(ValueError, match="cluster needs"):
        bt.BackPlan(m=64, k=3584, n=7168, eps=1e-5, splits=14, cluster=True)
    monkeypatch.setenv(tg.CLUSTER_ENV, "0")
    assert not bt.plan_for(64, 3584, 7168, 1e-5).cluster


@pytest.mark.parametrize("T,k,n", [(64, 3584, 7168), (33, 3584, 7168), (8, 3584, 7168),
                                   (5, 128, 256)])  # fmt: skip
def test_back_tile_wgmma_compiles(T, k, n):
    """The warpgroup-MMA path (ldsm layouts, the BF16 double buffer as B) compiles for sm_90a;
    two CTAs per SM still fit at 64 tokens."""
    bp = bt.BackPlan(m=T, k=k, n=n, eps=1e-5, act="regs", ldsm=True, wgmma=True)
    assert bp.tile.wgmma
    assert T < 64 or 2 * (bp.smem_bytes + 1024) <= bt.SM_SMEM
    assert itf.compile_only(bt.BackTile(bp), *bt._fake_args(bp)) is not None


def _mma_bounds(ptx: str) -> tuple[int, int]:
    idx = [i for op in ("wgmma.mma_async", "mma.sync") for i in (ptx.find(op), ptx.rfind(op))
           if i >= 0]  # fmt: skip
    return min(idx), max(idx)


@pytest.mark.parametrize("T,kw", [(64, {}), (32, {}), (64, {"cluster": False}), (8, {})])
def test_back_tile_trigger_ptx(T, kw):
    """``DECODESCOPE_MOE_BACK_LATE`` in the tile back (its plan's ``trigger``): one wait and one
    trigger after it; by default (``wait``) before the first MMA; ``main`` after the last MMA
    (before the cluster's or the last CTA's reduction); ``issued`` inside the main loop, on the
    iteration that issues the CTA's last chunk (after its refill copies). The first weight
    chunks stay before the wait."""
    for trig in bt.TRIGGERS:
        bp = bt.plan_for(T, 3584, 7168, 1e-5, trigger=trig, **kw)
        assert bp.trigger == trig
        ptx = itf.ptx_text(bt.BackTile(bp), *bt._fake_args(bp))
        assert ptx.count("griddepcontrol.wait") == 1
        assert ptx.count("griddepcontrol.launch_dependents") == 1
        wait = ptx.index("griddepcontrol.wait")
        pos = ptx.index("griddepcontrol.launch_dependents")
        first, last = _mma_bounds(ptx)
        assert "cp.async" in ptx[:wait]
        assert wait < pos
        copies_between = "cp.async" in ptx[wait:pos]
        if trig == "wait":  # right after the wait: the activations' copies come after it
            assert pos < first and not copies_between
        elif trig == "main":
            assert pos > last
        else:  # in the loop body after its refill copies, before that iteration's MMAs
            assert copies_between and pos < last


def test_back_tile_trigger_plan(monkeypatch):
    """The knob reaches the plan (and so the compile key) through ``plan_for``."""
    assert bt.plan_for(64, 3584, 7168, 1e-5).trigger == "wait"
    monkeypatch.setenv(bt.LATE_ENV, "auto")
    assert bt.plan_for(64, 3584, 7168, 1e-5).trigger == "main"
    assert bt.plan_for(4, 3584, 7168, 1e-5).trigger == "wait"
    monkeypatch.setenv(bt.LATE_ENV, "issued")
    assert bt.plan_for(4, 3584, 7168, 1e-5).trigger == "issued"
    assert bm.back_trigger is bt.back_trigger and bm.LATE_ENV == bt.LATE_ENV
    with pytest.raises(ValueError, match="trigger"):
        bt.BackPlan(m=64, k=3584, n=7168, eps=1e-5, trigger="late")


def test_back_tile_wgmma_plan(monkeypatch):
    monkeypatch.delenv("DECODESCOPE_TILE_WGMMA", raising=False)
    assert bt.plan_for(64, 3584, 7168, 1e-5).wgmma  # the tile GEMM's rule: from 32 tokens
    assert not bt.plan_for(32, 3584, 7168, 1e-5).wgmma  # k16 fragments at 32 (LDSM_ABOVE)
    monkeypatch.setenv("DECODESCOPE_TILE_WGMMA", "0")
    assert not bt.plan_for(64, 3584, 7168, 1e-5).wgmma
    monkeypatch.setenv("DECODESCOPE_TILE_WGMMA", "1")
    assert bt.plan_for(64, 3584, 7168, 1e-5).wgmma  # ldsm + regs above 32 tokens
    assert not bt.plan_for(16, 3584, 7168, 1e-5).wgmma  # k16 fragments there
    with pytest.raises(ValueError, match="wgmma needs ldsm"):
        bt.BackPlan(m=64, k=3584, n=7168, eps=1e-5, act="smem", wgmma=True)
    monkeypatch.setenv("DECODESCOPE_TILE_WGMMA", "0")
    assert not bt.plan_for(64, 3584, 7168, 1e-5).wgmma


def test_back_tile_knobs_env(monkeypatch):
    assert bt.knobs() == {
        "stages": 0, "splits": 0, "warps": 4, "act": "smem", "lean": False, "ldsm": False,
    }  # fmt: skip
    assert bt.knobs(32) == bt.knobs()  # k16 up to 32 tokens
    assert bt.knobs(64) == {
        "stages": 0,
        "splits": 0,
        "warps": 4,
        "act": "regs",
        "lean": False,
        "ldsm": True,
    }  # fmt: skip  (ldsm above 32: H200 s9/r4)
    p64 = bt.plan_for(64, 3584, 7168, 1e-5)
    assert p64.ldsm and p64.act == "regs" and p64.nstages == 4
    assert not bt.plan_for(64, 3584, 7168, 1e-5, act="smem").ldsm  # a variant's own choice
    assert not bt.plan_for(64, 3584, 7168, 1e-5, lean=True).ldsm
    assert bt.plan_for(64, 3584, 7168, 1e-5, stages=3).ldsm
    monkeypatch.setenv("DECODESCOPE_MOE_BACK_TILE_STAGES", "4")
    monkeypatch.setenv("DECODESCOPE_MOE_BACK_TILE_SPLITS", "7")
    bp = bt.plan_for(64, 3584, 7168, 1e-5)
    assert (bp.nstages, bp.tile.splits) == (4, 7)
    monkeypatch.setenv("DECODESCOPE_MOE_BACK_TILE_ACT", "regs")
    assert bt.plan_for(64, 3584, 7168, 1e-5).act == "regs"
    monkeypatch.setenv("DECODESCOPE_MOE_BACK_TILE_ACT", "tma")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_BACK_TILE_ACT"):
        bt.knobs()
    monkeypatch.delenv("DECODESCOPE_MOE_BACK_TILE_ACT")
    monkeypatch.setenv("DECODESCOPE_MOE_BACK_TILE_FRAG", "ldsm")
    bp = bt.plan_for(64, 3584, 7168, 1e-5)
    assert bp.ldsm and bp.act == "regs" and not bp.lean
    monkeypatch.setenv("DECODESCOPE_MOE_BACK_TILE_FRAG", "lean")
    assert bt.plan_for(64, 3584, 7168, 1e-5).lean
    monkeypatch.setenv("DECODESCOPE_MOE_BACK_TILE_FRAG", "wgmma")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_BACK_TILE_FRAG"):
        bt.knobs()
    monkeypatch.setenv("DECODESCOPE_MOE_BACK_TILE_FRAG", "ldsm_smem")
    bp = bt.plan_for(64, 3584, 7168, 1e-5)
    assert bp.ldsm and bp.act == "smem"
    monkeypatch.delenv("DECODESCOPE_MOE_BACK_TILE_FRAG")
    with pytest.raises(ValueError, match="ldsm needs H"):
        bt.BackPlan(m=8, k=3584, n=7168 + 16, eps=1e-5, act="regs", ldsm=True)
    monkeypatch.setenv("DECODESCOPE_MOE_BACK_TILE_WARPS", "five")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_BACK_TILE_WARPS"):
        bt.knobs()


def test_back_variant_tile(monkeypatch):
    assert bt.TILE_FROM == 32  # the default from the H200 A/B (s9/r2)
    assert [bm.back_variant(T, 3584, 7168) for T in (1, 16, 31, 32, 64)] == [
        "mma", "mma", "mma", "tile", "tile",
    ]  # fmt: skip
    monkeypatch.setattr(bt, "TILE_FROM", None)  # off: BackMma everywhere
    assert [bm.back_variant(T, 3584, 7168) for T in (1, 32, 64)] == ["mma"] * 3
    monkeypatch.setenv("DECODESCOPE_MOE_BACK", "tile")
    assert bm.back_variant(32, 3584, 7168) == "tile"
    monkeypatch.setenv("DECODESCOPE_MOE_BACK", "auto")
    monkeypatch.setattr(bt, "TILE_FROM", 32)
    assert [bm.back_variant(T, 3584, 7168) for T in (8, 31, 32, 64, 65)] == [
        "mma", "mma", "tile", "tile", "simt",
    ]  # fmt: skip
    assert bm.back_variant(64, 3584 + 32, 7168) == "mma"  # L not a multiple of 64
    monkeypatch.setenv("DECODESCOPE_MOE_BACK", "tiles")
    with pytest.raises(ValueError, match="DECODESCOPE_MOE_BACK"):
        bm.back_variant(8, 3584, 7168)


def test_tp2_keeps_the_tile_back_unfused(monkeypatch):
    """tp_world 2: the tile back, like BackMma, runs unfused (NCCL all-reduces + the single-GPU
    kernel) from 8 tokens, not the fused SIMT kernel."""
    from decodescope.kernels.specialized import tp2

    assert tp2.moe_back_unfused(64, 3584, 7168) and tp2.moe_back_unfused(32, 3584, 7168)
    monkeypatch.setenv("DECODESCOPE_MOE_BACK", "tile")
    assert tp2.moe_back_unfused(8, 3584, 7168)
    assert not tp2.moe_back_unfused(4, 3584, 7168)  # below 8 the fused kernel stays


def test_back_tile_rejects_bad_shapes():
    acc = torch.zeros(8, 96)
    nw = torch.zeros(96, dtype=torch.bfloat16)
    up = torch.zeros(64, 96, dtype=torch.bfloat16)
    sh = torch.zeros(8, 64)
    out = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="back_tile: needs"):
        bt.back_tile(acc, nw, up, sh, out, 1e-5)
    with pytest.raises(ValueError, match="shared_out"):
        bt.back_tile(torch.zeros(8, 128), torch.zeros(128, dtype=torch.bfloat16),
                     torch.zeros(64, 128, dtype=torch.bfloat16), sh.T, out, 1e-5)  # fmt: skip


class _Launches:
    """``itf.compiled`` stand-in: records (key, args) of every launch, runs nothing."""

    def __init__(self):
        self.calls: list[tuple[tuple, tuple]] = []

    def compiled(self, key, build):
        return lambda *a: self.calls.append((key, a))


def test_block_wiring_tile(monkeypatch):
    """``DECODESCOPE_MOE_BACK=tile``: the block's back is one ``moe_back_tile`` launch on its own
    ``acc`` / ``shared_out`` with the plan's workspace; the default: BackMma below 32 tokens, the
    tile back from 32."""
    rec = _Launches()
    monkeypatch.setattr(itf, "compiled", rec.compiled)
    cfg = get_config("tiny", 1)
    w = make_layer_weights(cfg, LayerSpec(1, "kda", "moe"), seed=1)
    blk = mb.SpecializedMoE(cfg, w, 8)
    out = torch.empty(8, cfg.hidden, dtype=torch.bfloat16)
    blk.back(out)
    assert rec.calls[-1][0][0] == "moe_back_mma"  # 8 tokens: BackMma
    blk32 = mb.SpecializedMoE(cfg, w, 32)
    blk32.back(torch.empty(32, cfg.hidden, dtype=torch.bfloat16))
    assert rec.calls[-1][0][0] == "moe_back_tile"  # auto from 32 tokens
    monkeypatch.setenv("DECODESCOPE_MOE_BACK", "tile")
    blk.back(out)
    key, args = rec.calls[-1]
    assert key[0] == "moe_back_tile" and key[1] == bt.plan_for(8, cfg.expert_dim, cfg.hidden,
                                                               cfg.eps)  # fmt: skip
    assert args[0] is blk.acc and args[1] is blk.latent_norm and args[2] is blk.latent_up
    assert args[3] is blk.shared_out and args[4] is out
    ws, ssq, cnt = bt.workspace(key[1], out.device)
    assert args[5] is ws and args[6] is ssq and args[7] is cnt


def test_back_tile_ref_matches_reference():
    """The kernel's arithmetic (``bf16(acc * w)`` into the MMAs, rstd in the epilogue, K split
    in 4) against ``up_proj_shared_add_ref`` (``bf16(acc * rstd * w)``): the same function within
    BF16 rounding (BackMma's post-norm bound), tokens of very different scales."""
    g = torch.Generator().manual_seed(0)
    T, L, H, eps = 16, 3584, 512, 1e-5
    acc = torch.randn(T, L, generator=g) * torch.logspace(-2, 2, T).unsqueeze(1)
    w = (1 + 0.1 * torch.randn(L, generator=g)).to(torch.bfloat16)
    up = (torch.randn(H, L, generator=g) / L**0.5).to(torch.bfloat16)
    sh = torch.randn(T, H, generator=g)
    ref = up_proj_shared_add_ref(acc, w, up, sh, eps)
    for splits in (1, 4):
        out = bt.back_tile_ref(acc, w, up, sh, eps, splits=splits)
        assert rel_l2(out, ref) < 4e-3
        for t in range(T):  # every token alone (its own rstd)
            assert rel_l2(out[t], ref[t]) < 6e-3, t


def _bf16_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).view(torch.uint8)


@pytest.mark.parametrize("T,threads", [(64, 128), (32, 128), (13, 128), (8, 256), (64, 64)])
def test_shared_memory_index_math(T, threads):
    """Emulates one chunk of one CTA byte by byte with the kernel's formulas: the ``cp.async``
    placement (``load_acc``), each thread converting its own units in place (``convert``, in
    thread order: a write into a unit another thread still has to read would show), then every
    lane's B fragment (``compute_b``) equals columns ``32h + 8c .. + 7`` of ``bf16(acc * w)``,
    the columns its A fragment (the weights, ``tile_gemm``'s permutation) multiplies."""
    g = torch.Generator().manual_seed(T)
    MP = (T + 7) // 8 * 8
    U16 = bt.UNITS
    acc = torch.randn(MP, 64, generator=g)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    want = (acc * w.float()).to(torch.bfloat16)
    sm = torch.full((MP, 256), 0xFF, dtype=torch.uint8)  # one stage, 256 bytes per token row
    units = MP * U16
    slots = -(-units // threads)
    for tid in range(threads):  # load_acc
        for q in range(slots):
            idx = tid + q * threads
            r, u = idx // U16, tid % U16
            assert u == idx % U16
            if idx < units and r < T:
                pu = u ^ (r % 2)
                sm[r, 16 * pu : 16 * pu + 16] = acc[r, 4 * u : 4 * u + 4].view(torch.uint8)
    for tid in range(threads):  # convert
        u = tid % U16
        for q in range(slots):
            idx = tid + q * threads
            r = idx // U16
            if idx < units and r < T:
                pu = u ^ (r % 2)
                xf = sm[r, 16 * pu : 16 * pu + 16].view(torch.float32)
                assert torch.equal(xf, acc[r, 4 * u : 4 * u + 4]), (tid, q)
                xb = _bf16_bytes(xf * w[4 * u : 4 * u + 4].float())
                o = 8 * (2 * pu + (r // 2) % 2)
                sm[r, o : o + 8] = xb
    for lane in range(32):  # compute_b
        g_, c = lane // 4, lane % 4
        for h in range(2):
            U = 4 * h + c
            for j in range(MP // 8):
                r = 8 * j + g_
                if r >= T:
                    continue
                parts = []
                for uu in (2 * U, 2 * U + 1):
                    o = 8 * (2 * (uu ^ (g_ % 2)) + (g_ // 2) % 2)
                    parts.append(sm[r, o : o + 8].view(torch.bfloat16))
                got = torch.cat(parts)
                assert torch.equal(got, want[r, 32 * h + 8 * c : 32 * h + 8 * c + 8]), (lane, h, j)


@pytest.mark.parametrize("T,threads", [(64, 128), (13, 128), (8, 256)])
def test_shared_memory_index_math_regs(T, threads):
    """``act="regs"``: each thread's registers hold the units ``load_acc_regs`` loads;
    ``convert_regs`` writes their BF16 into tile_gemm's activation layout, where every lane's
    16-byte B read (``compute_b``, ``tile_gemm.TileGemm.compute``'s unit) finds columns
    ``32h + 8c .. + 7``; no byte written twice."""
    g = torch.Generator().manual_seed(T)
    MP = (T + 7) // 8 * 8
    U16 = bt.UNITS
    acc = torch.randn(MP, 64, generator=g)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    want = (acc * w.float()).to(torch.bfloat16)
    sm = torch.full((MP, 128), 0xFF, dtype=torch.uint8)  # one BF16 slot, 128 bytes per row
    written = torch.zeros(MP, 128, dtype=torch.int32)
    units = MP * U16
    for tid in range(threads):
        u = tid % U16
        for q in range(-(-units // threads)):
            idx = tid + q * threads
            r = idx // U16
            if idx < units and r < T:
                xf = acc[r, 4 * u : 4 * u + 4]  # load_acc_regs: columns kc * 64 + 4u ..
                pu = (u // 2 + 4 * (r % 2)) % 8
                o = 8 * (2 * pu + u % 2)
                sm[r, o : o + 8] = _bf16_bytes(xf * w[4 * u : 4 * u + 4].float())
                written[r, o : o + 8] += 1
    assert int(written.max()) == 1
    for lane in range(32):
        g_, c = lane // 4, lane % 4
        for h in range(2):
            pu = (4 * h + c + 4 * (g_ % 2)) % 8
            for j in range(MP // 8):
                r = 8 * j + g_
                if r < T:
                    got = sm[r, 16 * pu : 16 * pu + 16].view(torch.bfloat16)
                    assert torch.equal(got, want[r, 32 * h + 8 * c : 32 * h + 8 * c + 8])


def _ldsm(sm_rows: torch.Tensor, addrs: list[tuple[int, int]], nmat: int) -> list[list]:
    """``ldmatrix`` on an emulated buffer (``sm_rows[row]`` = 128 bytes): matrix m's 8 rows
    from the (row, byte offset) of lanes 8m .. 8m + 7; lane t gets row t // 4, BF16 elements
    2 (t % 4) .. + 1 of each matrix (as a pair of BF16)."""
    mats = []
    for m in range(nmat):
        rows = []
        for i in range(8):
            r, o = addrs[8 * m + i]
            rows.append(sm_rows[r, o : o + 16].view(torch.bfloat16))
        mats.append(rows)
    return [[mats[m][t // 4][2 * (t % 4) : 2 * (t % 4) + 2] for m in range(nmat)]
            for t in range(32)]  # fmt: skip


@pytest.mark.parametrize("act", ["regs", "smem"])
@pytest.mark.parametrize("T,warps", [(64, 4), (13, 4), (8, 8), (32, 2)])
def test_ldsm_fragments(T, warps, act):
    """``frag="ldsm"``: the weights as ``load_w_lean`` places them (unit ``u ^ (r % 8)``) and the
    activations as ``convert_regs`` writes them (the same XOR), read with ``compute_ldsm``'s lane
    addresses through an emulated ``ldmatrix``, give every lane the m16n8k16 fragments of the
    natural K order: A (row g, k 2c..), (g + 8, 2c..), (g, 2c + 8..), (g + 8, 2c + 8..) and
    B (token g, k 2c..), (g, 2c + 8..) of each 16-wide K step."""
    g = torch.Generator().manual_seed(T + warps)
    MP = (T + 7) // 8 * 8
    rows = warps * 32
    W = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    acc = torch.randn(MP, 64, generator=g)
    nw = (1 + 0.1 * torch.randn(64, generator=g)).to(torch.bfloat16)
    X = (acc * nw.float()).to(torch.bfloat16)
    sw = torch.zeros(rows, 128, dtype=torch.uint8)
    nt = warps * 32
    for tid in range(nt):  # load_w_lean, one chunk
        wr, wu = tid // 8, tid % 8
        for i in range(rows // (nt // 8)):
            r = wr + i * (nt // 8)
            assert r % 8 == wr % 8
            o = 16 * (wu ^ (wr % 8))
            sw[r, o : o + 16] = W[r, 8 * wu : 8 * wu + 8].view(torch.uint8)
    slots = -(-(MP * bt.UNITS) // nt)
    if act == "regs":
        sx = torch.zeros(MP, 128, dtype=torch.uint8)
    else:  # the FP32 stage as load_acc places it (unit u of row r at u ^ (r % 2))
        sx = torch.zeros(MP, 256, dtype=torch.uint8)
        for tid in range(nt):
            u = tid % bt.UNITS
            for q in range(slots):
                idx = tid + q * nt
                r = idx // bt.UNITS
                if idx < MP * bt.UNITS and r < T:
                    o = 16 * (u ^ (r % 2))
                    sx[r, o : o + 16] = acc[r, 4 * u : 4 * u + 4].view(torch.uint8)
    vals = {}  # convert_regs / convert_packed: every thread's values first (the warp barrier)
    for tid in range(nt):
        u = tid % bt.UNITS
        for q in range(slots):
            idx = tid + q * nt
            r = idx // bt.UNITS
            if idx < MP * bt.UNITS and r < T:
                if act == "regs":
                    xf = acc[r, 4 * u : 4 * u + 4]
                else:
                    o = 16 * (u ^ (r % 2))
                    xf = sx[r, o : o + 16].clone().view(torch.float32)
                vals[tid, q] = _bf16_bytes(xf * nw[4 * u : 4 * u + 4].float())
    for (tid, q), xb in vals.items():
        u = tid % bt.UNITS
        r = (tid + q * nt) // bt.UNITS
        pu = (u // 2) ^ (r % 8)
        o = 8 * (2 * pu + u % 2)
        assert o + 8 <= 128  # packed into the first 128 bytes of the row
        sx[r, o : o + 8] = xb
    ntiles = MP // 8
    for warp in range(warps):
        for ks in range(4):
            for q in range(2):  # A
                addrs = []
                for lane in range(32):
                    ar = warp * 32 + lane % 16 + 16 * q
                    ua = 2 * ks + lane // 16
                    addrs.append((ar, 16 * (ua ^ (lane % 8))))
                got = _ldsm(sw, addrs, 4)
                for t in range(32):
                    gg, c = t // 4, t % 4
                    r0 = warp * 32 + 16 * q + gg
                    k0 = 16 * ks + 2 * c
                    want = [W[r0, k0 : k0 + 2], W[r0 + 8, k0 : k0 + 2], W[r0, k0 + 8 : k0 + 10],
                            W[r0 + 8, k0 + 8 : k0 + 10]]  # fmt: skip
                    for m in range(4):
                        assert torch.equal(got[t][m], want[m]), (warp, ks, q, t, m)
            pairs = []  # B: (tile, lane -> (row, offset)) as compute_ldsm forms them
            for jj in range(ntiles // 2):
                pairs.append((4, [(8 * (2 * jj + lane // 16) + lane % 8,
                                   16 * ((2 * ks + (lane // 8) % 2) ^ (lane % 8)))
                                  for lane in range(32)], [2 * jj, 2 * jj + 1]))  # fmt: skip
            if ntiles % 2:
                jl = ntiles - 1
                pairs.append((2, [(8 * jl + lane % 8, 16 * ((2 * ks + (lane // 8) % 2) ^ (lane % 8)))
                                  for lane in range(32)], [jl]))  # fmt: skip
            for nmat, addrs, tiles in pairs:
                got = _ldsm(sx, addrs, nmat)
                for t in range(32):
                    gg, c = t // 4, t % 4
                    k0 = 16 * ks + 2 * c
                    for n_, j in enumerate(tiles):
                        tok = 8 * j + gg
                        if tok >= T:
                            continue
                        assert torch.equal(got[t][2 * n_], X[tok, k0 : k0 + 2]), (ks, j, t)
                        assert torch.equal(got[t][2 * n_ + 1], X[tok, k0 + 8 : k0 + 10]), (ks, j, t)


def test_b_reads_are_bank_conflict_free():
    """The 16 lanes of a half warp read 8 bytes each from 16 distinct 8-byte bank slots (row
    stride 256 bytes: the slot is the byte offset within the row, mod 128, / 8)."""
    for h in range(2):
        for k in range(2):  # the two loads (FP32 units 2U and 2U + 1)
            for half in range(2):
                slots = set()
                for lane in range(16 * half, 16 * half + 16):
                    g_, c = lane // 4, lane % 4
                    uu = 2 * (4 * h + c) + k
                    o = 8 * (2 * (uu ^ (g_ % 2)) + (g_ // 2) % 2)
                    slots.add((o % 128) // 8)
                assert len(slots) == 16, (h, k, half)


GPU_CONFIGS = {"auto": {}, "smem": {"act": "smem"}, "regs": {"act": "regs"},
               "lean": {"lean": True}, "ldsm": {"act": "regs", "ldsm": True},
               "ldsm_smem": {"act": "smem", "ldsm": True},
               "wgmma": {"act": "regs", "ldsm": True, "wgmma": True},
               "cluster": {"cluster": True}, "cluster_smem": {"act": "smem", "cluster": True},
               "cluster_wgmma": {"act": "regs", "ldsm": True, "wgmma": True, "cluster": True},
               "late": {"trigger": "main"}, "late_split": {"trigger": "main", "cluster": False},
               "late_issued": {"trigger": "issued"}}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("cfg_name", sorted(GPU_CONFIGS))
@pytest.mark.parametrize("T", [8, 13, 32, 64])
def test_back_tile_gpu(T, cfg_name):
    """H200 (``pytest -m gpu``): the kernel vs ``up_proj_shared_add_ref`` and vs its own
    arithmetic (``back_tile_ref``), output poisoned with NaN, three launches in a row (the
    counters reset themselves), then a CUDA graph replayed twice; tokens of different scales."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = "cuda"
    kw = GPU_CONFIGS[cfg_name]
    cfg, L, H = _dims("kimi-k3", 8)
    g = torch.Generator(device=dev).manual_seed(T)
    scale = torch.logspace(-1, 1, T, device=dev).unsqueeze(1)
    acc = torch.randn(T, L, device=dev, generator=g) * scale
    nw = (1 + 0.1 * torch.randn(L, device=dev, generator=g)).to(torch.bfloat16)
    up = (torch.randn(H, L, device=dev, generator=g) / L**0.5).to(torch.bfloat16)
    sh = torch.randn(T, H, device=dev, generator=g)
    ref = up_proj_shared_add_ref(acc, nw, up, sh, cfg.eps)
    own = bt.back_tile_ref(
        acc, nw, up, sh, cfg.eps, splits=bt.plan_for(T, L, H, cfg.eps, **kw).tile.splits
    )
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        out.fill_(float("nan"))
        bt.back_tile(acc, nw, up, sh, out, cfg.eps, **kw)
        torch.cuda.synchronize()
        assert rel_l2(out, ref) < 1e-2
        assert rel_l2(out, own) < 2e-3
    out_g = torch.full_like(out, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        bt.back_tile(acc, nw, up, sh, out_g, cfg.eps, **kw)
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    assert rel_l2(out_g, out) < 1e-6
