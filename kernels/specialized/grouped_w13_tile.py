"""Grouped w13 + SiTU as a CTA-wide tile pipeline: ``DECODESCOPE_MOE_GROUPED_W13=tile``.

Same contract as :class:`moe_grouped.GroupedW13` (kernel 2 of the grouped experts): for each
selected expert (``slot_e[a]``, its pairs ``pairs[slot_off[a] : + slot_n[a]]`` from
:class:`moe_grouped.GroupedRoute`), ``h[p, :] = bf16(SiTU(w13_gate[e] @ z_t, w13_up[e] @ z_t))``
with ``z_t = bf16(y_front[t, E : E + L])`` (FP32 in memory), ``t = p // k``; FP32 accumulation:
the rounding points of :func:`moe_experts.moe_experts_ref`. PDL as the other grouped kernels.

Why another w13 (issue #5): at 32-64 tokens the H200 ran vLLM's Triton ``fused_moe`` w13 at
4.45 TB/s (ncu, notes/specialized_moe.md session 7) and ours (``ring``: per-lane rings, a CTA's
4 warps splitting K, 64-byte row runs per chunk) 12-14% slower. This kernel streams weights the
way Triton's tile and :mod:`tile_gemm` do:

- **Work item** (a CTA walks items ``bid, bid + grid, ...`` below ``nact * NRT``): one expert
  slot and ``R`` gate rows + the matching ``R`` up rows (``NRT = ceil(Ie / R)`` items per
  expert), ALL of K = L, the expert's tokens 8 per pass (MMA N; an expert has 1-3 tokens at
  64 tokens with random routing, more than 8 is rare and costs another pass over the weights).
- **Warps split rows, not K**: warp ``w`` owns ``RT`` gate row tiles of 16 and the matching up
  tiles, so SiTU runs on its own accumulators (no cross-warp reduction, no reduction smem).
  ``warps = R / (16 * RT)``.
- **CTA-shared pipeline**: ``stages`` shared-memory buffers of ``2R`` weight rows x ``BK``
  columns (every thread issues 16-byte ``cp.async.cg``; ``BK / 8`` consecutive threads read one
  row's ``2 * BK`` contiguous bytes: 128-byte runs at BK 64, 256 at BK 128) plus the pass's
  <= 8 tokens' z as FP32 (``8 x BK x 4`` bytes, loaded once per CTA and chunk, not per warp).
  Chunk ``i + stages - 1`` is issued while chunk ``i`` is multiplied: ``stages - 1`` chunks in
  flight per CTA. One ``bar.sync`` per chunk (the :mod:`tile_gemm` scheme).
- **Fragments from swizzled shared memory**: 16-byte unit ``u`` of weight row ``r`` is stored
  at ``u ^ (4 * (r % 2))`` (a quarter warp reads rows g, g + 1 at units c: opposite bank
  halves), FP32 z unit ``u`` of token ``m`` at ``u ^ (m % 2)``. K permutation and MMA helpers of
  :mod:`mma_common` (weights as M, tokens as N, lane (g, c) reads 8 contiguous K columns of each
  32-wide block: one 16-byte ``ld.shared`` per weight row, two per token's FP32 z, converted
  to BF16 in registers by each warp: 4 ``cvt`` per 32 K, cheaper than a second barrier).

Knobs (module defaults, environment overrides read at each call, part of the compile key, for
the H200 sweep): ``DECODESCOPE_MOE_W13T_ROWS`` (R), ``_BK``, ``_STAGES``, ``_RT``, ``_PERSIST``,
``_MT`` (8-token tiles per pass; unset: 1 up to 64 tokens, 2 above; each weight fragment
read from shared memory once and multiplied against every tile) (:func:`tile_config`). Shared
memory per CTA:
``stages * (2R * BK * 2 + 8 * MT * BK * 4)`` bytes
(108 KB at the defaults R 64, BK 128, 3 stages: two CTAs of 4 warps per SM, 92 registers;
``scripts/ptxas_w13_tile.py`` lists every sweep point).
"""

