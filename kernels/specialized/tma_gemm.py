"""Skinny GEMM on TMA and warpgroup MMAs: ``out[m, n] = x[m, k] @ w[n, k]^T`` for the 16-64
token projections, the weight streamed by the Tensor Memory Accelerator through a deep ring.

Why (notes/specialized.md "Session 32"): at 32-64 tokens the projections read their weight
once and are bound by how many bytes each SM keeps in flight. The cp.async tile kernel
(:mod:`.tile_gemm`) issues every 16-byte load from the warpgroup that also multiplies, waits,
fences and barriers once per 64-column chunk (Nsight Compute, session 27: 48% of the copy rate
for the dense gate_up at TP16 64 tokens); cuBLAS at TP16 splits K with a reduce kernel of its
own (KDA's in_proj 23 us for an 11 us floor). Here one thread issues one TMA copy per operand
and stage, and the warpgroup only waits on the stage's mbarrier.

Layout (swap AB): the weight rows are the MMA's M (``bm`` = 64 or 128 rows per CTA), the
tokens its N (``bn``: ``m`` rounded up to 16; the TMA zero-fills the rows past ``m``), K in
64-column chunks (128-byte rows, 128-byte swizzle: what the TMA writes and the MMA reads).
Warp 0 (or with ``wsp`` a warp of its own) issues both operands' copies into a ring of
``stages`` stages (:class:`cutlass.pipeline.PipelineTmaAsync`: a full and an empty mbarrier per
stage); every warp of the warpgroup waits on a stage's full barrier, the warpgroup runs its
MMAs (k = 16 each), and a stage is released one chunk later (after ``wgmma.wait_group 1``),
when the copying warp refills it.
Under programmatic dependent launch the weight copies of the first ``stages`` chunks are issued
before ``griddepcontrol.wait`` (a weight never depends on the kernel before); the activation
copies of those chunks follow the wait, on the same barriers.

Split-K over ``splits`` CTAs per row tile (grid ``(row_tiles, splits)``): each CTA writes its
FP32 partial tile to ``ws[split, token, row]`` and bumps the row tile's counter (acq_rel); the
last one sums the splits (16-byte L2 loads), applies the epilogue and zeroes the counter, so
every launch on one stream reuses the workspace. With ``csplit`` the splits of a row tile form
one cluster instead and reduce through distributed shared memory (each CTA sums a share of the
tile over its peers' partials). One split stores from the accumulators. Epilogue:
``bf16(acc)``, or with ``residual_epilogue`` ``bf16(bf16(acc) + e)`` (the tile kernel's
rounding; ``out`` may alias ``e``).

Variants (plan fields, all opt-in): ``bk`` 64-256 K columns per stage; ``cm`` 2 / 4 row tiles
per cluster sharing each activation load (TMA multicast, stages released cluster-wide);
``packed`` weights laid out tile by tile (:func:`pack_weight`); ``rotate`` each row tile's K
walk from its own chunk; ``wsp`` a fifth warp that only issues the copies. Measured on the
H200 (session 32, kernel alone): every tiling correct; the best ones match cuBLAS, at 1.3-1.9x
the bytes floor, and beat it for o_proj (:data:`KNOB_TILING`). Session 33: ``wsp`` moves the
best tilings by -1.0 to +0.9 us (and loses 2-9 us with one split), and the knob's o_proj in the
layers gains nothing at TP16 and loses 3-4 us of share per layer at TP8 batch 64 (its CTAs
resident early beside the decode before it): the knob stays off (notes/specialized.md
"Session 33").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
import torch
from cutlass import BFloat16, Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from decodescope.kernels.specialized import env_knobs
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.mla_decode_tc import ld_cluster_v4f32, mapa
from decodescope.kernels.specialized.utils import pdl_enabled

BK = 64  # K columns per chunk: one 128-byte swizzled row per operand row
THREADS = 128  # one warpgroup
NUM_SMS = 132
SMEM_PER_SM = 227 * 1024
ENV = "DECODESCOPE_PROJ_TMA"  # opt-in: the cuBLAS-served projections on this kernel
ENV_CHOICES = ("0", "oproj", "1")
# the tiling the projections take through the knob: the splits of a row tile reduced in their
# cluster, 4 stages (session 32, t6: o_proj 0.81-0.94x cuBLAS's time at TP8 / TP16, 32 / 64
# tokens, kernel alone, same call)
KNOB_TILING = {"csplit": True, "stages": 4}


def mode() -> str:
    """``DECODESCOPE_PROJ_TMA``: which of the projections that :func:`.tile_gemm.cublas_serves`
    hands to cuBLAS (o_proj with its residual add, KDA's in_proj after its norm launch; 32-64
    tokens) run their GEMM here instead, on :data:`KNOB_TILING`: ``oproj`` the o_proj alone,
    ``1`` both. Unset / ``0``: cuBLAS (the default). Read at each call."""
    return str(env_knobs.read(ENV, ENV_CHOICES, "0"))


def enabled() -> bool:
    """Whether any projection runs here (:func:`mode` is not ``0``)."""
    return mode() != "0"


def serves(residual_epilogue: bool) -> bool:
    """Whether the knob moves a cuBLAS-served projection here: ``1`` every one, ``oproj`` the
    one with the residual epilogue (o_proj)."""
    m = mode()
    return m == "1" or (m == "oproj" and residual_epilogue)


def takes(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether :func:`tma_gemm` takes these operands (else the caller keeps cuBLAS): BF16,
    contiguous, 1-64 rows, ``k`` a multiple of 64 and ``n`` of 8, on a GPU."""
    m, k = x.shape
    n = w.shape[0]
    return (
        x.is_cuda
        and x.dtype == w.dtype == out.dtype == torch.bfloat16
        and x.is_contiguous()
        and w.is_contiguous()
        and out.is_contiguous()
        and 1 <= m <= 64
        and k % BK == 0
        and n % 8 == 0
    )


