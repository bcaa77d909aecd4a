"""o_proj + two-GPU all-reduce + residual add, one launch per rank (tp_world 2, NVLink).

``r'[m, n] = bf16( bf16(P_0[m, n] + P_1[m, n]) + r[m, n] )`` with ``P_i = o_i @ Wo_i^T`` each
rank's FP32 partial (row-parallel o_proj: rank i holds the heads of its shard). Every rank ends
with the same ``r'`` bit for bit (FP32 addition commutes: ``P_0 + P_1 == P_1 + P_0``).

The GEMM is :mod:`.skinny_gemm`'s (tensor-core ``m16n8k16`` with swapped operands, the warps
splitting K, reduced through shared memory); what changes is the epilogue, which follows the
protocol of :mod:`.comm` (read its docstring for the safety argument):

1. ``griddepcontrol.wait`` (PDL), read the launch's epoch ``e`` (``comm.begin_epoch``);
2. the CTA's row tiles: main loop, then the warps' K-slices summed into FP32 values that stay in
   shared memory and are stored into the *peer's* ``recv[e % 2]`` as [M, N] FP32;
3. ``bar.sync``; thread 0: ``fence.acq_rel.sys`` + ``st.release.sys`` of ``e + 1`` into the
   peer's ``flags[cta]``;
4. while the peer's tile travels: L2 prefetch of a share of the next op's weights (``mPre``,
   e.g. the MoE front kernel's packed [router; latent_down; shared_w13] rows);
5. thread 0 spins (``ld.acquire.sys``) on its own ``flags[cta]`` until ``>= e + 1``;
   ``bar.sync``; sum own + peer, round to BF16, add the residual, store ``r'``.

The RMSNorm that follows is fused the way the single-GPU path fuses it
(:mod:`.oproj_residual_norm`): the next kernel (the MoE front GEMV) recomputes the per-token
rstd of ``r'`` in its prologue, so this launch writes only ``r'``.

Grid: the CTAs must all be resident at once only in the weak sense that each CTA waits for its
*partner* on the peer (CTA b waits for the peer's CTA b), which in-order block dispatch always
schedules; to be safe regardless, the grid is at most ``2 * SMs`` (M <= 32) or ``SMs`` CTAs and
each CTA loops over row-tile units ``cta, cta + grid, ...`` (one unit per CTA at kimi-k3 shapes:
at M <= 16 two 16-row tiles per CTA, 224 CTAs for N = 7168).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402
from cutlass import BFloat16, Float32, Int32, Int64  # noqa: E402

from decodescope.kernels.specialized import comm
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized.skinny_gemm import KCHUNK, ROWS, GemmPlan, SkinnyGemm
from decodescope.kernels.specialized.utils import pdl_begin, pdl_enabled

H200_SMS = 132


@dataclass(frozen=True)
class OProjARPlan:
    """Compile-time facts: tokens m, per-rank K, output N, whether the kernel takes an L2
    prefetch range (the next op's weights; its length is a runtime argument), SM count, PDL."""

    m: int
    k: int
    n: int
    prefetch: bool = True
    sms: int = H200_SMS
    pdl: bool = field(default_factory=pdl_enabled)
    proto: str | None = None  # flag / ll / auto; None: $DECODESCOPE_TP2_PROTO (resolved here)

    def __post_init__(self) -> None:
        object.__setattr__(self, "proto", comm.resolve_proto(self.proto, "oproj", self.m))
        if self.m * self.n > comm.RECV_FLOATS:
            raise ValueError(f"oproj_allreduce: {self.m} x {self.n} FP32 exceeds the receive area")

    @property
    def gemm(self) -> GemmPlan:
        rt = 0
        if self.m <= 16 and self.n // ROWS > 2 * self.sms:
            rt = 2  # 224 CTAs of two row tiles at N = 7168: every CTA resident, one unit each
        return GemmPlan(m=self.m, k=self.k, segments=(self.n,), residual_epilogue=True,
                        pdl=self.pdl, rt_force=rt)  # fmt: skip

    @property
    def units(self) -> int:
        return self.gemm.ctas(self.n)

    @property
    def grid(self) -> int:
        cap = self.sms * (2 if self.m <= 32 else 1)
        return min(self.units, cap, comm.FLAG_SLOTS)

    @property
    def upc(self) -> int:
        """Units per CTA at most."""
        return -(-self.units // self.grid)


class OProjAllReduce(SkinnyGemm):
    def __init__(self, plan: OProjARPlan):
        super().__init__(plan.gemm)
        self.q = plan

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, K] bf16: this rank's attention output (its heads)
        mW: cute.Tensor,  # [N, K] bf16: this rank's o_proj shard
        mR: cute.Tensor,  # [M, N] bf16 residual in
        mOut: cute.Tensor,  # [M, N] bf16 new residual out (may alias mR)
        mPre: cute.Tensor,  # [16] bf16 view at the base of the next op's weights (prefetch)
        nPre: Int32,  # bf16 elements to prefetch from mPre's base (0: none)
        mFlags: cute.Tensor,
        mRecv: cute.Tensor,
        mPeerFlags: cute.Tensor,
        mPeerRecv: cute.Tensor,
        mCtl: cute.Tensor,
        stream,
    ):
        p, q = self.p, self.q
        mp = p.ntiles * 8

        @cute.struct
        class Smem:
            ep: cute.struct.MemRange[Int32, 4]
            own: cute.struct.Align[cute.struct.MemRange[Float32, q.upc * p.rt * ROWS * mp], 16]
            red: cute.struct.Align[cute.struct.MemRange[Float32, p.ks * ROWS * mp], 16]

        self.smem_cls = Smem
        self.kernel(
            mX, mW, mR, mOut, mPre, nPre, mFlags, mRecv, mPeerFlags, mPeerRecv, mCtl
        ).launch(
            grid=[q.grid, 1, 1],
            block=[self.threads, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
        )

    @cute.kernel
    def kernel(self, mX, mW, mR, mOut, mPre, nPre, mFlags, mRecv, mPeerFlags, mPeerRecv, mCtl):
        p, q = self.p, self.q
        mp = p.ntiles * 8
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        ntiles = q.n // ROWS
        tile_floats = p.rt * ROWS * mp

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sEp = st.ep.get_tensor(cute.make_layout(4))
        sOwn = st.own.get_tensor(cute.make_layout((q.upc, tile_floats), stride=(tile_floats, 1)))
        sRed = st.red.get_tensor(cute.make_layout((p.ks, ROWS, mp), stride=(ROWS * mp, mp, 1)))

        if cutlass.const_expr(p.pdl):
            self.prefetch_weights(mW, bidx, ntiles, warp, lane)
            pdl_begin()
        comm.begin_epoch(mCtl, q.grid, sEp)
        e = sEp[0]
        par = e % 2
        mPeerP = cute.make_tensor(mPeerRecv.iterator + par * mPeerRecv.shape[1],
                                  cute.make_ordered_layout((q.m, q.n), order=(1, 0)))  # fmt: skip
        mOwnP = cute.make_tensor(mRecv.iterator + par * mRecv.shape[1],
                                 cute.make_ordered_layout((q.m, q.n), order=(1, 0)))  # fmt: skip

        # 2: every unit's partial into sOwn and the peer's receive area
        for i in cutlass.range_constexpr(q.upc):
            u = bidx + i * q.grid
            if u < q.units:
                self.partial_tile(mX, mW, sRed, sOwn, mPeerP, u, i, ntiles, warp, lane)
        cute.arch.sync_threads()
        # 3: release
        comm.release_to_peer(mPeerFlags, bidx, e + 1)
        # 4: prefetch the next op's weights while the peer's tile travels
        if cutlass.const_expr(q.prefetch):
            comm.prefetch_range(mPre, nPre, bidx, q.grid, self.threads)
        # 5: acquire, sum, epilogue
        if tidx == 0:
            comm.wait_flag(mFlags.iterator + bidx, e + 1, mCtl.iterator + 2)
        cute.arch.sync_threads()
        total = ROWS * p.m
        for i in cutlass.range_constexpr(q.upc):
            u = bidx + i * q.grid
            if u < q.units:
                for rq in cutlass.range_constexpr(p.rt):
                    t = u * p.rt + rq
                    if t < ntiles:
                        for j in cutlass.range_constexpr(
                            (total + self.threads - 1) // self.threads
                        ):
                            idx = tidx + j * self.threads
                            if idx < total:
                                r = idx % ROWS
                                m = idx // ROWS
                                n = t * ROWS + r
                                val = sOwn[i, rq * ROWS * mp + idx] + mOwnP[m, n]
                                val = val.to(BFloat16).to(Float32) + mR[m, n].to(Float32)
                                mOut[m, n] = val.to(BFloat16)

    @cute.jit
    def _mainloop(self, mX, mW, u, ntiles, lane, warp):
        """skinny_gemm's main loop over row tiles ``u * rt ..``: this warp's K-slice
        accumulators."""
        p = self.p
        rt = p.rt
        g = lane // 4
        c = lane % 4
        atom = mc.mma_atom()
        rows = []
        for rq in cutlass.range_constexpr(rt):
            t = cutlass.min(u * rt + rq, ntiles - 1)
            rows.append(t * ROWS + g)
        accs = mc.zero_accs(rt * p.ntiles)
        fa, fb = mc.fragments()
        chunks_per_warp = p.k // KCHUNK // p.ks
        uu = p.unroll
        chunk0 = warp * chunks_per_warp
        for it in cutlass.range(chunks_per_warp // uu, unroll_full=p.m <= 16):
            mc.mma_chunks(
                atom, accs, fa, fb, mW, rows, p.ntiles, uu,
                lambda v, it=it: (chunk0 + it * uu + v) * KCHUNK + c * 8,
                lambda k0: self.b_tiles(mX, mX, None, None, g, k0, False),
            )  # fmt: skip
        return accs

    @cute.jit
    def partial_tile(self, mX, mW, sRed, sOwn, mPeerP, u, i, ntiles, warp, lane):
        """Row tiles ``u * rt ..`` of the GEMM (skinny_gemm's main loop); the FP32 sums go to
        ``sOwn[i]`` (index ``rq * 16 * mp + m * 16 + r``) and to the peer's [M, N] area."""
        p = self.p
        rt = p.rt
        g = lane // 4
        c = lane % 4
        accs = self._mainloop(mX, mW, u, ntiles, lane, warp)
        tidx, _, _ = cute.arch.thread_idx()
        mp = p.ntiles * 8
        total = ROWS * p.m
        for rq in cutlass.range_constexpr(rt):
            for j in cutlass.range_constexpr(p.ntiles):
                mc.stash_acc(sRed, warp, g, c, j, accs[rq * p.ntiles + j])
            cute.arch.sync_threads()
            t = u * rt + rq
            if t < ntiles:
                for jj in cutlass.range_constexpr((total + self.threads - 1) // self.threads):
                    idx = tidx + jj * self.threads
                    if idx < total:
                        r = idx % ROWS
                        m = idx // ROWS
                        val = Float32(0.0)
                        for w in cutlass.range_constexpr(p.ks):
                            val = val + sRed[w, r, m]
                        sOwn[i, rq * ROWS * mp + idx] = val
                        mPeerP[m, t * ROWS + r] = val
            cute.arch.sync_threads()


class OProjAllReduceLL(OProjAllReduce):
    """The same kernel over the LL protocol (:mod:`.comm`): each CTA stores its FP32 partial
    into the peer's ``ll[e % 2]`` as [M, N] words of ``{partial, e + 1}`` right after its own
    row tiles are done (no flag, no system fence, no grid-wide step), and every thread polls
    the words of the values it sums. The epoch is taken without blocking the main loop
    (thread 0's load and arrival are consumed after it)."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mW: cute.Tensor,
        mR: cute.Tensor,
        mOut: cute.Tensor,
        mPre: cute.Tensor,
        nPre: Int32,
        mLL: cute.Tensor,  # [2, RECV_FLOATS] int64: this rank's LL words (the peer writes)
        mPeerLL: cute.Tensor,  # the peer's (this rank writes)
        mRed: cute.Tensor,  # unused here (the MoE back end's reduced area)
        mCtl: cute.Tensor,
        stream,
    ):
        p, q = self.p, self.q
        mp = p.ntiles * 8

        @cute.struct
        class Smem:
            ep: cute.struct.MemRange[Int32, 4]
            own: cute.struct.Align[cute.struct.MemRange[Float32, q.upc * p.rt * ROWS * mp], 16]
            red: cute.struct.Align[cute.struct.MemRange[Float32, p.ks * ROWS * mp], 16]

        self.smem_cls = Smem
        self.kernel_ll(mX, mW, mR, mOut, mPre, nPre, mLL, mPeerLL, mCtl).launch(
            grid=[q.grid, 1, 1],
            block=[self.threads, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
        )

    @cute.kernel
    def kernel_ll(self, mX, mW, mR, mOut, mPre, nPre, mLL, mPeerLL, mCtl):
        p, q = self.p, self.q
        mp = p.ntiles * 8
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        ntiles = q.n // ROWS
        tile_floats = p.rt * ROWS * mp
        half = mLL.shape[1]

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        sEp = st.ep.get_tensor(cute.make_layout(4))
        sOwn = st.own.get_tensor(cute.make_layout((q.upc, tile_floats), stride=(tile_floats, 1)))
        sRed = st.red.get_tensor(cute.make_layout((p.ks, ROWS, mp), stride=(ROWS * mp, mp, 1)))

        if cutlass.const_expr(p.pdl):
            self.prefetch_weights(mW, bidx, ntiles, warp, lane)
            pdl_begin()
        word = Int64(0)  # thread 0: the epoch word before its arrival (comm.epoch_arrive)
        if tidx == 0:
            word = comm.epoch_arrive(mCtl)

        # each unit: partial -> sOwn and the peer's LL words, as soon as it is done
        for i in cutlass.range_constexpr(q.upc):
            u = bidx + i * q.grid
            if u < q.units:
                self.partial_tile_ll(mX, mW, sRed, sOwn, sEp, word, mPeerLL, half, u, i, ntiles,
                                     warp, lane)  # fmt: skip
        if tidx == 0:
            sEp[0] = comm.lo32(word)  # (also written inside; a CTA without units needs it)
        cute.arch.sync_threads()
        e = sEp[0]
        base = (e % 2) * half
        if cutlass.const_expr(q.prefetch):
            comm.prefetch_range(mPre, nPre, bidx, q.grid, self.threads)
        total = ROWS * p.m
        for i in cutlass.range_constexpr(q.upc):
            u = bidx + i * q.grid
            if u < q.units:
                for rq in cutlass.range_constexpr(p.rt):
                    t = u * p.rt + rq
                    if t < ntiles:
                        for j in cutlass.range_constexpr(
                            (total + self.threads - 1) // self.threads
                        ):
                            idx = tidx + j * self.threads
                            if idx < total:
                                r = idx % ROWS
                                m = idx // ROWS
                                n = t * ROWS + r
                                peer = comm.wait_ll(mLL.iterator + base + m * q.n + n, e + 1,
                                                    mCtl.iterator + 2)  # fmt: skip
                                val = sOwn[i, rq * ROWS * mp + idx] + peer
                                val = val.to(BFloat16).to(Float32) + mR[m, n].to(Float32)
                                mOut[m, n] = val.to(BFloat16)
        if tidx == 0:
            comm.epoch_finish(mCtl, word, q.grid)

    @cute.jit
    def partial_tile_ll(self, mX, mW, sRed, sOwn, sEp, word, mPeerLL, half, u, i, ntiles, warp,
                        lane):  # fmt: skip
        """:meth:`partial_tile` with the peer copy as LL words ``{value, e + 1}``; thread 0
        publishes the epoch (low half of ``word``) in ``sEp[0]`` at the first barrier, after the
        main loop: the arrival atomic is waited for there, not before."""
        p = self.p
        rt = p.rt
        g = lane // 4
        c = lane % 4
        accs = self._mainloop(mX, mW, u, ntiles, lane, warp)
        tidx, _, _ = cute.arch.thread_idx()
        mp = p.ntiles * 8
        total = ROWS * p.m
        for rq in cutlass.range_constexpr(rt):
            for j in cutlass.range_constexpr(p.ntiles):
                mc.stash_acc(sRed, warp, g, c, j, accs[rq * p.ntiles + j])
            if tidx == 0:
                sEp[0] = comm.lo32(word)
            cute.arch.sync_threads()
            e = sEp[0]
            base = (e % 2) * half
            t = u * rt + rq
            if t < ntiles:
                for jj in cutlass.range_constexpr((total + self.threads - 1) // self.threads):
                    idx = tidx + jj * self.threads
                    if idx < total:
                        r = idx % ROWS
                        m = idx // ROWS
                        val = Float32(0.0)
                        for w in cutlass.range_constexpr(p.ks):
                            val = val + sRed[w, r, m]
                        sOwn[i, rq * ROWS * mp + idx] = val
                        comm.st_ll(mPeerLL.iterator + base + m * self.q.n + t * ROWS + r, val,
                                   e + 1)  # fmt: skip
            cute.arch.sync_threads()


# -- torch-facing --------------------------------------------------------------------------


def plan_for(cfg, kind: str, m: int, prefetch: bool = True, sms: int = H200_SMS,
             proto: str | None = None) -> OProjARPlan:  # fmt: skip
    k = cfg.kda_dim if kind == "kda" else cfg.mla_v_dim
    return OProjARPlan(m=m, k=k, n=cfg.hidden, prefetch=prefetch, sms=sms, proto=proto)


def _fake_args(plan: OProjARPlan):
    bf = torch.bfloat16
    M, K, N = plan.m, plan.k, plan.n
    return (
        itf.fake(bf, (M, K)),
        itf.fake(bf, (N, K)),
        itf.fake(bf, (M, N)),
        itf.fake(bf, (M, N)),
        itf.fake(bf, (comm.PREFETCH_HEAD,)),
        Int32(0),
        *(comm.fake_workspace_args_ll() if plan.proto == "ll" else comm.fake_workspace_args()),
        itf.env_stream(),
    )


def _op(plan: OProjARPlan) -> OProjAllReduce:
    return OProjAllReduceLL(plan) if plan.proto == "ll" else OProjAllReduce(plan)


def compile_plan(plan: OProjARPlan):
    """Compile (cached) the kernel of ``plan``; works without a GPU."""
    return itf.compiled(("oproj_allreduce", plan), lambda: (_op(plan), _fake_args(plan)))


def device_sms(device) -> int:
    """SMs of a CUDA device (the H200's 132 for other devices: meta / CPU compile checks)."""
    device = torch.device(device)
    if device.type != "cuda":
        return H200_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def oproj_allreduce(
    ws: comm.PeerWorkspace,
    o: torch.Tensor,
    w_o: torch.Tensor,
    r: torch.Tensor,
    r_out: torch.Tensor,
    prefetch: torch.Tensor | None = None,
    proto: str | None = None,
) -> None:
    """``r_out = bf16(allreduce(o @ w_o^T)) + r`` over the two ranks of ``ws`` (one launch).
    ``proto``: ``flag``, ``ll`` or ``auto`` (:mod:`.comm`); None: ``$DECODESCOPE_TP2_PROTO``,
    else ``comm.PROTO_DEFAULT`` (ll).
    ``r_out`` may alias ``r``. ``prefetch``: the next op's weights (any contiguous bf16 tensor;
    its first bytes, up to its size, are pulled into L2 while the peer's tile travels).
    Call it on both ranks, in the same order as every other kernel of ``ws``."""
    M, K = o.shape
    N = w_o.shape[0]
    itf.check(o, "o", (M, K), torch.bfloat16)
    itf.check(w_o, "w_o", (N, K), torch.bfloat16)
    itf.check(r, "r", (M, N), torch.bfloat16)
    itf.check(r_out, "r_out", (M, N), torch.bfloat16)
    head, npre = comm.PeerWorkspace.prefetch_args(prefetch, o.device)
    plan = OProjARPlan(m=M, k=K, n=N, sms=device_sms(o.device), proto=proto)
    fn = compile_plan(plan)
    fn(o, w_o, r, r_out, head, npre, *(ws.args_ll() if plan.proto == "ll" else ws.args()))


def oproj_allreduce_ref(os_: list[torch.Tensor], ws_: list[torch.Tensor], r: torch.Tensor):
    """Torch reference: ranks ``i`` (simulated on one device) with attention outputs ``os_[i]``
    and o_proj shards ``ws_[i]``; FP32 partials summed in rank order, the kernel's roundings."""
    part = sum(o.float() @ w.float().T for o, w in zip(os_, ws_, strict=True))
    return (part.to(torch.bfloat16).float() + r.float()).to(torch.bfloat16)
