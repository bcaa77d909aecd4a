"""CPU checks of the two-GPU fused reductions (``comm``, ``oproj_allreduce``, ``moe_allreduce``).

1. Both kernels compile for sm_90a (no GPU) at the kimi-k3 TP2 / TP8 / TP16 per-rank shapes,
   and their PTX carries the protocol's system-scope instructions.
2. The torch references over two simulated ranks equal the single-GPU math of the unsharded
   layer (o_proj over all heads + residual; the MoE back end on the summed partials).
3. The flag / epoch / parity protocol of :mod:`comm`, simulated step by step under random
   interleavings of two ranks' CTAs (a rank running ahead included): every read sees the peer's
   data of the same launch, nothing is overwritten unread, nothing deadlocks.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# the package's interface module first: it sets CUTE_DSL_ARCH (sm_90a) before cutlass loads, so
# that this file compiles for Hopper when it runs alone too
pytest.importorskip("decodescope.kernels.specialized.interface")

from decodescope.kernels.config import get_config  # noqa: E402
from decodescope.kernels.specialized import interface as itf  # noqa: E402
from decodescope.kernels.specialized import moe_allreduce as ma  # noqa: E402
from decodescope.kernels.specialized import oproj_allreduce as oa  # noqa: E402
from decodescope.kernels.specialized.oproj_residual_norm import oproj_residual_ref  # noqa: E402
from decodescope.kernels.specialized.up_proj_shared_add import up_proj_shared_add_ref  # noqa: E402

TPS = [2, 8, 16]


@pytest.fixture(autouse=True)
def _flag_protocol(monkeypatch):
    """These tests are the flag protocol's (LL: test_specialized_comm_ll.py)."""
    monkeypatch.setenv("DECODESCOPE_TP2_PROTO", "flag")


PROTOCOL_PTX = ("ld.acquire.sys.global.b32", "st.release.sys.global.b32", "fence.acq_rel.sys",
                "griddepcontrol.wait", "%globaltimer")  # fmt: skip


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("m", [1, 8, 64])
def test_oproj_allreduce_compiles(tp, m):
    cfg = get_config("kimi-k3", tp)
    plan = oa.plan_for(cfg, "kda", m, prefetch=True)
    assert plan.grid <= 2 * plan.sms and plan.upc >= 1
    assert oa.compile_plan(plan) is not None


def test_oproj_allreduce_mla_tp2_compiles():
    assert oa.compile_plan(oa.plan_for(get_config("kimi-k3", 2), "mla", 32)) is not None


@pytest.mark.parametrize("t", [1, 32, 64])
def test_moe_allreduce_compiles(t):
    # latent and hidden widths are the same at every TP (the latent projections are replicated)
    for tp in TPS:
        cfg = get_config("kimi-k3", tp)
        assert (cfg.expert_dim, cfg.hidden) == (3584, 7168)
    cfg = get_config("kimi-k3", 8)
    plan = ma.MoeARPlan(t, cfg.expert_dim, cfg.hidden, cfg.eps, prefetch=True)
    op = ma.MoeAllReduce(plan)
    assert op.grid <= plan.sms  # persistent: the whole grid resident (every CTA waits on all)
    assert ma.compile_plan(plan) is not None


def _ptx(op, args, tmp_path: Path) -> str:
    import cutlass.cute as cute

    tmp_path.mkdir(parents=True, exist_ok=True)
    cute.compile(op, *args, options=f"--enable-tvm-ffi --keep-ptx --dump-dir={tmp_path}")
    files = list(tmp_path.glob("*.ptx"))
    assert files, "no PTX dumped"
    return files[0].read_text()


