"""CPU checks of the LL protocol of the two-GPU fused reductions (the default protocol).

1. The LL variants of ``oproj_allreduce`` and ``moe_allreduce`` compile for sm_90a at the
   kimi-k3 per-rank shapes; their PTX carries the LL instructions (64-bit relaxed system-scope
   stores and polls, the 64-bit epoch atomic) and no system-scope fence; ``ptxas`` (when
   installed) accepts it.
2. The protocol, simulated step by step: two ranks, random interleavings, one rank running
   ahead, launches of different grids and address mappings sharing the LL area and the epoch,
   the MoE back end's two phases with fewer CTAs resident than its grid: every polled word is
   the peer's of the same launch, no word is overwritten before it is read, no deadlock.
3. The protocol switch: ``DECODESCOPE_TP2_PROTO`` (``ll``, the default, ``flag``, ``auto``),
   one-line error otherwise.
"""

from __future__ import annotations

import random
import shutil
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
# the package's interface module first: it sets CUTE_DSL_ARCH (sm_90a) before cutlass loads, so
# that this file compiles for Hopper when it runs alone too
pytest.importorskip("decodescope.kernels.specialized.interface")

from decodescope.kernels.config import get_config  # noqa: E402
from decodescope.kernels.specialized import comm  # noqa: E402
from decodescope.kernels.specialized import moe_allreduce as ma  # noqa: E402
from decodescope.kernels.specialized import oproj_allreduce as oa  # noqa: E402

LL_PTX = ("st.relaxed.sys.global.b64", "ld.relaxed.sys.global.b64",
          "atom.relaxed.gpu.global.add.u64", "griddepcontrol.wait", "%globaltimer")  # fmt: skip


