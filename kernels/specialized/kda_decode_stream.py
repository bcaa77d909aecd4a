"""KDA decode at large batch: persistent CTAs that stream the FP32 state through shared memory
(``DECODESCOPE_KDA_STREAM``, :func:`.kda_decode.stream_for`).

The same function, thread mapping and chains as :class:`.kda_decode.KDADecode` (two lanes per
state column; :meth:`~.kda_decode.KDADecode.item_tokens` or the batched chain, whose
state-free prologue runs before the item's state is waited for); what changes is how a CTA
gets the state of a (head, sequence) item. The one-CTA kernel loads its 64 KB with per-thread
4-byte loads, computes, stores and exits: at 64 sequences (768 items at TP8, two CTAs per SM by
registers) each SM's loads stop while its CTAs run their serial per-token chains, and the H200
trace shows the decode at 1.5-1.6x its state's bytes (TP8 37.2 us for 101 MB; TP16 20.3 us for
50 MB, `results/`, batch 64).

Here ``min(items, cpsm x SMs)`` CTAs walk the items ``cta, cta + grid, ...`` (item ``it``:
sequence ``it // heads``, head ``it % heads``; the state ``[B, heads, hd, hd]`` is contiguous,
so an item's state is the 64 KB at ``it x hd x hd``). Thread 0 keeps ``stages`` states in
flight: one mbarrier per shared-memory slot, armed with the state's bytes, filled by
``cp.async.bulk`` copies (``PIECES`` per state). Per item every thread loads its conv history
and weights (global, before the wait), waits on the slot's mbarrier (phase = the slot's use
count mod 2), moves its rows of the state from the slot into registers, and after one block
barrier (every thread has read the slot) thread 0 refills the slot with the state of the item
``stages`` steps ahead. The state goes back to global memory from registers as before. So the
next ``stages`` states stream in while a CTA runs an item's chain.

The first ``stages`` copies are issued before the PDL wait: the state is written by this
layer's kernel one step earlier, never by the kernel before this one in the step (the reasoning
of :func:`.kda_decode.early_enabled`).

Shared memory: ``stages`` x 64 KB plus the per-token scratch; ``stages`` 1..3 (one CTA per SM
from 2 stages, two from 1).

Measured (H200, session 30, kernel alone, ``scripts/gpu_kda_split.py --streams``): not kept.
One CTA per SM is bound by an item's serial chain, not by its loads: TP8 64x1 54.2 us (2x1)
against 43.2 for the one-CTA kernel; with the batched chain the best set, 1x2, 38.7 against
42.4. Off by default (``DECODESCOPE_KDA_STREAM`` unset).
"""

# no `from __future__ import annotations`: the smem structs read their field annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.experimental import primitives as prims

from decodescope.kernels.specialized.kda_decode import NUM_SMS, KDADecode, KDAPlan
from decodescope.kernels.specialized.utils import pdl_begin

PIECES = 4  # bulk copies per state (16 KB each at head_dim 128)
SMEM_LIMIT = 227 * 1024  # H200: shared memory per SM a CTA may take