# no `from __future__ import annotations`: the Smem struct reads its field annotations
import os
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, const_expr

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized.moe_common import situ
from decodescope.kernels.specialized.moe_grouped import CTAS_PER_SM, _expert_mat, n_slots

ROWS = 16  # MMA M (one row tile)
TOK = 8  # MMA N: tokens per pass
SMEM_MAX = 227 * 1024

# defaults (the H200 sweep decides; see notes/specialized_moe.md "Session 9: GroupedW13 tile")
R_DEFAULT = 64  # gate rows per CTA (and as many up rows)
BK_DEFAULT = 128  # K columns per stage: 256-byte row runs, as Triton's BLOCK_K 128
STAGES_DEFAULT = 3  # as Triton's num_stages: 2 chunks (64 KB of weights) in flight per CTA
RT_DEFAULT = 1  # gate/up tile pairs per warp (warps = R / (16 * RT))
PERSIST_DEFAULT = 0  # 0: a CTA per item (grid cap CTAS_PER_SM); p > 0: p persistent CTAs per SM
# 8-token tiles per pass (``DECODESCOPE_MOE_W13T_MT``): an expert's tokens 8 * mt at a time, each
# weight fragment multiplied against mt token tiles once it is in registers. Above 64 tokens per
# step (the experts once over a chunked step's 256-512 tokens) an expert holds 6-11 tokens on
# average with the bench's routing, so a pass of 8 leaves many experts two or more passes, each
# streaming the item's weights again
MT_DEFAULT = 1
# unset ``DECODESCOPE_MOE_W13T_MT`` above this many tokens per launch: ``MT_ABOVE_64`` tiles
# (H200, session 20, same call, TP8 32x8 verify step, the experts once over 256 tokens: w13
# 1102.6 -> 909.0 us, KDA layer share 2219.3 -> 2025.3, projected step 206.88 -> 188.74 ms;
# at 32 tokens 2 tiles were slower, 403.5 -> 415.3 us; notes/gpu-logs/s20/r3)
MT_AUTO_ABOVE = 64
MT_ABOVE_64 = 2
# Above 64 tokens, where the knobs are unset (H200, session 21, scripts/gpu_grouped_sweep.py on
# the verify step's own routing, route + w13 + w2 medians, same call; notes/gpu-logs/s21/g1,
# g2): up to 256 tokens 4 stages (TP8 1457.6 -> 1428.0 us, TP16 743.7 -> 728.0 at 256), above
# 256 four 8-token tiles per pass, 3 stages (TP8 1917.6 -> 1779.8, TP16 1045.9 -> 963.1 at 512,
# where an expert holds ~11 pairs; at 256 four tiles gained nothing: 1455.2 / 755.2)
STAGES_64_256 = 4
MT4_ABOVE = 256

ENV = {
    "rows": "DECODESCOPE_MOE_W13T_ROWS",
    "bk": "DECODESCOPE_MOE_W13T_BK",
    "stages": "DECODESCOPE_MOE_W13T_STAGES",
    "rt": "DECODESCOPE_MOE_W13T_RT",
    "persist": "DECODESCOPE_MOE_W13T_PERSIST",
    "mt": "DECODESCOPE_MOE_W13T_MT",
}