def test_protocol_ptx(tmp_path):
    cfg = get_config("kimi-k3", 8)
    plan = oa.plan_for(cfg, "kda", 1, prefetch=True)
    ptx = _ptx(oa.OProjAllReduce(plan), oa._fake_args(plan), tmp_path / "o")
    for ins in PROTOCOL_PTX:
        assert ins in ptx, ins
    assert "prefetch.global.L2" in ptx
    mplan = ma.MoeARPlan(1, cfg.expert_dim, cfg.hidden, cfg.eps, prefetch=True)
    ptx = _ptx(*ma._build(mplan), tmp_path / "m")
    for ins in PROTOCOL_PTX:
        assert ins in ptx, ins


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("m", [1, 8])
def test_oproj_allreduce_ref_is_the_full_oproj(m):
    """Two ranks' shards (heads split in two) reduce to the unsharded o_proj + residual."""
    g = torch.Generator().manual_seed(m)
    cfg = get_config("kimi-k3", 8)
    K, N = 2 * cfg.kda_dim, 256
    o = torch.randn(m, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(torch.bfloat16)
    r = torch.randn(m, N, generator=g).to(torch.bfloat16)
    got = oa.oproj_allreduce_ref(
        [o[:, : K // 2], o[:, K // 2 :]], [w[:, : K // 2], w[:, K // 2 :]], r
    )
    want = oproj_residual_ref(cfg, {"o_proj": w}, o, r)
    assert _rel(got, want) < 1e-2
    # rank order does not matter (FP32 a + b == b + a): both ranks hold the same r'
    swapped = oa.oproj_allreduce_ref(
        [o[:, K // 2 :], o[:, : K // 2]], [w[:, K // 2 :], w[:, : K // 2]], r
    )
    assert torch.equal(got, swapped)


def test_moe_allreduce_ref_is_the_single_gpu_back_end():
    g = torch.Generator().manual_seed(7)
    T, L, H = 3, 256, 128
    a0, a1 = torch.randn(T, L, generator=g), torch.randn(T, L, generator=g)
    s0, s1 = torch.randn(T, H, generator=g), torch.randn(T, H, generator=g)
    gam = torch.rand(L, generator=g).to(torch.bfloat16)
    w = (torch.randn(H, L, generator=g) / L**0.5).to(torch.bfloat16)
    got = ma.moe_allreduce_ref([a0, a1], gam, w, [s0, s1], 1e-5)
    want = up_proj_shared_add_ref(a0 + a1, gam, w, s0 + s1, 1e-5)
    assert torch.equal(got, want)


def test_prefetch_args_and_checks():
    from decodescope.kernels.specialized.comm import PREFETCH_HEAD, PeerWorkspace

    t = torch.zeros(1000, dtype=torch.uint8)
    head, n = PeerWorkspace.prefetch_args(t, "cpu")
    assert head.dtype == torch.bfloat16 and head.numel() == PREFETCH_HEAD and n == 500
    assert head.data_ptr() == t.data_ptr()
    assert PeerWorkspace.prefetch_args(None, "cpu")[1] == 0
    with pytest.raises(ValueError, match="prefetch"):
        PeerWorkspace.prefetch_args(torch.zeros(4, dtype=torch.uint8), "cpu")
    with pytest.raises(ValueError, match="exceeds the receive area"):
        oa.OProjARPlan(m=64, k=1536, n=1 << 16)
    assert itf.cache_size() >= 0


# -- the protocol, simulated ----------------------------------------------------------------


class _Rank:
    def __init__(self, ctas_per_launch: list[int]):
        self.flags = [0] * 8
        self.recv = [[None] * 8 for _ in range(2)]  # (writer, epoch) per slot
        self.epoch = 0
        self.launches = list(ctas_per_launch)
        self.active: dict[int, int] = {}  # cta -> phase of the current launch


def _simulate(seed: int, grids: list[int], all_flags: list[bool]) -> None:
    """Each launch: CTA b writes peer.recv[e%2][b] (``all_flags``: every CTA needs every peer
    CTA's tile), releases peer.flags[b] = e + 1, waits own flag(s) >= e + 1, reads. A launch
    starts when the rank's previous one has completed."""
    rng = random.Random(seed)
    ranks = [_Rank(grids), _Rank(grids)]
    done = [0, 0]
    steps = 0
    while done != [len(grids)] * 2:
        steps += 1
        assert steps < 100_000, "deadlock"
        moves = []
        for i, rk in enumerate(ranks):
            if not rk.active and done[i] < len(grids):
                moves.append((i, None))
            for b in rk.active:
                moves.append((i, b))
        i, b = rng.choice(moves)
        rk, peer = ranks[i], ranks[1 - i]
        n = done[i]
        e = rk.epoch
        grid = grids[n]
        if b is None:
            rk.active = {c: 0 for c in range(grid)}
            continue
        ph = rk.active[b]
        if ph == 0:
            old = peer.recv[e % 2][b]
            # never overwrite a tile the peer has not read: that tile is from launch e - 2 or
            # was already consumed (marked None-like by the reader)
            assert old is None or old[2], f"overwrote unread tile {old}"
            peer.recv[e % 2][b] = (i, e, False)
            rk.active[b] = 1
        elif ph == 1:
            peer.flags[b] = max(peer.flags[b], e + 1)
            assert peer.flags[b] == e + 1 or peer.flags[b] == e + 2
            rk.active[b] = 2
        elif ph == 2:
            need = range(grid) if all_flags[n] else [b]
            if all(rk.flags[j] - (e + 1) >= 0 for j in need):
                for j in need:
                    tile = rk.recv[e % 2][j]
                    assert tile is not None and tile[:2] == (1 - i, e), (tile, i, e)
                rk.active[b] = 3
        else:
            del rk.active[b]
            if not rk.active:
                # launch complete: its tiles are consumed; the last CTA advanced the epoch
                for j in range(grid):
                    t = rk.recv[e % 2][j]
                    if t is not None:
                        rk.recv[e % 2][j] = (t[0], t[1], True)
                rk.epoch += 1
                done[i] += 1


@pytest.mark.parametrize("seed", range(40))
def test_protocol_simulated(seed):
    rng = random.Random(1000 + seed)
    grids = [rng.choice([1, 2, 3, 8]) for _ in range(12)]
    all_flags = [rng.random() < 0.5 for _ in grids]
    _simulate(seed, grids, all_flags)


# -- the tp_world 2 hook on a SpecializedModel ---------------------------------------------


def test_enable_tp2_routes_the_reductions(monkeypatch):
    """``step.enable_tp2`` swaps each layer's o_proj and MoE back-end launches for the fused
    kernels (same launch count, renamed ranges), with the MoE front weights and the next
    layer's first GEMM as prefetch targets. Tiny preset on the CPU; kernels recorded, not
    compiled or run."""
    from decodescope.kernels.specialized import comm, tp2
    from decodescope.kernels.specialized import step as S
    from decodescope.tracer import ranges as _ranges  # noqa: F401

    keys: list[tuple] = []
    calls: list[tuple] = []

    def record(key, build):
        keys.append(key)
        return lambda *a, **k: calls.append((key[0], a))

    monkeypatch.setattr(itf, "compiled", record)
    monkeypatch.setenv(comm.PROTO_ENV, "flag")  # the flag protocol's arguments are checked
    p = S.plan(preset="tiny", tp_shape=1, batch=1, tokens_per_seq=1, layers="kda,mla")
    m = S.SpecializedModel(p.cfg, p.specs, 1, 1, device="cpu")
    dev = torch.device("cpu")
    ws = comm.PeerWorkspace(
        0, 2,
        torch.empty(comm.FLAG_SLOTS, dtype=torch.int32, device=dev),
        torch.empty(2, 16, device=dev),
        torch.empty(comm.FLAG_SLOTS, dtype=torch.int32, device=dev),
        torch.empty(2, 16, device=dev),
        torch.empty(4, dtype=torch.int32, device=dev),
    )  # fmt: skip
    S.enable_tp2(m, ws)
    ops = [op for op, _ in m.attn[0].stages(m.x_in, m.r_in, m.rs[0], m.hs[0])]
    assert tp2.OP_OPROJ in ops and "o_proj" not in ops
    m.step()
    kinds = [k[0] for k in keys]
    assert kinds.count("oproj_allreduce") == 2 and kinds.count("moe_allreduce") == 2
    assert "moe_up_proj_shared_add" not in kinds
    oa_calls = [a for k, a in calls if k == "oproj_allreduce"]
    assert oa_calls[0][5] > 0  # a prefetch range (the MoE front weights) was passed
    assert oa_calls[0][6] is ws.flags and oa_calls[0][8] is ws.peer_flags
