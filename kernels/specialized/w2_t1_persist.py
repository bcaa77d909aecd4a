"""A persistent w2 for the experts at one token: ``DECODESCOPE_MOE_T1_W2=persist`` (issue #5).

Kernel 3 of the ``t1`` mode (:mod:`experts_t1`): the default since session 12 where the shared
down runs in w13 (the default) and the experts are at least ``PERSIST_MIN_IE`` wide per rank
(TP8; at TP16 it was slower in the layer, :func:`variant`); ``DECODESCOPE_MOE_T1_W2=tile``:
:class:`experts_t1.W2T1`, the default before. H200 s12/r1, TP8, one token, alone: 16.4 -> 13.3 us (bytes floor 10.5);
the experts kernel 44.6 -> 43.4 us, the MoE block 86.8 -> 85.4 (``gpu_specialized_moe.py``,
``grouped_t1`` vs ``grouped_t1_w2p``). Same contract, launch slot, PDL placement and rounding as W2T1 (FP32 MMA accumulation per
row over all of ``Ie``, ``acc[t, row] += weight(p) * y`` by ``red.global.add.f32``); only the
work split and the pipeline differ.

Why: W2T1 runs one 48 KB item (64 rows of one expert's ``w2[e]``, TP8) per CTA, 896 CTAs at 4
per SM, ~1.7 waves; each CTA is a chain of list reads, weight copies, ``h``, MMAs and atomics, and
its stages drain at the item's end (H200 s10/r2: 16.1 us alone against a 10.5 us bytes floor).
Here a fixed grid of ``PER_SM x nsm`` CTAs (3 per SM by default: 396 at TP8) each takes one
contiguous run of the selected experts' row blocks and streams it through one ring of ``NS``
shared-memory stages that runs across the row-block boundaries, so a CTA's copies never drain
until its run ends.

- **Units**: ``R = warps x 16`` rows of one selected expert (slot-major: slot ``a``, row block
  ``cb``; unit ``u = a x CE + cb``, ``CE = ceil(L / R)``), ``total = nact x CE``. CTA ``b``
  takes units ``[b x total // grid, (b + 1) x total // grid)``: contiguous, the counts differ by
  at most one, and since ``grid >= slots >= nact`` a run is at most ``CE`` units, so it touches at
  most two slots (``aA``, ``aA + 1``), whose lists, ``h`` rows, pairs and routing weights are read
  once, before the PDL wait (the route's lists are final then, as in W2T1), and selected per
  unit. Default ``R = 32`` (2 warps): 1792 units over 396 CTAs at TP8, 4-5 each (~145 rows,
  ~109 KB of weights).
- **Ring**: a stream of ``(unit, K chunk)`` steps; step ``k`` lives in stage ``k % NS``; the
  first ``NS - 1`` steps' weight copies are issued before the PDL wait (constant data), their
  ``h`` copies after it; then per step: wait for its group, a CTA barrier (every warp is past
  step ``k - 1``'s stage), issue step ``k + NS - 1`` (the next unit's first chunks while this
  unit's last ones are multiplied), MMAs; after a unit's last chunk, its epilogue (W2T1's).
- Default ``NS = 5`` stages of ``(R + 8) x BK`` BF16 (10 KB at TP8: 50 KB per CTA, 3 per SM by
  shared memory; 40 KB of weights in flight per CTA, 120 KB per SM).

Knobs (read at each call, part of the compile key): ``DECODESCOPE_MOE_T1_W2P_WARPS`` (2),
``_STAGES`` (5), ``_PERSM`` (3). The w2 tile's other knobs as W2T1 pins them
(:func:`experts_t1.w2_knobs`; its ``DECODESCOPE_MOE_W2T_BK`` / ``_MT`` apply).
"""

from __future__ import annotations

import dataclasses
import os

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from decodescope.kernels.specialized import experts_t1 as t1
from decodescope.kernels.specialized import grouped_w2_tile as gw2
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized import moe_grouped as mg