@dataclass(frozen=True)
class TmaPlan:
    m: int  # tokens (rows of x and out), 1..64
    k: int  # reduction length, a multiple of BK
    n: int  # weight rows (columns of out), a multiple of 8
    bm: int = 64  # weight rows per CTA (64: one MMA row block; 128: two)
    splits: int = 1  # CTAs along K per row tile
    stages: int = 6
    bk: int = BK  # K columns per stage (64, 128 or 256: one to four 128-byte swizzle atoms)
    rotate: bool = False  # each row tile walks its K range from its own starting chunk
    cm: int = 1  # row tiles per cluster sharing one activation load (TMA multicast)
    # the weight pre-packed by :func:`pack_weight`: each (row tile, chunk) tile is one contiguous
    # ``bm x 64`` block in memory, so each stage's weight copy streams 8-16 KB in a row
    packed: bool = False
    # the splits of a row tile as one cluster reducing through distributed shared memory (each
    # CTA sums a share of the tile from every peer's partial), not through global memory
    csplit: bool = False
    # a fifth warp that only issues the copies (warp specialization): a stage is refilled as
    # soon as the warpgroup releases it, not after warp 0's next wait and MMAs
    wsp: bool = False
    residual_epilogue: bool = False
    pdl: bool = field(default_factory=pdl_enabled)

    def __post_init__(self) -> None:
        if not 1 <= self.m <= 64:
            raise ValueError(f"tma_gemm: m={self.m} (1..64 tokens)")
        if self.bk not in (64, 128, 256):
            raise ValueError(f"tma_gemm: bk={self.bk} (64, 128 or 256)")
        if self.k % self.bk or self.n % 8:
            raise ValueError(
                f"tma_gemm: k={self.k} must be a multiple of {self.bk}, n={self.n} of 8"
            )
        if self.bm not in (64, 128):
            raise ValueError(f"tma_gemm: bm={self.bm} (64 or 128)")
        if not 1 <= self.splits <= self.kt:
            raise ValueError(f"tma_gemm: splits={self.splits} (1..{self.kt})")
        if not 2 <= self.stages <= 16:
            raise ValueError(f"tma_gemm: stages={self.stages} (2..16)")
        if self.packed and self.bk != BK:
            raise ValueError(f"tma_gemm: a packed weight takes bk={BK}, got {self.bk}")
        if self.csplit and not (2 <= self.splits <= 8 and self.cm == 1 and self.part_fits):
            raise ValueError(
                f"tma_gemm: csplit takes 2..8 splits (got {self.splits}), cm=1 and a partial "
                f"tile within the weight stages"
            )
        if self.cm not in (1, 2, 4) or self.bn < 8 * self.cm or (self.cm > 1 and self.rotate):
            raise ValueError(
                f"tma_gemm: cm={self.cm} (1, 2 or 4; at most bn/8 = {self.bn // 8}; no rotate)"
            )

    @property
    def bn(self) -> int:
        """Token columns of the MMA (``m`` rounded up to 16)."""
        return max(16, -(-self.m // 16) * 16)

    @property
    def kt(self) -> int:
        return self.k // self.bk

    @property
    def row_tiles(self) -> int:
        """Row tiles of the grid (whole clusters: the last may run past ``n``, on zeros)."""
        return -(-self.n // (self.bm * self.cm)) * self.cm

    @property
    def npad(self) -> int:
        return self.row_tiles * self.bm

    @property
    def threads(self) -> int:
        return THREADS + (32 if self.wsp else 0)

    @property
    def part_fits(self) -> bool:
        """The FP32 partial tile ``[bn, bm + 4]`` fits in the weight stages (csplit)."""
        return self.bn * (self.bm + 4) * 4 <= self.stages * self.bm * self.bk * 2

    @property
    def stage_bytes(self) -> int:
        return (self.bm + self.bn) * self.bk * 2

    @property
    def smem_bytes(self) -> int:
        return self.stages * self.stage_bytes + 1024 + 16 * self.stages + 64

    @property
    def ctas(self) -> int:
        return self.row_tiles * self.splits


def occupancy(p: TmaPlan) -> int:
    """CTAs of ``p`` one SM holds (shared memory bound; at most 4)."""
    return max(1, min(4, SMEM_PER_SM // (p.smem_bytes + 1024)))


def plan(m: int, k: int, n: int, residual_epilogue: bool = False, **kw) -> TmaPlan:
    """The tiling: ``bm`` / ``bk`` / ``stages`` as given (default 64 / 64 / 4); unless given,
    splits so that the grid fills the SMs in one wave at the occupancy the shared memory allows
    (each split at least two chunks of K; with ``csplit`` 2-8, a cluster's size)."""
    bm, bk, stages = kw.pop("bm", 64), kw.pop("bk", BK), kw.pop("stages", 4)
    splits = kw.pop("splits", 0)
    probe = TmaPlan(m=m, k=k, n=n, bm=bm, bk=bk, stages=stages,
                    **{a: v for a, v in kw.items() if a != "csplit"})  # fmt: skip
    if not splits:
        slots = occupancy(probe) * NUM_SMS
        splits = max(1, min(probe.kt // 2, slots // probe.row_tiles))
        if kw.get("csplit"):
            splits = max(2, min(8, splits))
    return TmaPlan(m=m, k=k, n=n, bm=bm, bk=bk, splits=splits, stages=stages,
                   residual_epilogue=residual_epilogue, **kw)  # fmt: skip


class TmaGemm:
    def __init__(self, p: TmaPlan):
        self.p = p

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [m, k] bf16
        mW: cute.Tensor,  # [n, k] bf16
        mO: cute.Tensor,  # [m, n] bf16
        mE: cute.Tensor,  # [m, n] bf16 residual (residual_epilogue) else a placeholder
        mWs: cute.Tensor,  # [splits, bn, npad] fp32 partials
        mCnt: cute.Tensor,  # [row_tiles] int32 counters
        stream: cuda.CUstream,
    ):
        p = self.p
        tile = (p.bm, p.bn, p.bk)
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            BFloat16, BFloat16, OperandMajorMode.K, OperandMajorMode.K, Float32,
            (1, 1, 1), tiler_mn=(64, p.bn),
        )  # fmt: skip
        a_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile, BFloat16,
                                                 p.stages)  # fmt: skip
        b_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile, BFloat16,
                                                 p.stages)  # fmt: skip
        tma_a, gW = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mW, cute.slice_(a_layout, (None, None, 0)),
            (p.bm, p.bk),
        )  # fmt: skip
        op_b = cpasync.CopyBulkTensorTileG2SOp()
        if cutlass.const_expr(p.cm > 1):
            op_b = cpasync.CopyBulkTensorTileG2SMulticastOp()
        tma_b, gX = cpasync.make_tiled_tma_atom(
            op_b, mX, cute.slice_(b_layout, (None, None, 0)), (p.bn, p.bk), num_multicast=p.cm
        )

        @cute.struct
        class Smem:
            bars: cute.struct.MemRange[cutlass.Int64, p.stages * 2]
            last: cute.struct.MemRange[Int32, 4]
            sA: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[BFloat16, cute.cosize(b_layout)], 1024]

        self.smem_cls = Smem
        args = (tma_a, gW, tma_b, gX, mO, mE, mWs, mCnt, tiled_mma, a_layout, b_layout)
        self.kernel(*args).launch(
            grid=[p.row_tiles, p.splits, 1],
            block=[p.threads, 1, 1],
            cluster=[p.cm, p.splits if p.csplit else 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
        )

    @cute.kernel
    def kernel(self, tma_a, gW, tma_b, gX, mO, mE, mWs, mCnt, tiled_mma, a_layout, b_layout):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        bx, sp, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        pw = THREADS // 32 if p.wsp else 0  # the warp that issues the copies
        if warp == pw:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bars.data_ptr(),
            num_stages=p.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # every warp of each CTA the stage's activation was multicast to releases it
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, p.cm * THREADS // 32
            ),  # fmt: skip
            tx_count=p.stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, p.cm, 1, 1)),
        )
        cl_layout = cute.make_layout((p.cm, 1, 1))
        cl_coord = cl_layout.get_flat_coord(
            cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        )
        x_mask = None
        if cutlass.const_expr(p.cm > 1):
            x_mask = cute.make_layout_image_mask(cl_layout, cl_coord, mode=0)
            cute.arch.cluster_arrive_relaxed()
        sA = st.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = st.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)
        sLast = st.last.get_tensor(cute.make_layout(4))

        # (bm, bk, kt) and (bn, bk, kt) tiles of the TMA tensors; one CTA per row tile
        if cutlass.const_expr(p.packed):  # tile (bx, c) is block bx * kt + c
            tW = cute.local_tile(gW, (p.bm, p.bk), (None, 0))
        else:
            tW = cute.local_tile(gW, (p.bm, p.bk), (bx, None))
        wb = bx * p.kt if p.packed else 0
        tX = cute.local_tile(gX, (p.bn, p.bk), (0, None))
        tAs, tAg = cpasync.tma_partition(tma_a, 0, cute.make_layout(1),
                                         cute.group_modes(sA, 0, 2), cute.group_modes(tW, 0, 2))  # fmt: skip
        tBs, tBg = cpasync.tma_partition(tma_b, cl_coord[0], cute.make_layout(p.cm),
                                         cute.group_modes(sB, 0, 2), cute.group_modes(tX, 0, 2))  # fmt: skip

        wg_mma = tiled_mma.get_slice(0)
        tCrA = tiled_mma.make_fragment_A(wg_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(wg_mma.partition_B(sB))
        thr_mma = tiled_mma.get_slice(tidx % THREADS)
        tCc = thr_mma.partition_C(cute.make_identity_tensor((p.bm, p.bn)))
        acc = cute.make_rmem_tensor(tCc.shape, Float32)
        acc.fill(0.0)
        # the barriers' init before any wait on them (in the cluster: before a peer's multicast)
        if cutlass.const_expr(p.cm > 1):
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        k0 = sp * p.kt // p.splits
        cnt = (sp + 1) * p.kt // p.splits - k0
        npre = cutlass.min(cnt, p.stages)
        # each row tile starts its K walk at its own chunk (``rotate``): the CTAs of one split
        # do not all read the same activation chunk from the same L2 lines at once
        rot = Int32(0)
        if cutlass.const_expr(p.rotate):
            rot = (bx * 5) % cnt
        prod = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, p.stages)
        prodx = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, p.stages)
        if warp == pw:
            for _ in cutlass.range(npre, unroll=1):
                pipe.producer_acquire(prod)
                cute.copy(tma_a, tAg[(None, wb + k0 + (prod.count + rot) % cnt)], tAs[(None, prod.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(prod))  # fmt: skip
                prod.advance()
        if cutlass.const_expr(p.pdl):
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        if warp == pw:
            for _ in cutlass.range(npre, unroll=1):
                cute.copy(tma_b, tBg[(None, k0 + (prodx.count + rot) % cnt)], tBs[(None, prodx.index)],
                          tma_bar_ptr=pipe.producer_get_barrier(prodx), mcast_mask=x_mask)  # fmt: skip
                prodx.advance()

        cons = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, p.stages)
        rel = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, p.stages)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        nkb = cute.size(tCrA, mode=[2])
        copier = warp == pw if p.wsp else False  # wsp: warp 4 only copies
        if copier:  # every later chunk as soon as its stage is free
            for _ in cutlass.range(cnt - npre, unroll=1):
                self.refill(pipe, prod, tma_a, tma_b, tAg, tAs, tBg, tBs, wb, k0, rot, cnt,
                            x_mask)  # fmt: skip
                prod.advance()
        else:
            for kk in cutlass.range(cnt, unroll=1):
                self.mma_chunk(pipe, cons, tiled_mma, acc, tCrA, tCrB, nkb)
                cons.advance()
                if kk > 0:
                    pipe.consumer_release(rel)
                    rel.advance()
                    # without wsp warp 0 refills the stage it has just helped release
                    if cutlass.const_expr(not p.wsp):  # noqa: SIM102 - compile-time test
                        if warp == 0 and prod.count < cnt:
                            self.refill(pipe, prod, tma_a, tma_b, tAg, tAs, tBg, tBs, wb, k0,
                                        rot, cnt, x_mask)  # fmt: skip
                            prod.advance()
        warpgroup.wait_group(0)
        if cutlass.const_expr(p.cm > 1):  # no peer exits while releases may still reach it
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

        row0 = bx * p.bm
        mine = tidx < THREADS  # the warpgroup's threads hold the accumulators
        if cutlass.const_expr(p.csplit):
            self.cluster_reduce(st, acc, tCc, mO, mE, row0, sp, tidx)
        elif cutlass.const_expr(p.splits == 1):
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, t = tCc[i]
                row = row0 + r
                if mine and t < p.m and row < p.n:
                    v = acc[i]
                    if cutlass.const_expr(p.residual_epilogue):
                        v = v.to(BFloat16).to(Float32) + mE[t, row].to(Float32)
                    mO[t, row] = v.to(BFloat16)
        else:
            if mine:
                for i in cutlass.range_constexpr(cute.size(acc)):
                    r, t = tCc[i]
                    mWs[sp, t, row0 + r] = acc[i]
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                old = cute.arch.atomic_add(mCnt.iterator + bx, Int32(1), sem="acq_rel",
                                           scope="gpu")  # fmt: skip
                sLast[0] = old
            cute.arch.sync_threads()
            if sLast[0] == p.splits - 1 and mine:
                cute.arch.fence_acq_rel_gpu()
                self.reduce(mO, mE, mWs, row0, tidx)
                if tidx == 0:
                    mCnt[bx] = Int32(0)

    @cute.jit
    def mma_chunk(self, pipe, cons, tiled_mma, acc, tCrA, tCrB, nkb):
        """Wait for the stage of ``cons``, its MMAs into ``acc``, and wait until the chunk
        before it has been read (``wgmma.wait_group 1``: its stage may be released)."""
        pipe.consumer_wait(cons)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(nkb):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, cons.index)],
                      tCrB[(None, None, kb, cons.index)], acc)  # fmt: skip
        warpgroup.commit_group()
        warpgroup.wait_group(1)

    @cute.jit
    def refill(self, pipe, prod, tma_a, tma_b, tAg, tAs, tBg, tBs, wb, k0, rot, cnt, x_mask):
        """Wait until the stage of ``prod`` is free, then both operands' copies of its chunk."""
        pipe.producer_acquire(prod)
        bar = pipe.producer_get_barrier(prod)
        c = k0 + (prod.count + rot) % cnt
        cute.copy(tma_a, tAg[(None, wb + c)], tAs[(None, prod.index)], tma_bar_ptr=bar)
        cute.copy(tma_b, tBg[(None, c)], tBs[(None, prod.index)], tma_bar_ptr=bar,
                  mcast_mask=x_mask)  # fmt: skip

    @cute.jit
    def cluster_reduce(self, st, acc, tCc, mO, mE, row0, sp, tidx):
        """``csplit``: this CTA's FP32 partial into its own weight stages (free: every chunk
        it loaded is consumed), one cluster barrier, then CTA ``sp`` of the cluster sums its
        share of the tile's 4-row quads over every CTA's partial (``ld.shared::cluster``, in
        split order) and stores them; a second barrier keeps each CTA's shared memory alive
        while the others read it."""
        p = self.p
        rs_ = p.bm + 4
        cute.arch.sync_threads()  # every warp past its last MMA on the stages
        fbase = cute.recast_ptr(st.sA.data_ptr(), dtype=Float32)
        sP = cute.make_tensor(fbase, cute.make_layout((p.bn, rs_), stride=(rs_, 1)))
        mine = tidx < THREADS  # not the copy warp (wsp)
        if mine:
            for i in cutlass.range_constexpr(cute.size(acc)):
                r, t = tCc[i]
                sP[t, r] = acc[i]
        cute.arch.cluster_arrive()  # release: this split's partial is in place
        cute.arch.cluster_wait()
        quads = p.bm // 4
        total = p.m * quads
        start = sp * THREADS + tidx
        if not mine:  # the copy warp sums nothing
            start = total
        for f in cutlass.range(start, total, p.splits * THREADS, unroll=1):
            t = f // quads
            r4 = (f % quads) * 4
            vals = [ld_cluster_v4f32(mapa(sP.iterator + (t * rs_ + r4), q))
                    for q in range(p.splits)]  # fmt: skip
            row = row0 + r4
            if row < p.n:
                self.store4(mO, mE, t, row, vals)
        cute.arch.cluster_arrive()  # this CTA reads no other's shared memory after this
        cute.arch.cluster_wait()  # nobody exits while another still reads its partial

    @cute.jit
    def store4(self, mO, mE, t, row, vals):
        """Rows ``row..row+3`` of token ``t``: the splits' sums (in split order), the epilogue,
        one 8-byte store."""
        p = self.p
        ov = cute.make_rmem_tensor((4,), BFloat16)
        ev = cute.make_rmem_tensor((4,), BFloat16)
        if cutlass.const_expr(p.residual_epilogue):
            cute.autovec_copy(cute.local_tile(mE[t, None], (4,), (row // 4,)), ev)
        for e in cutlass.range_constexpr(4):
            v = vals[0][e]
            for s in cutlass.range_constexpr(1, p.splits):
                v = v + vals[s][e]
            if cutlass.const_expr(p.residual_epilogue):
                v = v.to(BFloat16).to(Float32) + ev[e].to(Float32)
            ov[e] = v.to(BFloat16)
        cute.autovec_copy(ov, cute.local_tile(mO[t, None], (4,), (row // 4,)))

    @cute.jit
    def reduce(self, mO, mE, mWs, row0, tidx):
        """The last split of a row tile: 4 rows of one token per thread and step (16-byte L2
        loads of each split's partial, 8-byte stores)."""
        p = self.p
        quads = p.bm // 4
        total = p.m * quads
        for f in cutlass.range(tidx, total, THREADS, unroll=1):
            t = f // quads
            row = row0 + (f % quads) * 4
            if row < p.n:
                vals = []
                for s in cutlass.range_constexpr(p.splits):
                    ptr = mWs.iterator + ((s * p.bn + t) * p.npad + row)
                    vals.append(
                        cute.arch.inline_ptx(
                            "ld.global.cg.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                            write_only_types=[Float32, Float32, Float32, Float32],
                            read_only_args=[ptr],
                        )
                    )
                self.store4(mO, mE, t, row, vals)


_PH = (16, 16)


def _fake_args(p: TmaPlan):
    bf = torch.bfloat16
    e = itf.fake(bf, (p.m, p.n)) if p.residual_epilogue else itf.fake(bf, _PH)
    w = itf.fake(bf, (p.npad * p.kt, BK)) if p.packed else itf.fake(bf, (p.n, p.k))
    return (itf.fake(bf, (p.m, p.k)), w, itf.fake(bf, (p.m, p.n)), e,
            itf.fake(torch.float32, (p.splits, p.bn, p.npad)),
            itf.fake(torch.int32, (p.row_tiles,), align=4), itf.env_stream())  # fmt: skip


def compile_plan(p: TmaPlan):
    """Compile (cached) the kernel of ``p``."""
    return itf.compiled(("tma_gemm", p), lambda: (TmaGemm(p), _fake_args(p)))


_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(p: TmaPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 partials and zeroed counters, one pair per plan and device (the last CTA of a row
    tile re-zeroes its counter: launches of one plan on one stream reuse them)."""
    key = (p, str(device))
    ws = _WS.get(key)
    if ws is None:
        ws = _WS[key] = (
            torch.empty(p.splits, p.bn, p.npad, dtype=torch.float32, device=device),
            torch.zeros(p.row_tiles, dtype=torch.int32, device=device),
        )
    return ws


def prepare(p: TmaPlan, device) -> None:
    """Compile and allocate what a plan's launches use (before graph capture)."""
    compile_plan(p)
    _workspace(p, device)


def pack_weight(w: torch.Tensor, bm: int = 64, cm: int = 1) -> torch.Tensor:
    """``w [n, k]`` as the packed plan reads it: ``[row_tiles * kt * bm, 64]``, tile (row tile
    ``r``, chunk ``c``) at rows ``(r * kt + c) * bm``; rows past ``n`` are zeros."""
    n, k = w.shape
    rt = -(-n // (bm * cm)) * cm
    wp = torch.zeros(rt * bm, k, dtype=w.dtype, device=w.device)
    wp[:n] = w
    return wp.view(rt, bm, k // BK, BK).permute(0, 2, 1, 3).contiguous().view(-1, BK)


def tma_gemm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
             epilogue_residual: torch.Tensor | None = None, n: int = 0, **kw) -> None:  # fmt: skip
    """``out = bf16(x @ w^T)`` (``epilogue_residual``: ``bf16(bf16(x @ w^T) + e)``, ``out``
    may alias it). ``x`` ``[m, k]`` and ``w`` ``[n, k]`` contiguous BF16 (``packed=True``:
    :func:`pack_weight`'s form of it); ``kw``: the plan's tiling (``bm``, ``bk``, ``splits``,
    ``stages``, ``cm``, ``rotate``, ``packed``, ``pdl``)."""
    m, k = int(x.shape[0]), int(x.shape[1])
    packed = kw.get("packed", False)
    n = n or int(out.shape[1])
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("tma_gemm: x and w must be contiguous")
    itf.check(out, "tma_gemm out", (m, n), torch.bfloat16)
    p = plan(m, k, n, residual_epilogue=epilogue_residual is not None, **kw)
    want = (p.npad * p.kt, BK) if packed else (n, k)
    itf.check(w, "tma_gemm w" + (" (packed)" if packed else ""), want, torch.bfloat16)
    fn = compile_plan(p)
    ws, cnt = _workspace(p, x.device)
    e = epilogue_residual if epilogue_residual is not None else itf.placeholder(x.device, _PH)
    fn(x, w, out, e, ws, cnt)


def tma_gemm_ref(x: torch.Tensor, w: torch.Tensor,
                 epilogue_residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The kernel's rounding in torch: FP32 sums, one BF16 rounding (then the residual add and a
    second rounding)."""
    acc = x.float() @ w.float().t()
    if epilogue_residual is None:
        return acc.to(torch.bfloat16)
    return (acc.to(torch.bfloat16).float() + epilogue_residual.float()).to(torch.bfloat16)