@dataclass(frozen=True)
class TileConfig:
    """The compile-time tiling: ``rows`` gate rows per CTA (R), ``bk`` K columns per stage,
    ``stages`` pipeline buffers, ``rt`` gate/up tile pairs per warp; ``persist`` > 0: a grid
    of ``persist`` CTAs per SM whose pipeline runs on across items and passes (the loader
    fetches the next item's first chunks while the current item's last ones are multiplied:
    no per-item ramp); 0: the loop restarts its pipeline per item and pass."""

    rows: int = R_DEFAULT
    bk: int = BK_DEFAULT
    stages: int = STAGES_DEFAULT
    rt: int = RT_DEFAULT
    persist: int = PERSIST_DEFAULT
    mt: int = MT_DEFAULT

    def __post_init__(self) -> None:
        if self.mt not in (1, 2, 4):
            raise ValueError(f"grouped_w13_tile: mt={self.mt}, expected 1, 2 or 4")
        if self.rt not in (1, 2):
            raise ValueError(f"grouped_w13_tile: rt={self.rt}, expected 1 or 2")
        if self.rows % (ROWS * self.rt) or self.rows // (ROWS * self.rt) not in (1, 2, 4, 8):
            raise ValueError(
                f"grouped_w13_tile: rows={self.rows} must be 16 * rt * (1, 2, 4 or 8) (rt={self.rt})"
            )
        if self.bk not in (64, 128, 256):
            raise ValueError(f"grouped_w13_tile: bk={self.bk}, expected 64, 128 or 256")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"grouped_w13_tile: stages={self.stages}, expected 2..8")
        if not 0 <= self.persist <= 8:
            raise ValueError(f"grouped_w13_tile: persist={self.persist}, expected 0..8")
        if self.smem_bytes > SMEM_MAX:
            raise ValueError(
                f"grouped_w13_tile: {self} needs {self.smem_bytes} bytes of shared memory "
                f"> {SMEM_MAX}"
            )

    @property
    def warps(self) -> int:
        return self.rows // (ROWS * self.rt)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def stage_w_bytes(self) -> int:
        return 2 * self.rows * self.bk * 2

    @property
    def stage_z_bytes(self) -> int:
        return TOK * self.mt * self.bk * 4

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.stage_w_bytes + self.stage_z_bytes)


def tile_config(T: int | None = None) -> TileConfig:
    """The tiling from the environment (``DECODESCOPE_MOE_W13T_*``, unset: the module
    defaults; where ``T``, the launch's tokens, is above ``MT_AUTO_ABOVE``: ``mt``
    ``MT_ABOVE_64`` and ``STAGES_64_256`` stages up to ``MT4_ABOVE`` tokens, ``mt`` 4 above,
    each where its variable is unset); a bad value raises a one-line ``ValueError`` naming the
    variable."""
    vals = {}
    if T is not None and T > MT4_ABOVE:
        vals["mt"] = 4
    elif T is not None and T > MT_AUTO_ABOVE:
        vals |= {"mt": MT_ABOVE_64, "stages": STAGES_64_256}
    for field, var in ENV.items():
        v = os.environ.get(var, "")
        if v == "":
            continue
        if not v.isdigit():
            raise ValueError(f"{var}={v!r}: expected a positive integer")
        vals[field] = int(v)
    try:
        return TileConfig(**vals)
    except ValueError as e:
        raise ValueError(f"DECODESCOPE_MOE_W13T_*: {e}") from None


def w_unit(u, r):
    """Stored 16-byte unit of weight unit ``u`` in row ``r`` (int or DSL value)."""
    return u ^ (4 * (r % 2))


def z_unit(u, m):
    """Stored 16-byte unit (4 FP32) of z unit ``u`` of token slot ``m``."""
    return u ^ (m % 2)