DEF_WARPS = 2  # 32-row units: 1792 at TP8, 4-5 per CTA
DEF_STAGES = 5  # ring stages: 4 chunks of weights in flight per CTA
DEF_PER_SM = 3  # CTAs per SM of the persistent grid
ENV = {
    "warps": ("DECODESCOPE_MOE_T1_W2P_WARPS", (1, 2, 4, 8)),
    "stages": ("DECODESCOPE_MOE_T1_W2P_STAGES", tuple(range(2, 9))),
    "per_sm": ("DECODESCOPE_MOE_T1_W2P_PERSM", tuple(range(1, 17))),
}
VARIANTS = ("tile", "persist")  # DECODESCOPE_MOE_T1_W2 (unset: persist where it can run)


@dataclasses.dataclass(frozen=True)
class PersistKnobs:
    warps: int = DEF_WARPS
    stages: int = DEF_STAGES
    per_sm: int = DEF_PER_SM


PERSIST_MIN_IE = 384  # the default persists from this expert width per rank (TP8: 384; TP16: 192)


def variant(ie: int | None = None) -> str:
    """``DECODESCOPE_MOE_T1_W2``: ``tile`` (:class:`experts_t1.W2T1`) or ``persist``; unset:
    ``persist`` where the shared down runs in w13 (``DECODESCOPE_MOE_T1_SHARED``, default
    ``w13``; the persistent kernel has no shared-down CTAs) and the experts' width per rank
    ``ie`` (None: not considered) is at least ``PERSIST_MIN_IE``, else ``tile``. In the layer
    (H200 s12, bench by share, experts + latent up): TP8 (``ie`` 384) -1.5 / -0.6 us (KDA /
    MLA), TP16 (192) +1.8 / +1.9 us, so TP16 keeps W2T1."""
    v = os.environ.get("DECODESCOPE_MOE_T1_W2", "")
    if not v:
        from decodescope.kernels.specialized import experts_t1 as t1

        wide = ie is None or ie >= PERSIST_MIN_IE
        return "persist" if t1.shared_where() == "w13" and wide else "tile"
    if v not in VARIANTS:
        raise ValueError(f"DECODESCOPE_MOE_T1_W2={v!r}: expected one of {VARIANTS}")
    return v


def knobs() -> PersistKnobs:
    """:class:`PersistKnobs` from ``DECODESCOPE_MOE_T1_W2P_*`` (a bad value: one-line error)."""
    vals = {}
    for name, (var, allowed) in ENV.items():
        v = os.environ.get(var, "")
        if v == "":
            continue
        if not v.isdigit() or int(v) not in allowed:
            raise ValueError(f"{var}={v!r}: expected one of {allowed}")
        vals[name] = int(v)
    return PersistKnobs(**vals)


def split(total: int, grid: int, b: int) -> tuple[int, int]:
    """CTA ``b``'s units ``[lo, hi)`` of ``total`` (the kernel's formula)."""
    return b * total // grid, (b + 1) * total // grid


