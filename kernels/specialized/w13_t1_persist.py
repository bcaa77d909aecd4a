"""A persistent w13 for the experts at one token: ``DECODESCOPE_MOE_T1_W13=persist`` (issue #5).

Kernel 2 of the ``t1`` mode (:mod:`experts_t1`), opt-in (unset / ``tile``:
:class:`experts_t1.W13T1`, the default). Same contract, arguments, launch slot, rounding and PDL
placement as W13T1: before the PDL wait the shared expert's down projection
(:meth:`experts_t1.W13T1._shared_down`, ``ceil(H / grid)`` contiguous rows per CTA, through the
pipeline stages, leaving no ``cp.async`` group open and ending on a CTA barrier); after it the
routed part, ``h[p, :] = bf16(SiTU(w13_gate[e] @ z_t, w13_up[e] @ z_t))`` (FP32 MMA accumulation
over all of ``L``, SiTU in FP32), W13T1's loader, fragments and epilogue unchanged. Only the work
split and the pipeline of the routed part differ.

Why: W13T1 runs one item (16 gate + 16 up rows of one selected expert, all of ``L``: 229 KB at
TP8) per CTA, 384 CTAs at 3 per SM (H200 s12/r1, TP8: 30.4 us alone incl. the shared down,
bytes floor 23.6; Triton's w13 on the same routing 26.6); each CTA's pipeline ramps after the
wait and drains at its item's end. Here a fixed grid of ``PER_SM x nsm`` CTAs each takes one
contiguous run of (selected expert, row block) units and streams it through one ring of ``NS``
stages that runs across the unit boundaries (the next unit's first chunks are issued while this
unit's last ones are multiplied), so a CTA's copies never drain until its run ends.

- **Units**: ``R = warps x 16`` gate rows (+ the matching up rows) of one selected expert,
  slot-major: unit ``u = a x NRT + rb`` (``NRT = ceil(Ie / R)``), ``total = nact x NRT``. CTA
  ``b`` takes units ``[b x total // grid, (b + 1) x total // grid)``: contiguous, counts differ
  by at most one; since ``grid >= slots >= nact`` a run is at most ``NRT`` units, so it touches
  at most two slots (``aA``, ``aA + 1``) whose lists (expert, pairs, the tokens of the z pieces)
  are read once after the wait (the route's lists are final only then: the route is this grid's
  predecessor) and selected per unit. Defaults (``WARPS 1``, ``PER_SM 1``): 384 units over 132
  CTAs at TP8, 2-3 each (the same per-SM maximum of 3 units as W13T1's 3 CTAs per SM), 192 at
  TP16 (1-2 each).
- **Ring**: a stream of ``(unit, K chunk)`` steps; step ``k`` lives in stage ``k % NS`` and in
  commit group ``k``; the first ``NS - 1`` steps are issued right after the wait (after the shared
  down, which used the same stages and ended on a barrier); then per step: wait for its group, a
  CTA barrier (every warp is past step ``k - 1``'s stage), issue step ``k + NS - 1``, the MMAs;
  after a unit's last chunk its epilogue (W13T1's: gate/up pair, SiTU, bf16 ``h``).
- Default ``NS = 16`` stages of 12 KB (W13T1's: ``2R x BK`` BF16 weights + 8 tokens' FP32 z;
  192 KB per CTA, one CTA per SM): 15 chunks (120 KB of weights) in flight per SM, as W13T1's 3
  CTAs x 5 chunks. The stage count is not capped at W13T1's 8 (:class:`RingConfig`).

Knobs (read at each call, part of the compile key): ``DECODESCOPE_MOE_T1_W13P_WARPS`` (1),
``_STAGES`` (16), ``_PERSM`` (1), ``_SDROWS`` (1: W13T1's shared-down loop; 2 / 4: a warp
takes that many shared-down rows per iteration, interleaved, same per-row arithmetic: with one
warp per SM, 55 rows of dependent FMA chains are otherwise ~5 us before the wait, an estimate);
``DECODESCOPE_MOE_T1_BK`` as for W13T1 (its ``_ROWS`` /
``_STAGES`` do not apply here). A bad value: a one-line ``ValueError`` naming the variable.
"""

# no `from __future__ import annotations`: the Smem struct reads its field annotations
import dataclasses
import os

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, const_expr