class GroupedW13Tile:
    """Kernel 2 (``tile`` mode): gate/up of each selected expert, SiTU, ``h`` by pair."""

    def __init__(self, T, E, K, L, Ie, beta, lbeta, pdl=True, nsm: int = 132,
                 cfg: TileConfig | None = None):  # fmt: skip
        cfg = cfg or TileConfig()
        if L % cfg.bk:
            raise ValueError(f"grouped_w13_tile: latent {L} must be a multiple of bk={cfg.bk}")
        if Ie % ROWS:
            raise ValueError(f"grouped_w13_tile: expert_inter={Ie} must be a multiple of {ROWS}")
        if E % 4:
            raise ValueError(f"grouped_w13_tile: num_experts={E} must be a multiple of 4")
        self.T, self.E, self.K, self.L, self.Ie = T, E, K, L, Ie
        self.beta, self.lbeta, self.pdl, self.cfg = beta, lbeta, pdl, cfg
        self.R, self.BK, self.S, self.RT = cfg.rows, cfg.bk, cfg.stages, cfg.rt
        self.MT = cfg.mt
        self.TP = TOK * cfg.mt  # tokens per pass
        self.NW = cfg.warps
        self.NT = cfg.threads
        self.NCH = L // cfg.bk
        self.NRT = -(-Ie // self.R)  # items per expert
        self.partial = Ie % self.R != 0  # the last item's rows past Ie: not loaded nor stored
        self.UPR = self.BK // 8  # 16-byte units per weight row and chunk
        self.WP = 2 * self.R * self.UPR // self.NT  # weight pieces per thread and chunk
        self.RS = self.NT // self.UPR  # row step between a thread's pieces
        self.UZ = self.BK // 4  # 16-byte units (4 FP32) per token and chunk
        self.ZP = -(-self.TP * self.UZ // self.NT)  # z pieces per thread and chunk
        self.slots = n_slots(T, E, K)
        self.grid = min(self.slots * self.NRT, (cfg.persist or CTAS_PER_SM) * nsm)

    @cute.jit
    def __call__(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact,
                 stream: cuda.CUstream):  # fmt: skip
        S, R, BK = self.S, self.R, self.BK

        @cute.struct
        class Smem:
            w: cute.struct.Align[cute.struct.MemRange[BFloat16, S * 2 * R * BK], 128]
            z: cute.struct.Align[cute.struct.MemRange[Float32, S * self.TP * BK], 128]

        self.smem_cls = Smem
        self.kernel(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact).launch(
            grid=[self.grid, 1, 1],
            block=[self.NT, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=self.pdl,
        )

    @cute.kernel
    def kernel(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, mNact):
        S, R, BK, RT, NRT, Ie, K = self.S, self.R, self.BK, self.RT, self.NRT, self.Ie, self.K
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sW = st.w.get_tensor(cute.make_layout((S, 2 * R, BK), stride=(2 * R * BK, BK, 1)))
        TP = self.TP
        sZ = st.z.get_tensor(cute.make_layout((S, TP, BK), stride=(TP * BK, BK, 1)))
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        atom = mc.mma_atom()
        fa, fb = mc.fragments()
        nact = mNact[0]
        if const_expr(self.cfg.persist > 0):
            self._persist(mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, nact * NRT, sW, sZ,
                          tid, bid, warp, g, c, atom, fa, fb)  # fmt: skip
            return
        for item in cutlass.range(bid, nact * NRT, self.grid):  # (slot, row block) items
            a = item // NRT
            rt = item % NRT
            e = mSlotE[a]
            off = mSlotOff[a]
            n = mSlotN[a]
            mW = _expert_mat(mW13, e, 2 * Ie, self.L)
            row0 = rt * R  # first gate row of the item (its up rows: Ie + row0 ..)
            for ps in cutlass.range((n + TP - 1) // TP):
                nn = cutlass.min(n - ps * TP, TP)  # real tokens of this pass
                base = off + ps * TP
                # the tokens of this thread's z pieces (clamped: in bounds; only m < nn load)
                ztok = []
                for i in cutlass.range_constexpr(self.ZP):
                    m = tid // self.UZ + i * (self.NT // self.UZ)
                    ztok.append(mPairs[base + cutlass.min(m, nn - 1)] // K)
                # the pairs of this lane's output columns (tokens 8t + 2c, 8t + 2c + 1)
                pp = [mPairs[base + cutlass.min(8 * t + 2 * c + s, nn - 1)]
                      for t in range(self.MT) for s in range(2)]  # fmt: skip
                cute.arch.barrier()  # every warp is done with the stages of the last pass
                for s in cutlass.range_constexpr(S - 1):
                    if const_expr(s < self.NCH):
                        self._load(mW, mY, sW, sZ, row0, ztok, nn, s, s, tid)
                    cute.arch.cp_async_commit_group()
                accs = mc.zero_accs(2 * RT * self.MT)
                for i in cutlass.range(self.NCH, unroll=1):
                    cute.arch.cp_async_wait_group(S - 2)
                    cute.arch.barrier()  # chunk i landed for all; all past chunk i - 1
                    nxt = i + (S - 1)
                    if nxt < self.NCH:
                        self._load(mW, mY, sW, sZ, row0, ztok, nn, nxt, nxt % S, tid)
                    cute.arch.cp_async_commit_group()
                    self._compute(sW, sZ, i % S, warp, g, c, accs, fa, fb, atom)
                cute.arch.cp_async_wait_group(0)
                self._epilogue(mH, accs, pp, nn, row0, warp, g, c)

    @cute.jit
    def _item(self, mSlotE, mSlotOff, mSlotN, item, total):
        """``(e, off, n, row0)`` of work item ``item`` (clamped to the last one: loads stay in
        bounds; the callers test ``item < total``)."""
        it = cutlass.min(item, total - 1)
        a = it // self.NRT
        return mSlotE[a], mSlotOff[a], mSlotN[a], (it % self.NRT) * self.R

    @cute.jit
    def _pass(self, mPairs, off, n, ps, tid, c):
        """``(nn, ztok, pp)`` of pass ``ps`` of an expert's ``n`` pairs at ``off``: its real
        tokens, the tokens of the thread's z pieces, the pairs of the lane's output columns."""
        TP = self.TP
        nn = cutlass.min(n - ps * TP, TP)
        base = off + ps * TP
        ztok = []
        for i in cutlass.range_constexpr(self.ZP):
            m = tid // self.UZ + i * (self.NT // self.UZ)
            ztok.append(mPairs[base + cutlass.min(m, nn - 1)] // self.K)
        pp = [mPairs[base + cutlass.min(8 * t + 2 * c + s, nn - 1)]
              for t in range(self.MT) for s in range(2)]  # fmt: skip
        return nn, ztok, pp

    @cute.jit
    def _persist(self, mY, mW13, mH, mPairs, mSlotE, mSlotOff, mSlotN, total, sW, sZ, tid, bid,
                 warp, g, c, atom, fa, fb):  # fmt: skip
        """``persist`` mode: one pipeline over the CTA's whole chunk sequence (items ``bid,
        bid + grid, ..``, each item's passes, each pass's ``NCH`` chunks). A loader state (the
        chunk ``stages - 1`` ahead) and a consumer state advance separately; chunk ``g`` of the
        sequence sits in stage ``g % stages`` and in commit group ``g`` (one group per step,
        empty once the loader ran out), so the wait / barrier / refill discipline is the same
        as within one item, across item and pass boundaries too. Item and pass lookups (L2
        round trips) happen as the loader or consumer crosses a boundary; the loader's are
        consumed one step later, after that step's MMAs."""
        S, NCH, grid, Ie, L = self.S, self.NCH, self.grid, self.Ie, self.L
        # loader state: item, pass, chunk, and what they imply
        l_item = bid
        l_ps = Int32(0)
        l_kc = Int32(0)
        l_e, l_off, l_n, l_row0 = self._item(mSlotE, mSlotOff, mSlotN, l_item, total)
        l_nn, l_ztok, _ = self._pass(mPairs, l_off, l_n, l_ps, tid, c)
        l_g = Int32(0)  # chunks issued
        for s in cutlass.range_constexpr(S - 1):
            if l_item < total:
                mW = _expert_mat(mW13, l_e, 2 * Ie, L)
                self._load(mW, mY, sW, sZ, l_row0, l_ztok, l_nn, l_kc, s, tid)
                l_g = l_g + 1
                l_kc = l_kc + 1
                if l_kc == NCH:
                    l_kc = Int32(0)
                    l_ps = l_ps + 1
                    if l_ps * self.TP >= l_n:
                        l_ps = Int32(0)
                        l_item = l_item + grid
                        l_e, l_off, l_n, l_row0 = self._item(mSlotE, mSlotOff, mSlotN, l_item,
                                                             total)  # fmt: skip
                    l_nn, l_ztok, _ = self._pass(mPairs, l_off, l_n, l_ps, tid, c)
            cute.arch.cp_async_commit_group()
        # consumer state
        c_item = bid
        c_ps = Int32(0)
        c_kc = Int32(0)
        c_g = Int32(0)  # chunks consumed
        _, c_off, c_n, c_row0 = self._item(mSlotE, mSlotOff, mSlotN, c_item, total)
        c_nn, _, c_pp = self._pass(mPairs, c_off, c_n, c_ps, tid, c)
        accs = mc.zero_accs(2 * self.RT * self.MT)
        while c_item < total:
            cute.arch.cp_async_wait_group(S - 2)
            cute.arch.barrier()  # chunk c_g landed for all; all past chunk c_g - 1
            if l_item < total:  # refill the stage of chunk c_g - 1 with chunk l_g
                mW = _expert_mat(mW13, l_e, 2 * Ie, L)
                self._load(mW, mY, sW, sZ, l_row0, l_ztok, l_nn, l_kc, l_g % S, tid)
                l_g = l_g + 1
                l_kc = l_kc + 1
                if l_kc == NCH:
                    l_kc = Int32(0)
                    l_ps = l_ps + 1
                    if l_ps * self.TP >= l_n:
                        l_ps = Int32(0)
                        l_item = l_item + grid
                        l_e, l_off, l_n, l_row0 = self._item(mSlotE, mSlotOff, mSlotN, l_item,
                                                             total)  # fmt: skip
                    l_nn, l_ztok, _ = self._pass(mPairs, l_off, l_n, l_ps, tid, c)
            cute.arch.cp_async_commit_group()
            self._compute(sW, sZ, c_g % S, warp, g, c, accs, fa, fb, atom)
            c_g = c_g + 1
            c_kc = c_kc + 1
            if c_kc == NCH:  # the pass is complete: SiTU, store, next pass or item
                self._epilogue(mH, accs, c_pp, c_nn, c_row0, warp, g, c)
                for q in cutlass.range_constexpr(2 * self.RT * self.MT):
                    accs[q].fill(0.0)
                c_kc = Int32(0)
                c_ps = c_ps + 1
                if c_ps * self.TP >= c_n:
                    c_ps = Int32(0)
                    c_item = c_item + grid
                    _, c_off, c_n, c_row0 = self._item(mSlotE, mSlotOff, mSlotN, c_item, total)
                c_nn, _, c_pp = self._pass(mPairs, c_off, c_n, c_ps, tid, c)
        cute.arch.cp_async_wait_group(0)

    @cute.jit
    def _load(self, mW, mY, sW, sZ, row0, ztok, nn, kc, stg, tid):
        """cp.async of chunk ``kc`` (K columns ``kc * BK ..``) into stage ``stg``: the item's
        ``2R`` weight rows (gate rows ``row0 ..`` then up rows ``Ie + row0 ..``) and the FP32
        z of the pass's tokens ``m < nn``."""
        R, UPR, RS, Ie = self.R, self.UPR, self.RS, self.Ie
        u = tid % UPR
        r_t = tid // UPR
        for i in cutlass.range_constexpr(self.WP):
            rl = r_t + i * RS  # local row (RS divides R: gate vs up is known at trace time)
            if const_expr(i * RS >= R):  # an up row
                grow = row0 + rl - R  # the gate row index it matches
                src_row = Ie + grow
            else:
                grow = row0 + rl
                src_row = grow
            dst = cute.local_tile(sW[stg, rl, None], (8,), (w_unit(u, r_t),))
            if const_expr(self.partial):
                if grow < Ie:
                    src = cute.local_tile(mW[src_row, None], (8,), (kc * UPR + u,))
                    mc.cp_async16(dst, src)
            else:
                src = cute.local_tile(mW[src_row, None], (8,), (kc * UPR + u,))
                mc.cp_async16(dst, src)
        uz = tid % self.UZ
        for i in cutlass.range_constexpr(self.ZP):
            m = tid // self.UZ + i * (self.NT // self.UZ)
            if m < nn:
                zsrc = cute.local_tile(mY[ztok[i], None], (4,), (self.E // 4 + kc * self.UZ + uz,))
                zdst = cute.local_tile(sZ[stg, m, None], (4,), (z_unit(uz, m),))
                mc.cp_async16(zdst, zsrc)

    @cute.jit
    def _compute(self, sW, sZ, stg, warp, g, c, accs, fa, fb, atom, zg=None):
        """The MMAs of one chunk: per 32-wide K block, the lane's z of token ``g`` (two FP32
        units, to BF16) against its gate/up tiles' rows ``g``, ``g + 8`` (one 16-byte read
        each); accumulators ``accs[2q]`` (gate) and ``accs[2q + 1]`` (up) of pair ``q``.
        ``zg``: the z slot to read instead of ``g`` (a subclass whose z stages hold fewer
        token slots clamps it; columns past the pass's tokens are never stored)."""
        if const_expr(self.MT > 1):
            self._compute_mt(sW, sZ, stg, warp, g, c, accs, fa, fb, atom)
            return
        zr = g if zg is None else zg
        for h in cutlass.range_constexpr(self.BK // 32):
            xb = self._z_bf16(sZ, stg, zr, h, c)
            mc.mma_k16(atom, accs, fa, fb, xb, self._w_tiles(sW, stg, warp, g, c, h))

    @cute.jit
    def _compute_mt(self, sW, sZ, stg, warp, g, c, accs, fa, fb, atom):
        """:meth:`_compute` with ``MT`` token tiles per pass: each weight tile's fragments,
        read from shared memory once, are multiplied against token tile ``t``'s z (slot
        ``8t + g``) into accumulators ``accs[2 RT t + 2q (+1)]``."""
        for h in cutlass.range_constexpr(self.BK // 32):
            tiles = self._w_tiles(sW, stg, warp, g, c, h)
            for t in cutlass.range_constexpr(self.MT):
                xb = self._z_bf16(sZ, stg, 8 * t + g, h, c)
                mc.mma_k16(atom, accs, fa, fb, xb,
                           [(lo, hi, 2 * self.RT * t + ai) for lo, hi, ai in tiles])  # fmt: skip

    def _z_bf16(self, sZ, stg, zr, h, c):
        """Trace-time helper (plain Python loops, unrolled as the kernel is traced): the lane's 8 z values of token slot ``zr`` for 32-wide K block
        ``h`` (two FP32 units from shared memory), as BF16 registers."""
        zf = cute.make_rmem_tensor((8,), Float32)
        for v in range(2):
            zu = cute.local_tile(sZ[stg, zr, None], (4,), (z_unit(8 * h + 2 * c + v, zr),))
            cute.autovec_copy(zu, cute.local_tile(zf, (4,), (v,)))
        xb = cute.make_rmem_tensor((8,), BFloat16)
        xb.store(zf.load().to(BFloat16))
        return xb

    def _w_tiles(self, sW, stg, warp, g, c, h):
        """Trace-time helper: the warp's gate / up weight fragments of K block ``h`` (rows
        ``g``, ``g + 8`` of each tile, one 16-byte read each) as ``(lo, hi, acc index)``."""
        R, RT = self.R, self.RT
        pu = w_unit(4 * h + c, g)  # rows g, g + 8, R + ... share g's parity
        tiles = []
        for q in range(RT):
            rg = warp * (ROWS * RT) + q * ROWS + g
            for half, r in ((0, rg), (1, R + rg)):
                lo = cute.make_rmem_tensor((8,), BFloat16)
                hi = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(sW[stg, r, None], (8,), (pu,)), lo)
                cute.autovec_copy(cute.local_tile(sW[stg, r + 8, None], (8,), (pu,)), hi)
                tiles.append((lo, hi, 2 * q + half))
        return tiles

    @cute.jit
    def _epilogue(self, mH, accs, pp, nn, row0, warp, g, c):
        """``h[p, row] = bf16(SiTU(gate, up))`` for the lane's tokens ``8t + 2c + s < nn``
        (``pp[2t + s]``: their pairs)."""
        for t in cutlass.range_constexpr(self.MT):
            for q in cutlass.range_constexpr(self.RT):
                ga = accs[2 * self.RT * t + 2 * q]
                ua = accs[2 * self.RT * t + 2 * q + 1]
                for hh in cutlass.range_constexpr(2):
                    row = row0 + warp * (ROWS * self.RT) + q * ROWS + g + 8 * hh
                    for s in cutlass.range_constexpr(2):
                        if 8 * t + 2 * c + s < nn:
                            hv = situ(ga[2 * hh + s], ua[2 * hh + s], self.beta, self.lbeta)
                            if const_expr(self.partial):
                                if row < self.Ie:
                                    mH[pp[2 * t + s], row] = hv.to(BFloat16)
                            else:
                                mH[pp[2 * t + s], row] = hv.to(BFloat16)


# -- torch-facing --------------------------------------------------------------------------


def build(T, E, K, L, Ie, S, beta, lbeta, pdl, nsm=132, cfg: TileConfig | None = None):
    """``(op, fake args)`` with :func:`moe_grouped._build_w13`'s argument list."""
    op = GroupedW13Tile(T, E, K, L, Ie, beta, lbeta, pdl, nsm, cfg)
    i32 = torch.int32
    sl = op.slots
    args = (
        itf.fake(torch.float32, (T, E + L + 2 * S)),
        itf.fake(torch.bfloat16, (E, 2 * Ie, L)),
        itf.fake(torch.bfloat16, (T * K, Ie)),
        itf.fake(i32, (T * K,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (sl,)),
        itf.fake(i32, (4,)),
        itf.env_stream(),
    )
    return op, args


def coverage(op: GroupedW13Tile, nact: int, slot_n: list[int]) -> dict:
    """The kernel's item / pass / warp / lane index math replayed in Python: how often each
    ``(slot, token slot, h row)`` output is stored (CPU tests: every one exactly once)."""
    from collections import Counter

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
                                row = rt * op.R + warp * ROWS * op.RT + q * ROWS + g + 8 * hh
                                for s in range(2):
                                    col = 8 * t + 2 * c + s
                                    if col < nn and row < op.Ie:
                                        out[(a, ps * op.TP + col, row)] += 1
    return out


def smem_reads(op: GroupedW13Tile) -> dict:
    """The loader's and the fragment reads' shared-memory index math replayed in Python, for
    one chunk: ``{(stage row, stored unit): (global row offset in the item, K unit)}`` written
    by the threads, and for each lane and 32-wide block the rows/units it reads. The CPU test
    checks that every lane reads exactly the 8 K columns its fragment stands for."""
    R, UPR = op.R, op.UPR
    written = {}
    for tid in range(op.NT):
        u, r_t = tid % UPR, tid // UPR
        for i in range(op.WP):
            rl = r_t + i * op.RS
            key = (rl, w_unit(u, r_t))
            assert key not in written, key
            written[key] = (rl, u)  # local row rl holds K unit u of that row
    zw = {}
    for tid in range(op.NT):
        uz = tid % op.UZ
        for i in range(op.ZP):
            m = tid // op.UZ + i * (op.NT // op.UZ)
            if m < op.TP:
                key = (m, z_unit(uz, m))
                assert key not in zw, key
                zw[key] = (m, uz)
    return {"w": written, "z": zw, "R": R}