def _ptx(op, args, d: Path) -> str:
    import cutlass.cute as cute

    d.mkdir(parents=True, exist_ok=True)
    cute.compile(op, *args, options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")
    files = list(d.glob("*.ptx"))
    assert files, "no PTX dumped"
    return files[0].read_text()


def _ptxas(ptx_dir: Path) -> None:
    ptxas = shutil.which("ptxas")
    if not ptxas:
        return
    for f in ptx_dir.glob("*.ptx"):
        r = subprocess.run([ptxas, "-arch=sm_90a", str(f), "-o", str(f.with_suffix(".cubin"))],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("tp", [2, 8, 16])
@pytest.mark.parametrize("m", [1, 8, 64])
def test_oproj_ll_compiles(tp, m, tmp_path):
    plan = oa.plan_for(get_config("kimi-k3", tp), "kda", m, proto="ll")
    ptx = _ptx(oa._op(plan), oa._fake_args(plan), tmp_path)
    for ins in LL_PTX:
        assert ins in ptx, ins
    assert "fence.acq_rel.sys" not in ptx and "st.release.sys" not in ptx
    _ptxas(tmp_path)


@pytest.mark.parametrize("t", [1, 8, 64])
def test_moe_ll_compiles(t, tmp_path):
    cfg = get_config("kimi-k3", 8)
    plan = ma.MoeARPlan(t, cfg.expert_dim, cfg.hidden, cfg.eps, proto="ll")
    op, args = ma._build(plan)
    assert isinstance(op, ma.MoeAllReduceLL)
    assert plan.sms >= op.P and op.grid >= op.P  # the single-GPU grid, P exchange CTAs
    ptx = _ptx(op, args, tmp_path)
    for ins in LL_PTX:
        assert ins in ptx, ins
    assert "st.release.gpu" in ptx and "ld.acquire.gpu" in ptx  # the local done flags
    assert "fence.acq_rel.sys" not in ptx
    _ptxas(tmp_path)


def test_proto_switch(monkeypatch):
    monkeypatch.delenv(comm.PROTO_ENV, raising=False)
    assert comm.proto_default() == comm.PROTO_DEFAULT == "ll"
    assert oa.plan_for(get_config("kimi-k3", 8), "kda", 1).proto == "ll"
    monkeypatch.setenv(comm.PROTO_ENV, "FLAG")
    assert comm.proto_default() == "flag"
    assert oa.plan_for(get_config("kimi-k3", 8), "kda", 1).proto == "flag"
    monkeypatch.setenv(comm.PROTO_ENV, "simple")
    with pytest.raises(ValueError, match="DECODESCOPE_TP2_PROTO"):
        comm.proto_default()
    with pytest.raises(ValueError, match="protocol"):
        oa.OProjARPlan(m=1, k=1536, n=7168, proto="x")
    # auto: LL for the MoE back end and for o_proj up to AUTO_LL_MAX_M tokens
    monkeypatch.setenv(comm.PROTO_ENV, "auto")
    cfg = get_config("kimi-k3", 8)
    assert oa.plan_for(cfg, "kda", comm.AUTO_LL_MAX_M).proto == "ll"
    assert oa.plan_for(cfg, "kda", comm.AUTO_LL_MAX_M + 1).proto == "flag"
    assert ma.MoeARPlan(64, cfg.expert_dim, cfg.hidden, cfg.eps).proto == "ll"
    assert ma.MoeARPlan(64, cfg.expert_dim, cfg.hidden, cfg.eps, proto="flag").proto == "flag"


# -- the LL protocol, simulated -------------------------------------------------------------

HALF = 64  # words per parity half in the model


class _Rank:
    def __init__(self):
        self.ll = [[(0, None, True)] * HALF for _ in range(2)]  # (flag, (writer, launch), read)
        self.epoch = 0
        self.count = 0  # arrival counter (high half of the epoch word)
        self.done = {}  # local done flags (MoE phase 1 -> 2)
        self.launch = 0
        self.pending: list[int] = []  # CTAs not yet started
        self.active: dict[int, dict] = {}


def _words(kind, grid, b, n):
    """The LL words CTA b of launch n (o_proj kind) writes to the peer and polls at home:
    a launch-dependent mapping, so launches overlap each other's words."""
    per = HALF // grid
    shift = (n * 5) % per if per > 1 else 0
    return [b * per + (shift + j) % per for j in range(max(1, per // 2 + n % 2))]


def _simulate(seed: int, launches: list[tuple[str, int, int]], cap: int) -> None:
    """``launches``: (kind, grid, P) per launch; ``kind`` "pair" (o_proj: CTA b exchanges with
    the peer's CTA b; every CTA resident) or "moe" (two phases: the first P CTAs to arrive
    exchange slice k = their arrival order, every CTA waits for the P local done flags; at most
    ``cap`` CTAs resident, dispatched in random order)."""
    rng = random.Random(seed)
    R = [_Rank(), _Rank()]
    steps = 0
    while any(r.launch < len(launches) or r.active for r in R):
        steps += 1
        assert steps < 200_000, "deadlock"
        moves = []
        for i, rk in enumerate(R):
            if rk.launch < len(launches) and not rk.active and not rk.pending:
                moves.append((i, "launch"))
            kind = launches[rk.launch][0] if rk.launch < len(launches) else "pair"
            limit = cap if kind == "moe" else 10**9
            if rk.pending and len(rk.active) < limit:
                moves.append((i, "start"))
            moves += [(i, b) for b in rk.active]
        i, mv = rng.choice(moves)
        rk, peer = R[i], R[1 - i]
        if mv == "launch":
            _, grid, _ = launches[rk.launch]
            rk.pending = list(range(grid))
            rng.shuffle(rk.pending)
            continue
        n = rk.launch
        kind, grid, P = launches[n]
        if mv == "start":
            b = rk.pending.pop()
            # epoch word: one atomic read-modify-write gives (epoch, arrival order)
            rk.active[b] = {"ph": 0, "e": rk.epoch, "k": rk.count}
            rk.count += 1
            continue
        b = mv
        st = rk.active[b]
        e, k = st["e"], st["k"]
        half = e % 2
        if kind == "pair":
            words = _words(kind, grid, b, n)
        else:
            per = HALF // P
            words = list(range(k * per, (k + 1) * per)) if k < P else []
        if st["ph"] == 0:  # store to the peer: one word = value + flag in one store
            for w in words:
                old = peer.ll[half][w]
                # never overwrite a word of the same parity the peer has not read yet
                assert old[2], f"rank {i} launch {n} overwrote unread word {w}: {old}"
                peer.ll[half][w] = (e + 1, (i, n), False)
            st["ph"] = 1
        elif st["ph"] == 1:  # poll own words
            if all(rk.ll[half][w][0] == e + 1 for w in words):
                for w in words:
                    f, src, _ = rk.ll[half][w]
                    assert src == (1 - i, n), (src, i, n)
                    rk.ll[half][w] = (f, src, True)
                if kind == "moe" and k < P:
                    rk.done[k] = e + 1
                st["ph"] = 2
        elif st["ph"] == 2:  # MoE phase 2: every slice reduced on this rank
            if kind == "pair" or all(rk.done.get(j) == e + 1 for j in range(P)):
                st["ph"] = 3
        else:
            if k == grid - 1:  # the last arriver advances the epoch
                assert rk.count == grid
                rk.count = 0
                rk.epoch = e + 1
            del rk.active[b]
            if not rk.active and not rk.pending:
                assert rk.epoch == e + 1 and rk.count == 0
                rk.launch += 1


@pytest.mark.parametrize("seed", range(60))
def test_ll_protocol_simulated(seed):
    rng = random.Random(7000 + seed)
    launches = []
    for _ in range(10):
        if rng.random() < 0.5:
            launches.append(("pair", rng.choice([1, 2, 4, 8]), 0))
        else:
            grid = rng.choice([2, 4, 8])
            launches.append(("moe", grid, rng.choice([p for p in (1, 2, 4) if p <= grid])))
    cap = max(p for _, _, p in launches)  # as few resident CTAs as the protocol allows
    _simulate(seed, launches, cap)


def test_enable_tp2_ll_arguments(monkeypatch):
    """With ``DECODESCOPE_TP2_PROTO=ll`` the step's fused launches get the LL workspace
    arguments (tiny preset on the CPU; kernels recorded, not compiled or run)."""
    from decodescope.kernels.specialized import interface as itf
    from decodescope.kernels.specialized import step as S

    calls: list[tuple] = []
    monkeypatch.setattr(
        itf, "compiled", lambda key, build: lambda *a, **k: calls.append((key[0], key[1], a))
    )
    monkeypatch.setenv(comm.PROTO_ENV, "ll")
    p = S.plan(preset="tiny", tp_shape=1, batch=1, tokens_per_seq=1, layers="kda,mla")
    m = S.SpecializedModel(p.cfg, p.specs, 1, 1, device="cpu")
    i32, dev = torch.int32, torch.device("cpu")
    ws = comm.PeerWorkspace(
        0, 2,
        torch.empty(comm.FLAG_SLOTS, dtype=i32), torch.empty(2, 16),
        torch.empty(comm.FLAG_SLOTS, dtype=i32), torch.empty(2, 16),
        torch.zeros(comm.CTL_WORDS, dtype=i32), None,
        torch.zeros(2, 16, dtype=torch.int64), torch.zeros(2, 16, dtype=torch.int64),
        torch.zeros(16, device=dev),
    )  # fmt: skip
    S.enable_tp2(m, ws)
    m.step()
    fused = [(k, plan, a) for k, plan, a in calls if k in ("oproj_allreduce", "moe_allreduce")]
    assert len(fused) == 4
    for _, plan, a in fused:
        assert plan.proto == "ll"
        assert all(x is y for x, y in zip(a[-4:], ws.args_ll(), strict=True))


def test_moe_back_unfused_from_8_tokens(monkeypatch):
    """tp_world 2: where the single-GPU MoE back end is BackMma (8..64 tokens) it stays unfused
    (two NCCL all-reduces + BackMma); below, the fused kernel. The plan's launch names agree."""
    from decodescope.kernels.specialized import step as S
    from decodescope.kernels.specialized import tp2

    monkeypatch.delenv("DECODESCOPE_MOE_BACK", raising=False)
    cfg = get_config("kimi-k3", 8)
    assert not tp2.moe_back_unfused(1, cfg.expert_dim, cfg.hidden)
    assert tp2.moe_back_unfused(8, cfg.expert_dim, cfg.hidden)
    assert tp2.moe_back_unfused(64, cfg.expert_dim, cfg.hidden)

    def moe_ops(batch):
        p = S.plan(preset="kimi-k3", tp_shape=8, batch=batch, layers="kda", tp_world=2)
        return [n for n in p.op_names(p.specs[0]) if n.startswith("moe.")][2:]

    assert moe_ops(1) == ["moe.latent_allreduce+latent_norm+latent_up+shared_allreduce+add"]
    assert moe_ops(8) == list(tp2.NCCL_OPS[tp2.MOE_BACK_OP])
    monkeypatch.setenv("DECODESCOPE_MOE_BACK", "simt")  # no BackMma: the fused kernel again
    assert moe_ops(8) == ["moe.latent_allreduce+latent_norm+latent_up+shared_allreduce+add"]