from decodescope.kernels.specialized import experts_t1 as t1
from decodescope.kernels.specialized import grouped_w13_tile as gwt
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized import moe_grouped as mg
from decodescope.kernels.specialized.moe_common import situ

DEF_WARPS = 1  # 16-row units: 384 at TP8
DEF_STAGES = 16  # 15 chunks of 8 KB weights in flight per CTA
DEF_PER_SM = 1  # CTAs per SM of the persistent grid
MAX_STAGES = 16
ENV = {
    "warps": ("DECODESCOPE_MOE_T1_W13P_WARPS", (1, 2, 4, 8)),
    "stages": ("DECODESCOPE_MOE_T1_W13P_STAGES", tuple(range(2, MAX_STAGES + 1))),
    "per_sm": ("DECODESCOPE_MOE_T1_W13P_PERSM", tuple(range(1, 17))),
    "sd": ("DECODESCOPE_MOE_T1_W13P_SDROWS", (1, 2, 4)),
}
VAR = "DECODESCOPE_MOE_T1_W13"
VARIANTS = ("tile", "persist")  # DECODESCOPE_MOE_T1_W13 (unset: tile)


@dataclasses.dataclass(frozen=True)
class PersistKnobs:
    warps: int = DEF_WARPS
    stages: int = DEF_STAGES
    per_sm: int = DEF_PER_SM
    sd: int = 1  # shared-down rows per warp iteration (1: W13T1's own loop)


@dataclasses.dataclass(frozen=True)
class RingConfig(gwt.TileConfig):
    """:class:`grouped_w13_tile.TileConfig` with up to ``MAX_STAGES`` stages (the ring's only
    difference; the shared-memory limit still applies)."""

    def __post_init__(self) -> None:
        if not 2 <= self.stages <= MAX_STAGES:
            raise ValueError(f"w13_t1_persist: stages={self.stages}, expected 2..{MAX_STAGES}")
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        gwt.TileConfig(**{**kw, "stages": 2})  # rows / bk / rt / persist: the parent's checks
        if self.smem_bytes > gwt.SMEM_MAX:
            raise ValueError(f"w13_t1_persist: {self.stages} stages need {self.smem_bytes} bytes "
                             f"of shared memory > {gwt.SMEM_MAX}")  # fmt: skip


def variant() -> str:
    """``DECODESCOPE_MOE_T1_W13``: ``tile`` (:class:`experts_t1.W13T1`, also unset) or
    ``persist`` (:class:`W13T1Persist`)."""
    v = os.environ.get(VAR, "") or "tile"
    if v not in VARIANTS:
        raise ValueError(f"{VAR}={v!r}: expected one of {VARIANTS}")
    return v


def knobs() -> PersistKnobs:
    """:class:`PersistKnobs` from ``DECODESCOPE_MOE_T1_W13P_*`` (a bad value: one-line error)."""
    vals = {}
    for name, (var, allowed) in ENV.items():
        v = os.environ.get(var, "")
        if v == "":
            continue
        if not v.isdigit() or int(v) not in allowed:
            raise ValueError(f"{var}={v!r}: expected one of {allowed[0]}..{allowed[-1]}"
                             if name != "warps" else f"{var}={v!r}: expected one of {allowed}")  # fmt: skip
        vals[name] = int(v)
    return PersistKnobs(**vals)


def split(total: int, grid: int, b: int) -> tuple[int, int]:
    """CTA ``b``'s units ``[lo, hi)`` of ``total`` (the kernel's formula)."""
    return b * total // grid, (b + 1) * total // grid


