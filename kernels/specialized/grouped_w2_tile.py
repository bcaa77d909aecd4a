"""GroupedW2 on a CTA-shared ``cp.async`` tile pipeline: ``DECODESCOPE_MOE_GROUPED_W2=tile``.

Same contract as :class:`moe_grouped.GroupedW2` (inputs ``h`` by pair, ``hs``, ``w2``,
``shared_w2``, the route lists; output ``acc[t, row] += weight(p) * (w2[e] @ h[p])`` by FP32
atomics, the shared expert's down projection stored into ``shared_out``; PDL wait first), so the
two are interchangeable in :func:`moe_grouped.moe_grouped` (issue #5).

Why: at 32-64 tokens the register/ring GroupedW2 streams its weights at ~3.5 TB/s where vLLM's
Triton ``fused_moe`` w2 reaches 4.27 TB/s (ncu, notes/specialized_moe.md, session 7). Ours
streams through a private per-lane ring: per K chunk a row contributes 64 contiguous bytes (4
lanes x 16 B) and every warp keeps its own 32 row streams going. Triton's tile shares each
stage across the CTA: 64 weight rows x 128 K (256 contiguous bytes per row per stage), all
threads issuing 16-byte ``cp.async``. This kernel takes that shape:

- **Item** = (selected expert slot ``a``, block ``cb`` of ``R = warps x RT x 16`` rows of its
  ``w2[e]`` [L, Ie]); a CTA walks items ``bid, bid + grid, ...`` (grid capped at ``cap``
  CTAs per SM: 512 by default, which at the kimi-k3 shapes is the worst case itself, so every
  CTA does at most one item, as Triton's; CTAs past the selected items read ``nact`` and exit;
  a cap of 64 had each CTA walk ~3 items at 64 tokens and lost 10 % on the H200). The item's
  rows ``cb*R .. cb*R + R - 1``
  are one contiguous run of ``R x Ie x 2`` bytes (48 KB at TP8, R = 64).
- **Pipeline** over the item's K = Ie in ``BK``-wide chunks through ``stages`` shared-memory
  buffers of ``(R + MP) x BK`` BF16 (``MP = 8 x MT`` token rows of ``h``): every thread issues
  16-byte ``cp.async.cg`` copies, consecutive threads on consecutive 16-byte units of one row
  (``BK x 2`` contiguous bytes per row and chunk, all chunks of an item issued back to back
  when ``stages > Ie / BK``, so HBM sees the whole contiguous block requested at once). The
  ``h`` rows of the item's tokens (``MP`` per pass, gathered by pair) ride in the same stages.
- **Warps split rows** (each warp ``RT`` 16-row MMA tiles over all of K; no cross-warp
  reduction), ``mma.sync.m16n8k16`` from shared memory with :mod:`tile_gemm`'s K permutation
  (one 16-byte ``ld.shared`` per weight row and per token row and 32 K columns) and swizzle
  (16-byte unit ``u`` of an odd row stored at ``u ^ 4``: the two rows a quarter warp reads land
  in opposite bank halves).
- **Epilogue**: each lane's token slots' pairs and routing weights are loaded before the K
  loop; ``red.global.add.f32`` per (row, pair) as in GroupedW2. Experts with more than ``MP``
  tokens take several passes (the weights again, from L2).
- **Shared expert**: the first ``CS`` CTAs, by default one per (``R`` rows of ``shared_w2``,
  ``MP`` tokens) on the same pipeline (``_SHARED=tile``), else (``regs``) GroupedW2's
  register-load shared-down code: 2 row tiles per warp, all tokens 8 per pass; plain FP32
  stores either way.
- **Defaults since the H200 run s10/r2** (``DEF_ORDER`` / ``DEF_SHARED`` / ``DEF_EARLY``):
  items in ``col`` order, the shared expert as tiles, ``early`` (TP8, w2 alone, us / floor:
  224.8 (1.09) -> 209.1 (0.98) at 32 tokens, 349.9 (1.15) -> 316.9 (1.06) at 64; Triton's w2
  0.98 on the same routing).

``DECODESCOPE_MOE_W2T_LOAD=bulk`` moves the same tiles differently: one more warp, the
producer, walks the CTA's (item, pass, chunk) stream and fills each stage with one
``cp.async.bulk`` per weight row and per token row (``BK x 2`` contiguous bytes each; rows padded
by 64 bytes instead of swizzled), completing on the stage's ``full`` mbarrier; the consumer
warps wait on it, multiply, and arrive on its ``empty`` mbarrier, which the producer waits on
before refilling. One instruction per 256-byte row run instead of 16 per-thread copies, no CTA
barrier, and the next item's chunks in flight while the current item's are multiplied (the
cp.async path refills only within an item).

Knobs (module constants ``DEF_*``, env overrides read at each call and part of the compile key,
so that one H200 run can sweep them): ``DECODESCOPE_MOE_W2T_WARPS`` (4), ``_RT`` (row tiles per
warp, 1), ``_BK`` (K chunk, 0 = the largest of 128 / 64 / 32 dividing Ie), ``_STAGES`` (0 = all
chunks of an item in flight, at most 4; bulk: stages = buffers, 0 = the chunks of one item),
``_MT`` (8-token tiles per pass, 1), ``_CAP`` (CTAs per SM of the routed grid, 512), ``_LOAD``
(``cp`` | ``bulk``), ``_ORDER`` (``auto``: ``col`` with cp loads, ``stride`` with bulk;
``stride``: a CTA walks items ``bid, bid + grid, ...``;
``block``: ``ceil(items / grid)`` consecutive items, neighbouring row blocks of one expert;
``col``: the worst case's item space with the expert slot fastest, items of unselected slots
skipped, so that the empty CTAs are spread through the grid as in Triton's, not all at its end),
``_SNJ`` (8-token tiles per pass of the shared-expert CTAs, 1: 8 passes at 64 tokens),
``_EARLY`` (unset: 1 with ``col``, else 0; 1 needs ``col``: the route lists read and the CTA's first item's weight copies
issued before ``griddepcontrol.wait``, so that CTAs resident during the previous
kernel's tail stream their weights then; CTAs of unselected slots exit without waiting),
``_SHARED`` (``auto``: ``tile`` where its tiles fit, else ``regs``; ``regs``: the register-load
shared expert above; ``tile``: the shared expert on the
routed items' pipeline, one CTA per (``R`` rows of ``shared_w2``, ``MP`` tokens), token groups
fastest so that the CTAs reading the same rows run together (L2 hits); ``H / R x ceil(T / MP)``
CTAs, 896 at TP8 and 64 tokens, instead of 56 CTAs of 8 passes each; ``spread``: the same CTAs
at every ``grid // CS``-th bid instead of first, so that their L2-bound reads overlap the routed
DRAM stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int32, Int64, const_expr
from cutlass.experimental import primitives as prims

from decodescope.kernels.specialized import env_knobs as knob
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized import moe_grouped as mg

DEF_WARPS = 4  # warps per CTA, each on its own rows
DEF_RT = 1  # 16-row MMA tiles per warp: R = warps x RT x 16 = 64 rows per item (Triton's BLOCK_N)
DEF_BK = 0  # K chunk (0: the largest of BK_CHOICES dividing Ie: 128 at TP8, 64 at TP16)
BK_CHOICES = (128, 64, 32)
DEF_STAGES = 0  # shared-memory stages (0: every chunk of an item in flight, capped at MAX_STAGES)
MAX_STAGES = 4
DEF_MT = 1  # 8-token MMA tiles per pass (tokens per expert at 64 tokens: mostly 1-3)
# routed CTAs per SM in the grid (past it, CTAs loop over items): 512, i.e. the worst case
# min(E, T*k) x L / R itself at the kimi-k3 shapes up to 64 tokens (50 k CTAs at 64, about half
# of them exit after reading nact): one item per CTA, as Triton's w2. H200 TP8 s9/r4, w2 alone,
# us / floor, cap 64 -> 512: 246.4 (1.14) -> 225.5 (1.09) at 32 tokens, 380.5 (1.25) -> 339.6
# (1.13) at 64 (with 64, each CTA walked ~3 items one after another); at 8 tokens the cap does
# not bind (7168 CTAs either way)
DEF_CAP = 512
SHARED_RT = 2  # row tiles per warp of the shared-expert CTAs (GroupedW2's tiling)
SMEM_MAX = 227 * 1024
LOADS = ("cp", "bulk")  # DECODESCOPE_MOE_W2T_LOAD
# DECODESCOPE_MOE_W2T_ORDER: which items a routed CTA walks: "stride" (bid, bid + grid, ...) or
# "block" (ceil(items / grid) consecutive ones: neighbouring row blocks of one expert), over the
# selected experts' items (expert-major: the CTAs past nact x CE, the empty ones, come last in
# the grid); "col": the worst case's item space slot-fastest, item i = (slot i % slots, row block
# i // slots), an item whose slot >= nact skipped: the empty CTAs spread through the grid, as in
# Triton's fused_moe grid (pid_m fastest), instead of trailing it
ORDERS = ("stride", "block", "col", "auto")  # auto: DEF_ORDER with cp loads, stride with bulk
SHARED_MODES = ("regs", "tile", "spread", "auto")  # DECODESCOPE_MOE_W2T_SHARED (auto: below)
# The defaults since the H200 run s10/r2 (commit 63dee67, notes/gpu-logs/s10/r2/a/w2col; TP8, w2
# alone, us / floor, Triton's w2 on the same routing beside): stride + register-load shared
# expert -> col + shared tile + early: 224.8 (1.09) -> 209.1 (0.98) at 32 tokens (Triton 207.9,
# 0.98), 349.9 (1.15) -> 316.9 (1.06) at 64 (Triton 292.3, 0.98); col + tile without early:
# 209.8 (1.04) / 323.8 (1.11). "auto" knobs resolve to them where they apply (cp loads; the
# shared tile where hidden and shared_inter fit its tiles) and to the old ones elsewhere.
DEF_ORDER = "col"
DEF_SHARED = "tile"
DEF_EARLY = 1


@dataclass(frozen=True)
class TileKnobs:
    """The compile-time choices of :class:`GroupedW2Tile` (0 = derived from the shapes)."""

    warps: int = DEF_WARPS
    rt: int = DEF_RT
    bk: int = DEF_BK
    stages: int = DEF_STAGES
    mt: int = DEF_MT
    cap: int = DEF_CAP
    load: str = "cp"  # "cp": every thread's cp.async; "bulk": a producer warp's cp.async.bulk
    order: str = "auto"  # ORDERS
    snj: int = 1  # 8-token tiles per pass of the shared-expert CTAs (capped at ceil(T / 8))
    # 1: a routed CTA reads the route lists and issues its first item's weight copies before
    # griddepcontrol.wait (order "col"); with one item per CTA, empty CTAs exit without waiting;
    # -1 (auto): DEF_EARLY where the order is col, else 0
    early: int = -1
    # "regs": the shared expert on the first CTAs with GroupedW2's register loads; "tile": on
    # the routed items' cp.async pipeline, one CTA per (R-row block of shared_w2, MP tokens);
    # "spread": those CTAs spread through the grid; "auto": DEF_SHARED where it applies
    shared: str = "auto"


_ENV = {  # knob -> (environment variable, allowed values)
    "warps": ("DECODESCOPE_MOE_W2T_WARPS", (1, 2, 4, 8)),
    "rt": ("DECODESCOPE_MOE_W2T_RT", (1, 2, 4)),
    "bk": ("DECODESCOPE_MOE_W2T_BK", (0, 32, 64, 128, 192, 256, 384)),
    "stages": ("DECODESCOPE_MOE_W2T_STAGES", tuple(range(0, 9))),
    "mt": ("DECODESCOPE_MOE_W2T_MT", (1, 2, 4)),
    "cap": ("DECODESCOPE_MOE_W2T_CAP", tuple(range(1, 513))),
    "load": ("DECODESCOPE_MOE_W2T_LOAD", LOADS),
    "order": ("DECODESCOPE_MOE_W2T_ORDER", ORDERS),
    "snj": ("DECODESCOPE_MOE_W2T_SNJ", (1, 2, 4)),
    "early": ("DECODESCOPE_MOE_W2T_EARLY", (0, 1)),  # unset: auto
    "shared": ("DECODESCOPE_MOE_W2T_SHARED", SHARED_MODES),
}


# Two 8-token tiles per pass above this many tokens per launch where DECODESCOPE_MOE_W2T_MT is
# unset (H200, session 21, scripts/gpu_grouped_sweep.py, route + w13 + w2 medians, same call:
# 512 tokens TP8 1917.6 -> 1877.3 us, TP16 1045.9 -> 1022.8; at 256 nothing, 1454.3 / 745.3
# against 1457.6 / 743.7)
MT2_ABOVE = 256


def knobs(T: int | None = None) -> TileKnobs:
    """:class:`TileKnobs` from the environment (``DECODESCOPE_MOE_W2T_*``), read at each call;
    ``mt`` unset: 2 where ``T``, the launch's tokens, is above ``MT2_ABOVE``; a bad value
    raises a one-line ``ValueError`` naming the variable."""
    vals = {name: knob.read(var, allowed) for name, (var, allowed) in _ENV.items()}
    if vals.get("mt") is None and T is not None and T > MT2_ABOVE:
        vals["mt"] = 2
    return TileKnobs(**{name: v for name, v in vals.items() if v is not None})


def piece(idx, U: int):
    """``(row, unit)`` of the 16-byte copy ``idx`` of a chunk (``U`` units per row):
    consecutive threads on consecutive units of one row. Works on ints and DSL integers."""
    return idx // U, idx % U


def swizzle(u, r, swz: int):
    """Shared-memory unit of logical 16-byte unit ``u`` of row ``r``: odd rows ``u ^ swz``."""
    return u ^ ((r % 2) * swz)


def read_unit(j: int, c, g, swz: int):
    """Shared-memory unit lane ``(g, c)`` reads for the 32-wide K slice ``j`` of a chunk (its
    8 columns ``32 j + 8 c ..``; every row it reads has ``g``'s parity)."""
    return swizzle(4 * j + c, g, swz)


class GroupedW2Tile:
    """Kernel 3 of the grouped path on a CTA-shared tile pipeline (module docstring)."""

    def __init__(self, T, E, K, L, Ie, H, S, pdl=True, nsm: int = 132,
                 kn: TileKnobs | None = None):  # fmt: skip
        kn = kn or TileKnobs()
        for name, v in (("latent", L), ("hidden", H)):
            if v % mg.ROWS:
                raise ValueError(f"grouped_w2_tile: {name} {v} must be a multiple of {mg.ROWS}")
        for name, v in (("expert_inter", Ie), ("shared_inter", S)):
            if v % mg.KCH:
                raise ValueError(f"grouped_w2_tile: {name} {v} must be a multiple of {mg.KCH}")
        bk = kn.bk or next((b for b in BK_CHOICES if Ie % b == 0), 0)
        if not bk or Ie % bk or bk % 32 or (bk != 32 and bk % 64):
            raise ValueError(f"grouped_w2_tile: K chunk {kn.bk or bk} must divide expert_inter "
                             f"{Ie} and be 32 or a multiple of 64 (the swizzle)")  # fmt: skip
        self.T, self.E, self.K, self.L, self.Ie, self.H, self.S = T, E, K, L, Ie, H, S
        self.pdl = pdl
        if kn.load not in LOADS:
            raise ValueError(f"grouped_w2_tile: load {kn.load!r}, expected one of {LOADS}")
        self.load = kn.load
        if kn.order not in ORDERS:
            raise ValueError(f"grouped_w2_tile: order {kn.order!r}, expected one of {ORDERS}")
        self.bulk = kn.load == "bulk"
        order = kn.order if kn.order != "auto" else ("stride" if self.bulk else DEF_ORDER)
        self.order = order
        self.blocked = order == "block"
        self.col = order == "col"
        if self.col and self.bulk:
            raise ValueError("grouped_w2_tile: order 'col' is for load 'cp' only")
        if kn.early not in (-1, 0, 1):
            raise ValueError(f"grouped_w2_tile: early {kn.early}, expected 0 or 1 (-1: auto)")
        self.early = bool(kn.early if kn.early >= 0 else DEF_EARLY and self.col)
        self.NW, self.RT, self.MT, self.BK = kn.warps, kn.rt, kn.mt, bk
        self.NT = (self.NW + self.bulk) * 32  # bulk: one more warp, the producer
        self.R = self.NW * self.RT * mg.ROWS  # weight rows per item
        self.MP = 8 * self.MT  # token rows of h per pass
        self.U = bk // 8  # 16-byte units per row and chunk
        self.NCH = Ie // bk
        if self.bulk:
            # the producer fills every buffer ahead of the consumers (full / empty mbarriers)
            self.stages = kn.stages or min(self.NCH, MAX_STAGES - 1) or 1
            if not 1 <= self.stages <= 8 or self.MP > 32:
                raise ValueError(f"grouped_w2_tile: bulk stages {self.stages} (1..8), tokens per "
                                 f"pass {self.MP} (<= 32)")  # fmt: skip
            self.swz = 0  # rows padded instead (a bulk copy cannot swizzle): stride = 64 mod 128
            self.BKP = bk + 32 if (bk * 2) % 128 == 0 else bk
            self.nbuf = self.stages
            self.smem = self.nbuf * ((self.R + self.MP) * self.BKP * 2 + 16)
        else:
            self.stages = kn.stages or min(self.NCH + 1, MAX_STAGES)
            if not 2 <= self.stages <= 8:
                raise ValueError(f"grouped_w2_tile: stages {self.stages}, expected 2..8")
            if (self.R * self.U) % self.NT:
                raise ValueError(f"grouped_w2_tile: {self.R} rows x {self.U} units do not split "
                                 f"over {self.NT} threads")  # fmt: skip
            self.swz = 4 if self.U >= 8 else 0  # odd rows: unit ^ 4 (U = 4: halves alternate)
            self.BKP = bk
            # buffers: NS - 1 chunks in flight plus the one being read; with every chunk of an
            # item in flight (NS > NCH) only NCH of them are ever used
            self.nbuf = min(self.stages, self.NCH)
            self.smem = self.nbuf * (self.R + self.MP) * bk * 2
        if self.smem > SMEM_MAX:
            raise ValueError(f"grouped_w2_tile: {self.smem} bytes of shared memory > {SMEM_MAX}")
        self.CE = -(-L // self.R)  # items per expert
        self.full_rows = L % self.R == 0
        self.ntH = H // mg.ROWS
        self.CS = -(-H // (self.NW * SHARED_RT * mg.ROWS))  # shared-expert CTAs (first)
        if kn.shared not in SHARED_MODES:
            raise ValueError(f"grouped_w2_tile: shared {kn.shared!r}, expected one of "
                             f"{SHARED_MODES}")  # fmt: skip
        shared = kn.shared
        if shared == "auto":  # the shared tile where its tiles fit (cp loads, whole tiles)
            fits = not self.bulk and H % self.R == 0 and S % bk == 0
            shared = DEF_SHARED if fits or DEF_SHARED == "regs" else "regs"
        self.shared = shared
        self.shtile = shared in ("tile", "spread")
        self.spread = shared == "spread"
        if self.shtile:  # CTA (row block, token group), token group fastest: L2 reuse
            if self.bulk or H % self.R or S % bk:
                raise ValueError(f"grouped_w2_tile: shared 'tile' needs load 'cp', hidden {H} a "
                                 f"multiple of {self.R} rows, shared_inter {S} of {bk}")  # fmt: skip
            self.NTG = -(-T // self.MP)  # token groups
            self.CS = H // self.R * self.NTG
            self.NCHS = S // bk  # K chunks of a shared item
            if self.NCHS > 1 and self.nbuf < 2:  # a ring needs two buffers (tiny shapes)
                self.nbuf = 2
                self.smem = self.nbuf * (self.R + self.MP) * bk * 2
            # its stages: every chunk in flight where the buffers hold them all, else a ring
            self.NSS = self.NCHS + 1 if self.nbuf >= self.NCHS else self.nbuf
            if self.NSS < 2:
                raise ValueError("grouped_w2_tile: shared 'tile' needs 2 stages")
        self.Us = mg._div_pick(S // mg.KCH, (4, 3, 2, 1))
        if kn.snj not in (1, 2, 4):
            raise ValueError(f"grouped_w2_tile: shared token tiles {kn.snj}, expected 1, 2 or 4")
        self.SNJ = min(kn.snj, -(-T // 8))
        self.slots = mg.n_slots(T, E, K)
        self.nr = min(self.slots * self.CE, kn.cap * nsm)  # routed CTAs
        self.grid = self.CS + self.nr
        # shared=spread: shared CTA j at bid j * SPS (the shared items' L2 reads spread through
        # the routed DRAM stream instead of all in the first waves)
        self.SPS = self.grid // self.CS if self.spread else 1
        self.step = 1 if self.blocked else self.nr  # item stride of a routed CTA
        if self.early and not self.col:
            raise ValueError("grouped_w2_tile: early needs order 'col'")
        self.kn = kn

    @cute.jit
    def __call__(self, mH, mHs, mW2, mWs2, mAcc, mShared, mPairs, mTw, mSlotE, mSlotOff,
                 mSlotN, mNact, stream):  # fmt: skip
        self.kernel(
            mH, mHs, mW2, mWs2, mAcc, mShared, mPairs, mTw, mSlotE, mSlotOff, mSlotN, mNact
        ).launch(  # fmt: skip
            grid=[self.grid, 1, 1], block=[self.NT, 1, 1], smem=self.smem + 384, stream=stream,
            use_pdl=self.pdl,
        )  # fmt: skip

    def stage_buffers(self, smem):
        """The weight and token stage rings in shared memory (trace time, inside a kernel):
        ``nbuf`` buffers of ``R`` weight rows and of ``MP`` token rows, ``BKP`` columns each,
        128-byte aligned. The kernels of :mod:`.experts_t1` and :mod:`.w2_t1_persist` lay out
        theirs the same way."""
        BKP = self.BKP
        sW = smem.allocate_tensor(
            BFloat16,
            cute.make_layout((self.nbuf, self.R, BKP), stride=(self.R * BKP, BKP, 1)),
            byte_alignment=128,
        )  # fmt: skip
        sX = smem.allocate_tensor(
            BFloat16,
            cute.make_layout((self.nbuf, self.MP, BKP), stride=(self.MP * BKP, BKP, 1)),
            byte_alignment=128,
        )  # fmt: skip
        return sW, sX

    @cute.kernel
    def kernel(self, mH, mHs, mW2, mWs2, mAcc, mShared, mPairs, mTw, mSlotE, mSlotOff, mSlotN,
               mNact):  # fmt: skip
        tid, _, _ = cute.arch.thread_idx()
        bid, _, _ = cute.arch.block_idx()
        smem = cutlass.memory.SmemAllocator()
        sW, sX = self.stage_buffers(smem)
        sFull = sEmpty = None
        if const_expr(self.bulk):
            sFull = smem.allocate_tensor(Int64, cute.make_layout(self.nbuf), byte_alignment=8)
            sEmpty = smem.allocate_tensor(Int64, cute.make_layout(self.nbuf), byte_alignment=8)
            if tid == 0:
                for b in cutlass.range_constexpr(self.nbuf):
                    cute.arch.mbarrier_init(sFull.iterator + b, 1)
                    cute.arch.mbarrier_init(sEmpty.iterator + b, self.NW)
                cute.arch.mbarrier_init_fence()
            cute.arch.barrier()
        if const_expr(self.pdl and not self.early):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        # the shared CTAs: bids 0 .. CS - 1, or (spread) every SPS-th bid; rbid: the routed index
        is_sh = bid < self.CS
        sidx = bid
        rbid = bid - self.CS
        if const_expr(self.spread):
            sidx = bid // self.SPS
            is_sh = bid % self.SPS == 0
            if sidx >= self.CS:
                is_sh = False
            rbid = bid - cutlass.min((bid + self.SPS - 1) // self.SPS, self.CS)
        if is_sh:
            if const_expr(self.shtile):
                self._shared_item(mHs, mWs2, mShared, sW, sX, sidx // self.NTG, sidx % self.NTG,
                                  tid)  # fmt: skip
            else:
                if const_expr(self.pdl and self.early):
                    cute.arch.griddepcontrol_wait()
                    cute.arch.griddepcontrol_launch_dependents()
                if tid < self.NW * 32:  # bulk: the producer warp has no shared rows
                    self._shared(mHs, mWs2, mShared, sidx, tid)
        elif const_expr(self.early):  # col order
            # before griddepcontrol.wait: the route lists (written by the route kernel, which
            # completed before any CTA of the w13 kernel this one follows passed its own wait,
            # and those CTAs trigger this launch only after it) and the weights (constant)
            item = rbid
            a = item % self.slots
            cb = item // self.slots
            nact = mNact[0]
            e, off, n = self._slot_lists(mSlotE, mSlotOff, mSlotN, a)  # beside nact
            if a < nact:
                mW = mg._expert_mat(mW2, e, self.L, self.Ie)
                for s in cutlass.range_constexpr(self.stages - 1):
                    if const_expr(s < self.NCH):
                        self._load_w(mW, sW, cb * self.R, s, s, tid)
            if const_expr(self.nr == self.slots * self.CE):  # one item per CTA
                if a < nact:  # an empty CTA exits without waiting
                    if const_expr(self.pdl):
                        cute.arch.griddepcontrol_wait()
                        cute.arch.griddepcontrol_launch_dependents()
                    self._item(mH, mW2, mAcc, mPairs, mTw, sW, sX, a, cb, e, off, n, tid, True)
            else:  # a capped grid: the first item pre-issued, the CTA's further columns after
                if const_expr(self.pdl):
                    cute.arch.griddepcontrol_wait()
                    cute.arch.griddepcontrol_launch_dependents()
                if a < nact:
                    self._item(mH, mW2, mAcc, mPairs, mTw, sW, sX, a, cb, e, off, n, tid, True)
                self._col_items(mH, mW2, mAcc, mPairs, mTw, mSlotE, mSlotOff, mSlotN, sW, sX,
                                nact, item + self.nr, tid)  # fmt: skip
        else:
            total = mNact[0] * self.CE
            lo = rbid  # stride order: items lo, lo + nr, ... below total
            hi = total
            if const_expr(self.blocked):  # ceil(total / nr) consecutive items from lo * that
                ipc = (total + self.nr - 1) // self.nr
                lo = lo * ipc
                hi = cutlass.min(lo + ipc, total)
            if const_expr(self.bulk):
                self._bulk(mH, mW2, mAcc, mPairs, mTw, mSlotE, mSlotOff, mSlotN, sW, sX, sFull,
                           sEmpty, lo, hi, tid)  # fmt: skip
            elif const_expr(self.col):
                self._col_items(mH, mW2, mAcc, mPairs, mTw, mSlotE, mSlotOff, mSlotN, sW, sX,
                                mNact[0], rbid, tid)  # fmt: skip
            else:
                for item in cutlass.range(lo, hi, self.step):
                    a = item // self.CE
                    self._item(mH, mW2, mAcc, mPairs, mTw, sW, sX, a, item % self.CE,
                               mSlotE[a], mSlotOff[a], mSlotN[a], tid)  # fmt: skip

    # -- routed items ----------------------------------------------------------------------

    @cute.jit
    def _col_items(self, mH, mW2, mAcc, mPairs, mTw, mSlotE, mSlotOff, mSlotN, sW, sX, nact,
                   start, tid):  # fmt: skip
        """``order=col``: the worst case's items ``start, start + nr, ...``, slot fastest (item
        ``i`` = slot ``i % slots``, row block ``i // slots``), those of slots ``>= nact``
        skipped."""
        for item in cutlass.range(start, self.slots * self.CE, self.nr):
            a = item % self.slots
            e, off, n = self._slot_lists(mSlotE, mSlotOff, mSlotN, a)  # beside nact
            if a < nact:
                self._item(mH, mW2, mAcc, mPairs, mTw, sW, sX, a, item // self.slots, e, off, n,
                           tid)  # fmt: skip

    def _slot_lists(self, mSlotE, mSlotOff, mSlotN, a):
        """Slot ``a``'s expert, pair offset and pair count, loaded for every slot ``< slots``
        (stale past ``nact``; used only below it) as ``ld.relaxed.gpu``: a plain load would be
        sunk below the ``a < nact`` branch by the compiler (seen in the SASS), costing one L2
        round trip more before the weight copies. Trace time."""
        return tuple(cute.arch.load(m.iterator + a, Int32, sem="relaxed", scope="gpu")
                     for m in (mSlotE, mSlotOff, mSlotN))  # fmt: skip

    @cute.jit
    def _item(self, mH, mW2, mAcc, mPairs, mTw, sW, sX, a, cb, e, off, n, tid,
              pre: cutlass.Constexpr[bool] = False):  # fmt: skip
        """One item, (expert slot ``a`` = expert ``e`` with ``n`` pairs from ``off``, row block
        ``cb``): every pass of ``MP`` tokens through the pipeline. ``pre``: the first pass's
        weight chunks were issued already (``order=col`` with ``early``), uncommitted: they join
        the first commit group."""
        L, Ie, MP, RT = self.L, self.Ie, self.MP, self.RT
        NCH, NS = self.NCH, self.stages
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        row0 = cb * self.R
        mW = mg._expert_mat(mW2, e, L, Ie)
        atom = mc.mma_atom()
        fa, fb = mc.fragments()
        for ps in cutlass.range((n + MP - 1) // MP, unroll=1):
            t0 = ps * MP
            np_ = cutlass.min(n - t0, MP)
            # every thread is past the previous pass's (or item's) reads of every stage
            if const_expr(pre):
                if ps > 0:
                    cute.arch.barrier()
                    for s in cutlass.range_constexpr(NS - 1):
                        if const_expr(s < NCH):
                            self._load_w(mW, sW, row0, s, s, tid)
            else:
                cute.arch.barrier()
                for s in cutlass.range_constexpr(NS - 1):
                    if const_expr(s < NCH):
                        self._load_w(mW, sW, row0, s, s, tid)
            # the h rows this thread copies (pairs of tokens t0 .. t0 + np_ - 1; clamped) and
            # the pairs of the lane's token slots: one round trip for both
            hrows = self._h_rows(mPairs, off, t0, np_, tid)
            sp = self._slot_pairs(mPairs, off, t0, np_, c)
            for s in cutlass.range_constexpr(NS - 1):
                if const_expr(s < NCH):
                    self._load_h(mH, sX, hrows, np_, s, s, tid)
                cute.arch.cp_async_commit_group()
            slots = self._with_weights(mTw, sp)  # in flight during the K loop
            accs = mc.zero_accs(RT * self.MT)
            for i in cutlass.range_constexpr(NCH):
                cute.arch.cp_async_wait_group(NS - 2)
                cute.arch.barrier()
                nxt = i + NS - 1
                if const_expr(nxt < NCH):
                    self._load_w(mW, sW, row0, nxt, nxt % NS, tid)
                    self._load_h(mH, sX, hrows, np_, nxt, nxt % NS, tid)
                cute.arch.cp_async_commit_group()
                self._compute(sW, sX, i % NS, warp, g, c, accs, fa, fb, atom)
            cute.arch.cp_async_wait_group(0)
            self._epilogue(mAcc, accs, slots, np_, row0, warp, g)

    def _slot_pairs(self, mPairs, off, t0, np_, c):
        """This lane's token slots of a pass, ``(j, pair)`` (trace time; clamped indices)."""
        out = []
        for jt in range(self.MT):
            for s2 in range(2):
                j = jt * 8 + 2 * c + s2
                out.append((j, mPairs[off + t0 + cutlass.min(j, np_ - 1)]))
        return out

    def _with_weights(self, mTw, sp):
        """``(j, pair, routing weight)`` of :meth:`_slot_pairs`' slots (trace time)."""
        return [(j, p, mTw[p]) for j, p in sp]

    def _slots(self, mPairs, mTw, off, t0, np_, c):
        """This lane's token slots of a pass, ``(j, pair, routing weight)`` (trace time; loaded
        before the K loop so that they are in flight during it)."""
        return self._with_weights(mTw, self._slot_pairs(mPairs, off, t0, np_, c))

    @cute.jit
    def _epilogue(self, mAcc, accs, slots, np_, row0, warp, g):
        """``acc[token(p), row] += weight(p) * y`` for the lane's valid token slots (FP32
        ``red.global.add``: rows g and g + 8 of each of the warp's tiles)."""
        K, L, MT, RT = self.K, self.L, self.MT, self.RT
        for jt in cutlass.range_constexpr(MT):
            for s2 in cutlass.range_constexpr(2):
                j, p, wt = slots[jt * 2 + s2]
                if j < np_:
                    base = (p // K) * L
                    for q in cutlass.range_constexpr(RT):
                        r = row0 + (warp * RT + q) * mg.ROWS + g
                        acc = accs[q * MT + jt]
                        if const_expr(self.full_rows):
                            cute.arch.atomic_add(mAcc.iterator + (base + r), wt * acc[s2])
                            cute.arch.atomic_add(mAcc.iterator + (base + r + 8), wt * acc[2 + s2])
                        else:
                            if r < L:
                                cute.arch.atomic_add(mAcc.iterator + (base + r), wt * acc[s2])
                                cute.arch.atomic_add(mAcc.iterator + (base + r + 8),
                                                     wt * acc[2 + s2])  # fmt: skip

    @cute.jit
    def _bulk(self, mH, mW2, mAcc, mPairs, mTw, mSlotE, mSlotOff, mSlotN, sW, sX, sFull, sEmpty,
              start, total, tid):  # fmt: skip
        """``load=bulk``: warp ``NW`` (the producer) walks the CTA's (item, pass, chunk) stream
        (items ``start, start + step, ...`` below ``total``)
        and fills stage ``k % NS`` with one ``cp.async.bulk`` per weight row (``BK x 2``
        contiguous bytes) and per token row of ``h``, completing on the stage's ``full``
        mbarrier; it refills a stage after the ``NW`` consumer warps' arrivals on its
        ``empty`` mbarrier. The consumers walk the same stream: wait ``full``, MMAs, arrive
        ``empty``; epilogue per pass. So the next item's chunks are in flight while the
        current item's last chunks are multiplied, and the producer's metadata round trips
        (route lists, pairs) never stall the math."""
        L, Ie, MP, NS, NCH, BK, BKP, R = (self.L, self.Ie, self.MP, self.stages, self.NCH,
                                          self.BK, self.BKP, self.R)  # fmt: skip
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        k = Int32(0)
        if warp == self.NW:
            for item in cutlass.range(start, total, self.step, unroll=1):
                a = item // self.CE
                row0 = (item % self.CE) * R
                e = mSlotE[a]
                off = mSlotOff[a]
                n = mSlotN[a]
                wbase = Int64(e) * (L * Ie) + Int64(row0) * Ie
                nrows = R
                if const_expr(not self.full_rows):
                    nrows = cutlass.min(R, L - row0)
                for ps in cutlass.range((n + MP - 1) // MP, unroll=1):
                    t0 = ps * MP
                    np_ = cutlass.min(n - t0, MP)
                    hrow = mPairs[off + t0 + cutlass.min(lane, np_ - 1)]
                    for kc in cutlass.range_constexpr(NCH):
                        buf = k % NS
                        if k >= NS:  # the consumers are done with this stage's last use
                            cute.arch.mbarrier_wait(sEmpty.iterator + buf, (k // NS + 1) % 2)
                        if lane == 0:
                            cute.arch.mbarrier_arrive_and_expect_tx(
                                sFull.iterator + buf, (nrows + np_) * (BK * 2)
                            )
                        cute.arch.sync_warp()
                        for i in cutlass.range_constexpr(-(-R // 32)):
                            r = lane + 32 * i
                            if r < nrows:
                                src = mW2.iterator + (wbase + Int64(r * Ie + kc * BK))
                                prims.cp_async_bulk_shared_cluster_global(
                                    sW.iterator + (buf * R + r) * BKP, src.align(16),
                                    sFull.iterator + buf, BK * 2,
                                )  # fmt: skip
                        if lane < np_:
                            src = mH.iterator + (Int64(hrow) * Ie + kc * BK)
                            prims.cp_async_bulk_shared_cluster_global(
                                sX.iterator + (buf * MP + lane) * BKP, src.align(16),
                                sFull.iterator + buf, BK * 2,
                            )  # fmt: skip
                        k = k + 1
        else:
            atom = mc.mma_atom()
            fa, fb = mc.fragments()
            for item in cutlass.range(start, total, self.step, unroll=1):
                a = item // self.CE
                row0 = (item % self.CE) * R
                off = mSlotOff[a]
                n = mSlotN[a]
                for ps in cutlass.range((n + MP - 1) // MP, unroll=1):
                    t0 = ps * MP
                    np_ = cutlass.min(n - t0, MP)
                    slots = self._slots(mPairs, mTw, off, t0, np_, c)
                    accs = mc.zero_accs(self.RT * self.MT)
                    for _ in cutlass.range_constexpr(NCH):
                        buf = k % NS
                        cute.arch.mbarrier_wait(sFull.iterator + buf, (k // NS) % 2)
                        self._compute(sW, sX, buf, warp, g, c, accs, fa, fb, atom)
                        cute.arch.sync_warp()  # every lane's reads of the stage are done
                        if lane == 0:
                            cute.arch.mbarrier_arrive(sEmpty.iterator + buf)
                        k = k + 1
                    self._epilogue(mAcc, accs, slots, np_, row0, warp, g)

    def _h_rows(self, mPairs, off, t0, np_, tid):
        """Pair rows of the ``h`` units this thread copies per chunk (trace time; clamped to the
        pass's last token, so every load stays in bounds)."""
        rows = []
        for i in range(-(-(self.MP * self.U) // self.NT)):
            t, _ = piece(tid + i * self.NT, self.U)
            rows.append(mPairs[off + t0 + cutlass.min(t, np_ - 1)])
        return rows

    @cute.jit
    def _load_w(self, mW, sW, row0, kc, stg, tid, full: cutlass.Constexpr[bool] = False):
        """cp.async of the item's ``R`` weight rows, chunk ``kc``, into stage ``stg`` (rows past
        ``L`` skipped unless ``full`` or the shapes make every block full)."""
        U, NT = self.U, self.NT
        for i in cutlass.range_constexpr(self.R * U // NT):
            idx = tid + i * NT
            r, u = piece(idx, U)
            dst = cute.local_tile(sW[stg, r, None], (8,), (swizzle(u, r, self.swz),))
            if const_expr(self.full_rows or full):
                mc.cp_async16(dst, cute.local_tile(mW[row0 + r, None], (8,), (kc * U + u,)))
            else:
                if row0 + r < self.L:
                    mc.cp_async16(dst, cute.local_tile(mW[row0 + r, None], (8,), (kc * U + u,)))

    @cute.jit
    def _load_h(self, mH, sX, hrows, np_, kc, stg, tid):
        """cp.async of the pass's ``h`` rows (tokens < ``np_``), chunk ``kc``, into ``stg``.
        Rows past ``np_`` are left as they are: an MMA column only feeds its own token."""
        U, NT = self.U, self.NT
        for i in cutlass.range_constexpr(len(hrows)):
            idx = tid + i * NT
            t, u = piece(idx, U)
            if idx < self.MP * U and t < np_:
                dst = cute.local_tile(sX[stg, t, None], (8,), (swizzle(u, t, self.swz),))
                mc.cp_async16(dst, cute.local_tile(mH[hrows[i], None], (8,), (kc * U + u,)))

    @cute.jit
    def _compute(self, sW, sX, stg, warp, g, c, accs, fa, fb, atom):
        """The MMAs of one chunk: per 32-wide K slice, one 16-byte read per weight row (rows g,
        g + 8 of each of the warp's tiles) and per token row (g of each token tile)."""
        RT, MT = self.RT, self.MT
        for j in cutlass.range_constexpr(self.BK // 32):
            pu = read_unit(j, c, g, self.swz)
            tiles = []
            for q in cutlass.range_constexpr(RT):
                r = (warp * RT + q) * mg.ROWS + g
                lo = cute.make_rmem_tensor((8,), BFloat16)
                hi = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(sW[stg, r, None], (8,), (pu,)), lo)
                cute.autovec_copy(cute.local_tile(sW[stg, r + 8, None], (8,), (pu,)), hi)
                tiles.append((lo, hi, q))
            for jt in cutlass.range_constexpr(MT):
                xb = cute.make_rmem_tensor((8,), BFloat16)
                cute.autovec_copy(cute.local_tile(sX[stg, jt * 8 + g, None], (8,), (pu,)), xb)
                mc.mma_k16(atom, accs, fa, fb, xb, [(lo, hi, q * MT + jt) for lo, hi, q in tiles])

    # -- shared expert on the tile pipeline (``shared=tile``) -----------------------------

    @cute.jit
    def _shared_item(self, mHs, mWs2, mShared, sW, sX, rb, tg, tid):
        """``shared_out[t, r] = hs[t] . shared_w2[r]`` for the ``R`` rows of block ``rb`` and the
        ``MP`` tokens of group ``tg``: one pass of the routed items' pipeline over K = ``S``
        (``NCHS`` chunks through ``NSS`` stages), plain FP32 stores. With ``early`` the weight
        chunks (constant) are issued before ``griddepcontrol.wait``, ``hs`` (the previous
        kernel's output) after it."""
        T, MP, NCH, NS = self.T, self.MP, self.NCHS, self.NSS
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        row0 = rb * self.R
        t0 = tg * MP
        np_ = cutlass.min(T - t0, MP)
        for s in cutlass.range_constexpr(NS - 1):
            self._load_w(mWs2, sW, row0, s, s, tid, True)
        if const_expr(self.pdl and self.early):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        hrows = self._hs_rows(t0, tid)
        for s in cutlass.range_constexpr(NS - 1):
            self._load_h(mHs, sX, hrows, np_, s, s, tid)
            cute.arch.cp_async_commit_group()
        atom = mc.mma_atom()
        fa, fb = mc.fragments()
        accs = mc.zero_accs(self.RT * self.MT)
        for i in cutlass.range_constexpr(NCH):
            cute.arch.cp_async_wait_group(NS - 2)
            cute.arch.barrier()
            nxt = i + NS - 1
            if const_expr(nxt < NCH):
                self._load_w(mWs2, sW, row0, nxt, nxt % NS, tid, True)
                self._load_h(mHs, sX, hrows, np_, nxt, nxt % NS, tid)
            cute.arch.cp_async_commit_group()
            self._compute(sW, sX, i % NS, warp, g, c, accs, fa, fb, atom)
        cute.arch.cp_async_wait_group(0)
        for jt in cutlass.range_constexpr(self.MT):
            for s2 in cutlass.range_constexpr(2):
                t = t0 + jt * 8 + 2 * c + s2
                if t < T:
                    for q in cutlass.range_constexpr(self.RT):
                        r = row0 + (warp * self.RT + q) * mg.ROWS + g
                        acc = accs[q * self.MT + jt]
                        mShared[t, r] = acc[s2]
                        mShared[t, r + 8] = acc[2 + s2]

    def _hs_rows(self, t0, tid):
        """Rows of ``hs`` (tokens ``t0 + t``, clamped to ``T - 1``) of the units this thread
        copies per chunk (trace time)."""
        rows = []
        for i in range(-(-(self.MP * self.U) // self.NT)):
            t, _ = piece(tid + i * self.NT, self.U)
            rows.append(cutlass.min(t0 + t, self.T - 1))
        return rows

    # -- shared expert (GroupedW2's register-load tiling) ---------------------------------

    @cute.jit
    def _shared(self, mHs, mWs2, mShared, sb, tid):
        """Rows ``[sb * NW * 32, +NW * 32)`` of ``shared_out = hs @ shared_w2^T``: each warp two
        16-row tiles over all of K (``S``), all tokens ``8 x SNJ`` per pass (each weight load
        feeds ``SNJ`` token tiles), plain FP32 stores."""
        T, S, NJ = self.T, self.S, self.SNJ
        warp = tid // 32
        lane = tid % 32
        g = lane // 4
        c = lane % 4
        atom = mc.mma_atom()
        fa, fb = mc.fragments()
        tiles = [(sb * self.NW + warp) * SHARED_RT + q for q in range(SHARED_RT)]
        rows = [cutlass.min(t, self.ntH - 1) * mg.ROWS + g for t in tiles]
        U = self.Us
        for ps in cutlass.range(-(-T // (8 * NJ))):
            toks = [cutlass.min(ps * 8 * NJ + j * 8 + g, T - 1) for j in range(NJ)]
            accs = mc.zero_accs(SHARED_RT * NJ)
            for it in cutlass.range(S // mg.KCH // U, unroll_full=True):
                mc.mma_chunks(
                    atom, accs, fa, fb, mWs2, rows, NJ, U,
                    lambda v, it=it: (it * U + v) * mg.KCH + c * 8,
                    lambda k0, toks=toks: lambda jj: mc.load_row8(mHs, toks[jj], k0),
                )  # fmt: skip
            for j in cutlass.range_constexpr(NJ):
                for s in cutlass.range_constexpr(2):
                    t = ps * 8 * NJ + j * 8 + 2 * c + s
                    if t < T:
                        for q in cutlass.range_constexpr(SHARED_RT):
                            if tiles[q] < self.ntH:
                                r0 = tiles[q] * mg.ROWS + g
                                acc = accs[q * NJ + j]
                                mShared[t, r0] = acc[s]
                                mShared[t, r0 + 8] = acc[2 + s]


# -- torch-facing --------------------------------------------------------------------------


def build(T, E, K, L, Ie, H, S, pdl=True, nsm: int = 132, kn: TileKnobs | None = None):
    """``(op, fake args)`` in :func:`moe_grouped._build_w2`'s argument order."""
    op = GroupedW2Tile(T, E, K, L, Ie, H, S, pdl, nsm, kn)
    return op, mg.w2_fake_args(T, E, K, L, Ie, H, S, op.slots)