class W2T1Persist(t1.W2T1):
    """Kernel 3 of the ``t1`` mode, persistent (module docstring)."""

    def __init__(self, T, E, K, L, Ie, H, S, pdl=True, nsm: int = 132,
                 pk: PersistKnobs | None = None):  # fmt: skip
        pk = pk or knobs()
        kn = dataclasses.replace(t1.w2_knobs(), warps=pk.warps, rt=1, stages=pk.stages)
        # the parent's grid (one item per CTA, capped at cap x nsm) is replaced below: its cap
        # check does not apply (nsm 1 << 16 lifts it)
        super().__init__(T, E, K, L, Ie, H, S, pdl, 1 << 16, kn, shared=False, pre=True)
        self.pk = pk
        self.NS = self.stages
        self.nbuf = self.NS  # a ring across units: every stage used
        self.smem = self.nbuf * (self.R + self.MP) * self.BK * 2
        if self.smem > gw2.SMEM_MAX:
            raise ValueError(f"w2_t1_persist: {self.smem} bytes of shared memory")
        self.units = self.slots * self.CE
        self.grid = min(pk.per_sm * nsm, self.units)
        if self.grid < self.slots:  # a run of <= CE units: at most two slots
            raise ValueError(f"w2_t1_persist: grid {self.grid} < {self.slots} slots")
        self.UPC = -(-self.units // self.grid)  # most units of a CTA

    def plan(self, nact: int, b: int) -> list[tuple]:
        """Replay of CTA ``b``'s stream (trace-time mirror of the kernel's index math): the
        ``(step, unit, slot, row0, chunk, stage)`` of every load in issue order, and the
        ``(unit, slot, row0)`` of every epilogue, as ``("load", ...)`` / ``("epi", ...)``."""
        CE, NCH, NS, R = self.CE, self.NCH, self.NS, self.R
        lo, hi = split(nact * CE, self.grid, b)
        nu = hi - lo
        out = []
        if nu <= 0:
            return out
        aA = lo // CE

        def load(k):
            d, kc = divmod(k, NCH)
            u = lo + d
            a = u // CE
            assert a in (aA, aA + 1) and a < nact
            out.append(("load", k, u, a, (u - a * CE) * R, kc, k % NS))

        for s in range(NS - 1):
            if s // NCH < nu:
                load(s)
        for ui in range(nu):
            for cc in range(NCH):
                k = ui * NCH + cc
                if ui + (cc + NS - 1) // NCH < nu:
                    load(k + NS - 1)
            u = lo + ui
            a = u // CE
            out.append(("epi", u, a, (u - a * CE) * R))
        return out

    @cute.kernel
    def kernel(self, mH, mHs, mW2, mWs2, mAcc, mShared, mPairs, mTw, mSlotE, mSlotOff, mSlotN,
               mNact):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sW, sX = self.stage_buffers(smem)
        self._run(mH, mW2, mAcc, mPairs, mTw, mSlotE, mSlotOff, mSlotN, mNact, sW, sX, bid, tid)

    def _slot_meta(self, mPairs, mTw, mSlotE, mSlotOff, mSlotN, a, c, tid):
        """Slot ``a``'s ``(e, np_, h rows, token slots)`` (trace time; relaxed GPU-scope loads:
        read before the PDL wait). ``h rows``: the pair rows of this thread's ``h`` units;
        token slots: ``(j, pair, routing weight)`` of the lane's epilogue columns."""
        MP, U, NT = self.MP, self.U, self.NT
        e = t1._ld(mSlotE, a)
        off = t1._ld(mSlotOff, a)
        np_ = cutlass.min(t1._ld(mSlotN, a), MP)
        hrows = []
        for i in range(-(-(MP * U) // NT)):
            t, _ = gw2.piece(tid + i * NT, U)
            hrows.append(t1._ld(mPairs, off + cutlass.min(t, np_ - 1)))
        slots = []
        for jt in range(self.MT):
            for s2 in range(2):
                j = jt * 8 + 2 * c + s2
                p = t1._ld(mPairs, off + cutlass.min(j, np_ - 1))
                slots.append((j, p, t1._ld(mTw, p, Float32)))
        return e, np_, hrows, slots

    @cute.jit
    def _load_step(self, mH, mW2, sW, sX, u, kc, stg, aA, eA, eB, hA, hB, npA, npB, tid,
                   weights: cutlass.Constexpr[bool], h: cutlass.Constexpr[bool]):  # fmt: skip
        """Copies of unit ``u``'s chunk ``kc`` into stage ``stg``: its weight rows and / or its
        ``h`` rows (slot ``aA``'s or ``aA + 1``'s)."""
        a = u // self.CE
        isb = a != aA
        if const_expr(weights):
            e = cutlass.select_(isb, eB, eA)
            mW = mg._expert_mat(mW2, e, self.L, self.Ie)
            self._load_w(mW, sW, (u - a * self.CE) * self.R, kc, stg, tid)
        if const_expr(h):
            hr = [cutlass.select_(isb, y, x) for x, y in zip(hA, hB, strict=True)]
            self._load_h(mH, sX, hr, cutlass.select_(isb, npB, npA), kc, stg, tid)

    @cute.jit
    def _run(self, mH, mW2, mAcc, mPairs, mTw, mSlotE, mSlotOff, mSlotN, mNact, sW, sX, bid,
             tid):  # fmt: skip
        """The CTA's run: metadata and the first ``NS - 1`` steps' weights, the PDL wait, their
        ``h``, then the ring (module docstring)."""
        CE, NCH, NS, R = self.CE, self.NCH, self.NS, self.R
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        nact = t1._ld(mNact, 0)
        total = nact * CE
        lo = bid * total // self.grid
        nu = (bid + 1) * total // self.grid - lo
        if nu > 0:  # lo < total: slot aA is active; aB only where the run reaches it
            aA = lo // CE
            aB = cutlass.min(aA + 1, nact - 1)  # aA itself where aA is the last active slot
            eA, npA, hA, sA = self._slot_meta(mPairs, mTw, mSlotE, mSlotOff, mSlotN, aA, c, tid)
            eB, npB, hB, sB = self._slot_meta(mPairs, mTw, mSlotE, mSlotOff, mSlotN, aB, c, tid)
            meta = (aA, eA, eB, hA, hB, npA, npB, tid)
            for s in cutlass.range_constexpr(NS - 1):  # weights: before the wait
                if s // NCH < nu:
                    self._load_step(mH, mW2, sW, sX, lo + s // NCH, s % NCH, s, *meta, True,
                                    False)  # fmt: skip
            if const_expr(self.pdl):
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            for s in cutlass.range_constexpr(NS - 1):  # h (w13's output): after it
                if s // NCH < nu:
                    self._load_step(mH, mW2, sW, sX, lo + s // NCH, s % NCH, s, *meta, False,
                                    True)  # fmt: skip
                cute.arch.cp_async_commit_group()
            atom = mc.mma_atom()
            fa, fb = mc.fragments()
            for ui in cutlass.range(nu, unroll=1):
                u = lo + ui
                a = u // CE
                isb = a != aA
                accs = mc.zero_accs(self.RT * self.MT)
                for cc in cutlass.range_constexpr(NCH):
                    k = ui * NCH + cc
                    cute.arch.cp_async_wait_group(NS - 2)
                    cute.arch.barrier()  # step k landed for all; all past step k - 1's stage
                    d = (cc + NS - 1) // NCH
                    if ui + d < nu:
                        self._load_step(mH, mW2, sW, sX, u + d, (cc + NS - 1) % NCH,
                                        (k + NS - 1) % NS, *meta, True, True)  # fmt: skip
                    cute.arch.cp_async_commit_group()
                    self._compute(sW, sX, k % NS, warp, g, c, accs, fa, fb, atom)
                slots = [(j, cutlass.select_(isb, pb, pa), cutlass.select_(isb, wb, wa))
                         for (j, pa, wa), (_, pb, wb) in zip(sA, sB, strict=True)]  # fmt: skip
                self._epilogue(mAcc, accs, slots, cutlass.select_(isb, npB, npA), (u - a * CE) * R,
                               warp, g)  # fmt: skip
            cute.arch.cp_async_wait_group(0)


def build(T, E, K, L, Ie, H, S, pdl=True, nsm=132, pk=None):
    """``(op, fake args)`` of :class:`W2T1Persist` (:func:`moe_grouped._build_w2`'s list)."""
    op = W2T1Persist(T, E, K, L, Ie, H, S, pdl, nsm, pk)
    _, args = gw2.build(T, E, K, L, Ie, H, S, pdl, nsm, op.kn)
    return op, args