class KDADecodeStream(KDADecode):
    def __init__(self, plan: KDAPlan):
        super().__init__(plan)
        ns, cpsm = plan.stream, plan.stream_cpsm
        hd = plan.head_dim
        self.NS = ns
        self.items = plan.heads * plan.batch
        self.ctas = min(self.items, NUM_SMS * cpsm)
        self.state_floats = hd * hd
        self.sbytes = hd * hd * 4
        # bound on the per-token scratch: decay, q, k (and v, o when rolled) FP32 rows, the
        # staged BF16 projection (5 rows a token, :meth:`KDADecode.stage_proj`), reductions
        scratch = 4 * (8 * self.nt * hd + self.nred + 16) + 2 * self.stage_len
        if ns < 1 or cpsm < 1 or cpsm * (ns * self.sbytes + scratch + 1024) > SMEM_LIMIT:
            raise ValueError(
                f"KDA stream: {ns} stages x {cpsm} CTAs per SM of {self.sbytes // 1024} KB "
                f"states do not fit the {SMEM_LIMIT // 1024} KB of shared memory per SM"
            )
        if self.sbytes % (16 * PIECES):
            raise ValueError(
                f"KDA stream: a {self.sbytes}-byte state splits into no 16-byte pieces"
            )

    def grid(self) -> list:
        return [self.ctas, 1, 1]

    def ctas_per_sm(self) -> int:
        return self.p.stream_cpsm

    def smem_struct(self):
        """The per-token scratch, then one mbarrier and one state slot per stage."""
        hd, NS = self.p.head_dim, self.NS
        Scratch = super().smem_struct()

        @cute.struct
        class Smem:
            scratch: Scratch
            bar: cute.struct.Align[cute.struct.MemRange[Int64, NS], 8]
            state: cute.struct.Align[cute.struct.MemRange[Float32, NS * hd * hd], 128]

        return Smem

    @cute.kernel
    def kernel(self, mProj, mConvW, mConv, mFb, mALog, mDt, mONorm, mS, mOut):
        p = self.p
        hd, SP, NS, H = p.head_dim, self.split, self.NS, p.heads
        rows = hd // SP
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        j = tidx // SP  # value column of this thread
        half = tidx % SP  # which rows of it: self.srow(ii, half)
        st = cutlass.memory.SmemAllocator().allocate(self.smem_cls)
        sh = self.shared(st.scratch)
        sBar = st.bar.get_tensor(cute.make_layout(NS))
        # [slot, k row, v column]: the state's own layout, one slot after the other
        sSt = st.state.get_tensor(cute.make_layout((NS, hd, hd), stride=(hd * hd, hd, 1)))
        if tidx == 0:
            for s in cutlass.range_constexpr(NS):
                cute.arch.mbarrier_init(sBar.iterator + s, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if tidx == 0:  # the first states: never written by the kernel before this one
            for s in cutlass.range_constexpr(NS):
                if cta + s * self.ctas < self.items:
                    self.issue(mS, sSt, sBar, cta + s * self.ctas, s)
        if cutlass.const_expr(p.pdl):
            pdl_begin()

        rS = cute.make_rmem_tensor((rows,), Float32)
        rHist, rCw, rFb = self.item_regs()
        qkv = gj = beta = None
        if cutlass.const_expr(self.batched):
            qkv, gj, beta = self.batched_regs()
        it = Int32(cta)
        kk = Int32(0)
        while it < self.items:
            b = it // H
            h = it % H
            col = h * hd + j
            a_h, dt, onorm = self.item_loads(mConvW, mConv, mFb, mALog, mDt, mONorm, b, h, col,
                                             rHist, rCw, rFb)  # fmt: skip
            if cutlass.const_expr(self.batched):  # the state-free part before the state's wait
                self.batched_prologue(mProj, mFb, b, h, col, a_h, dt, rHist, rCw, rFb, sh, qkv,
                                      gj, beta)  # fmt: skip
            slot = kk % NS
            cute.arch.mbarrier_wait(sBar.iterator + slot, (kk // NS) % 2)
            for ii in cutlass.range_constexpr(rows):
                rS[ii] = sSt[slot, self.srow(ii, half), j]
            cute.arch.sync_threads()  # every thread holds its rows: the slot is free
            if tidx == 0:
                nxt = it + NS * self.ctas
                if nxt < self.items:
                    self.issue(mS, sSt, sBar, nxt, slot)
            if cutlass.const_expr(self.batched):
                self.batched_state(mOut, b, col, onorm, rS, sh, qkv, gj, beta)
            else:
                self.item_tokens(mProj, mFb, mOut, b, h, col, a_h, dt, onorm, rS, rHist, rCw, rFb,
                                 sh)  # fmt: skip
            self.item_store(mConv, mS, b, h, col, rS, rHist)
            it = it + self.ctas
            kk = kk + 1

    @cute.jit
    def issue(self, mS, sSt, sBar, it, slot):
        """Thread 0: arm slot ``slot``'s mbarrier with a state's bytes and copy item ``it``'s
        state into the slot (``PIECES`` bulk copies)."""
        n = self.state_floats // PIECES
        bar = sBar.iterator + slot
        src = mS.iterator + Int64(it) * self.state_floats
        dst = sSt.iterator + slot * self.state_floats
        cute.arch.mbarrier_arrive_and_expect_tx(bar, self.sbytes)
        for q in cutlass.range_constexpr(PIECES):
            prims.cp_async_bulk_shared_cluster_global(
                dst + q * n, (src + q * n).align(16), bar, n * 4
            )