class W13T1Persist(t1.W13T1):
    """Kernel 2 of the ``t1`` mode, persistent routed part (module docstring)."""

    def __init__(self, T, E, K, L, Ie, H, S, beta, lbeta, pdl=True, nsm: int = 132,
                 cfg: gwt.TileConfig | None = None, shared: bool = True,
                 pk: PersistKnobs | None = None):  # fmt: skip
        pk = pk or knobs()
        base = cfg or t1.w13_config()
        try:
            ring = RingConfig(rows=16 * pk.warps, bk=base.bk, stages=pk.stages, rt=1)
        except ValueError as e:
            raise ValueError(f"DECODESCOPE_MOE_T1_W13P_*: {e}") from None
        # the parent's one-item-per-CTA grid (nsm 1 << 16 lifts its cap) is replaced below
        super().__init__(T, E, K, L, Ie, H, S, beta, lbeta, pdl, 1 << 16, ring, shared)
        self.pk = pk
        self.units = self.slots * self.NRT
        self.grid = min(pk.per_sm * nsm, self.units)
        if self.grid < self.slots:  # a run of <= NRT units: at most two slots
            raise ValueError(f"w13_t1_persist: grid {self.grid} < {self.slots} slots")
        self.UPC = -(-self.units // self.grid)  # most units of a CTA
        # the shared down over this grid (W13T1's formulas)
        self.RPC = -(-H // self.grid)
        cap = (self.S * 2 * self.R * self.BK) // S
        self.RB = min(self.RPC, cap)
        self.NRB = -(-self.RPC // self.RB)
        hs = T * S * 2 if shared else 0
        if self.cfg.smem_bytes + hs > gwt.SMEM_MAX:
            raise ValueError(f"w13_t1_persist: {self.cfg.smem_bytes + hs} bytes of shared memory")

    def plan(self, nact: int, b: int) -> list[tuple]:
        """Replay of CTA ``b``'s stream (trace-time mirror of the kernel's index math): the
        ``(step, unit, slot, row0, chunk, stage)`` of every load in issue order, and the
        ``(unit, slot, row0)`` of every epilogue, as ``("load", ...)`` / ``("epi", ...)``."""
        NRT, NCH, NS, R = self.NRT, self.NCH, self.S, self.R
        lo, hi = split(nact * NRT, self.grid, b)
        nu = hi - lo
        out = []
        if nu <= 0:
            return out
        aA = lo // NRT

        def load(u, kc, stg, k):
            a = u // NRT
            assert a in (aA, aA + 1) and a < nact
            out.append(("load", k, u, a, (u - a * NRT) * R, kc, stg))

        for s in range(NS - 1):
            if s // NCH < nu:
                load(lo + s // NCH, s % NCH, s, s)
        for ui in range(nu):
            u = lo + ui
            for cc in range(NCH):
                k = ui * NCH + cc
                nxt = cc + NS - 1
                d = nxt // NCH
                if ui + d < nu:
                    load(u + d, nxt % NCH, (k + NS - 1) % NS, k + NS - 1)
            a = u // NRT
            out.append(("epi", u, a, (u - a * NRT) * R))
        return out

    @cute.kernel
    def kernel(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, mWs2, mShared):
        S, R, BK = self.S, self.R, self.BK
        TOK = gwt.TOK
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sW = st.w.get_tensor(cute.make_layout((S, 2 * R, BK), stride=(2 * R * BK, BK, 1)))
        sZ = st.z.get_tensor(cute.make_layout((S, TOK, BK), stride=(TOK * BK, BK, 1)))
        if const_expr(self.shared):  # W13T1's pre-wait shared down (ends on a barrier)
            sWf = st.w.get_tensor(cute.make_layout(S * 2 * R * BK))
            sZf = st.z.get_tensor(cute.make_layout(S * TOK * BK))
            sHs = st.hs.get_tensor(cute.make_layout((self.T, self.SI), stride=(self.SI, 1)))
            self._shared_down(mY, mWs2, mShared, sWf, sZf, sHs, tid, bid, warp, lane)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        self._ring(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, sW, sZ, tid, bid,
                   warp, g, c)  # fmt: skip

    @cute.jit
    def _shared_down(self, mY, mWs2, mShared, sWf, sZf, sHs, tid, bid, warp, lane):
        """W13T1's shared down (``sd`` 1: its own method); ``sd`` > 1: the same copies, ``hs``
        and per-row arithmetic (so the same bits), a warp taking ``sd`` rows per iteration with
        their lane loops interleaved (independent FMA chains for one warp per SM)."""
        if const_expr(self.pk.sd == 1):
            t1.W13T1._shared_down(self, mY, mWs2, mShared, sWf, sZf, sHs, tid, bid, warp, lane)
        else:
            self._shared_down_rows(mY, mWs2, mShared, sWf, sZf, sHs, tid, bid, warp, lane)

    @cute.jit
    def _shared_down_rows(self, mY, mWs2, mShared, sWf, sZf, sHs, tid, bid, warp, lane):
        """:meth:`_shared_down` with ``sd`` > 1 (W13T1's loads and ``hs`` verbatim; the row loop
        takes ``sd`` rows at a time, clamped to the last row, stores guarded)."""
        T, E, L, SI, H, US, NT, NW = (self.T, self.E, self.L, self.SI, self.H, self.US, self.NT,
                                      self.NW)  # fmt: skip
        RB, SD = self.RB, self.pk.sd
        UY = 2 * SI // 4  # 16-byte units of a token's gate + up (FP32)
        for i in cutlass.range(tid, T * UY, NT):
            t = i // UY
            u = i % UY
            src = cute.local_tile(mY[t, None], (4,), ((E + L) // 4 + u,))
            mc.cp_async16(cute.local_tile(sZf, (4,), (i,)), src)
        cute.arch.cp_async_commit_group()
        r0 = bid * self.RPC
        nr = cutlass.max(cutlass.min(H - r0, self.RPC), 0)  # this CTA's rows (0 past H)
        for rb in cutlass.range_constexpr(self.NRB):
            lo = rb * RB
            n_r = cutlass.max(cutlass.min(nr - lo, RB), 0)
            for i in cutlass.range(tid, n_r * US, NT):
                rr = i // US
                u = i % US
                src = cute.local_tile(mWs2[r0 + lo + rr, None], (8,), (u,))
                mc.cp_async16(cute.local_tile(sWf, (8,), (i,)), src)
            cute.arch.cp_async_commit_group()
            if const_expr(rb == 0):  # hs from the gate/up values, while the rows land
                cute.arch.cp_async_wait_group(1)
                cute.arch.barrier()
                for i in cutlass.range(tid, T * SI, NT):
                    t = i // SI
                    s = i % SI
                    hv = situ(sZf[t * 2 * SI + s], sZf[t * 2 * SI + SI + s], self.beta,
                              self.lbeta)  # fmt: skip
                    sHs[t, s] = hv.to(BFloat16)
            cute.arch.cp_async_wait_group(0)
            cute.arch.barrier()  # rows and hs visible to every warp
            for rq in cutlass.range(warp * SD, n_r, NW * SD):
                accs = []
                rows = []
                for j in cutlass.range_constexpr(SD):
                    rows.append(cutlass.min(rq + j, n_r - 1))
                    acc = cute.make_rmem_tensor((T,), Float32)
                    acc.fill(0.0)
                    accs.append(acc)
                for u in cutlass.range(lane, US, 32):
                    for j in cutlass.range_constexpr(SD):
                        wv = cute.make_rmem_tensor((8,), BFloat16)
                        cute.autovec_copy(cute.local_tile(sWf, (8,), (rows[j] * US + u,)), wv)
                        wf = cute.make_rmem_tensor((8,), Float32)
                        wf.store(wv.load().to(Float32))
                        for t in cutlass.range_constexpr(T):
                            hb = cute.make_rmem_tensor((8,), BFloat16)
                            cute.autovec_copy(cute.local_tile(sHs[t, None], (8,), (u,)), hb)
                            hf = cute.make_rmem_tensor((8,), Float32)
                            hf.store(hb.load().to(Float32))
                            s_ = accs[j][t]
                            for q in cutlass.range_constexpr(8):
                                s_ = s_ + wf[q] * hf[q]
                            accs[j][t] = s_
                for j in cutlass.range_constexpr(SD):
                    for t in cutlass.range_constexpr(T):
                        v = accs[j][t]
                        for o in cutlass.range_constexpr(5):
                            v = v + cute.arch.shuffle_sync_bfly(v, offset=16 >> o)
                        if rq + j < n_r:  # noqa: SIM102 (dynamic conditions: nested ifs)
                            if lane == 0:
                                mShared[t, r0 + lo + rows[j]] = v
            cute.arch.barrier()  # every warp done with the stages before they are refilled

    @cute.jit
    def _slot_meta(self, mPairs, mSlotE, mSlotOff, mSlotN, a, tid, c):
        """Slot ``a``'s ``(e, nn, ztok, pp)``: expert, real tokens (one pass: ``n <= T <= 8``),
        the tokens of this thread's z pieces, the pairs of the lane's output columns."""
        e = mSlotE[a]
        off = mSlotOff[a]
        nn = cutlass.min(mSlotN[a], gwt.TOK)
        ztok = []
        for i in cutlass.range_constexpr(self.ZP):
            if const_expr(self.T == 1):  # the one token: no pair lookup before the loads
                ztok.append(Int32(0))
            else:
                m = tid // self.UZ + i * (self.NT // self.UZ)
                ztok.append(mPairs[off + cutlass.min(m, nn - 1)] // self.K)
        pp = [mPairs[off + cutlass.min(2 * c + s, nn - 1)] for s in range(2)]
        return e, nn, ztok, pp

    @cute.jit
    def _load_step(self, mW13, mY, sW, sZ, u, kc, stg, aA, mA, mB, tid):
        """Unit ``u``'s chunk ``kc`` into stage ``stg`` (slot ``aA``'s or ``aA + 1``'s lists)."""
        a = u // self.NRT
        isb = a != aA
        e = cutlass.select_(isb, mB[0], mA[0])
        nn = cutlass.select_(isb, mB[1], mA[1])
        zt = [cutlass.select_(isb, y, x) for x, y in zip(mA[2], mB[2], strict=True)]
        mW = mg._expert_mat(mW13, e, 2 * self.Ie, self.L)
        self._load(mW, mY, sW, sZ, (u - a * self.NRT) * self.R, zt, nn, kc, stg, tid)

    @cute.jit
    def _ring(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact, sW, sZ, tid, bid,
              warp, g, c):  # fmt: skip
        """The CTA's run of units through one ring (module docstring)."""
        NRT, NCH, NS = self.NRT, self.NCH, self.S
        nact = mNact[0]
        total = nact * NRT
        lo = bid * total // self.grid
        nu = (bid + 1) * total // self.grid - lo
        if nu > 0:  # lo < total: slot aA is active; aB only where the run reaches it
            aA = lo // NRT
            aB = cutlass.min(aA + 1, nact - 1)  # aA itself where aA is the last active slot
            mA = self._slot_meta(mPairs, mSlotE, mSlotOff, mSlotN, aA, tid, c)
            mB = self._slot_meta(mPairs, mSlotE, mSlotOff, mSlotN, aB, tid, c)
            for s in cutlass.range_constexpr(NS - 1):
                if s // NCH < nu:
                    self._load_step(mW13, mY, sW, sZ, lo + s // NCH, s % NCH, s, aA, mA, mB,
                                    tid)  # fmt: skip
                cute.arch.cp_async_commit_group()
            atom = mc.mma_atom()
            fa, fb = mc.fragments()
            for ui in cutlass.range(nu, unroll=1):
                u = lo + ui
                accs = mc.zero_accs(2 * self.RT)
                for cc in cutlass.range(NCH, unroll=1):
                    k = ui * NCH + cc
                    cute.arch.cp_async_wait_group(NS - 2)
                    cute.arch.barrier()  # step k landed for all; all past step k - 1's stage
                    nxt = cc + (NS - 1)
                    d = nxt // NCH
                    if ui + d < nu:  # the next unit's first chunks while this one's last run
                        self._load_step(mW13, mY, sW, sZ, u + d, nxt % NCH, (k + NS - 1) % NS,
                                        aA, mA, mB, tid)  # fmt: skip
                    cute.arch.cp_async_commit_group()
                    self._compute(sW, sZ, k % NS, warp, g, c, accs, fa, fb, atom)
                a = u // NRT
                isb = a != aA
                nn = cutlass.select_(isb, mB[1], mA[1])
                pp = [cutlass.select_(isb, y, x) for x, y in zip(mA[3], mB[3], strict=True)]
                self._epilogue(mH, accs, pp, nn, (u - a * NRT) * self.R, warp, g, c)
            cute.arch.cp_async_wait_group(0)


def build(T, E, K, L, Ie, H, S, beta, lbeta, pdl=True, nsm=132, cfg=None, shared=True, pk=None):
    """``(op, fake args)`` of :class:`W13T1Persist` (:func:`experts_t1.build_w13`'s list)."""
    op = W13T1Persist(T, E, K, L, Ie, H, S, beta, lbeta, pdl, nsm, cfg, shared, pk)
    _, args = t1.build_w13(T, E, K, L, Ie, H, S, beta, lbeta, pdl, 1 << 16, op.cfg, shared)
    return op, args
