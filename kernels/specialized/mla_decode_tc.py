"""Gated-MLA absorbed decode on tensor cores: the heads (and draft tokens) of one sequence as
the MMA rows, keys staged in shared memory once per CTA, split-KV with an in-launch combine.

Same contract as :mod:`.mla_decode` (its ``MLADecode`` stays selectable:
``DECODESCOPE_MLA_KERNEL=simt``); BF16 latent cache only (FP8 goes to the old kernel).

Grid: (head group, sequence, split). A CTA owns ``hg`` heads x ``T`` tokens = ``rows <= 16``
query rows (row ``r`` = head ``r // T``, token ``r % T``) and one range of key positions.
8 warps. Per CTA:

1. The T new latent rows (``rmsnorm(kv_a) * kv_a_norm | k_pe``, BF16) into shared memory;
   the CTA (group 0, split 0) also writes them to the cache (nobody reads those cache slots in
   this launch: the key blocks take them from shared memory).
2. Absorbed queries ``q_lat = q_nope @ w_uk[h]`` for all rows (thread = 8 latent columns x a
   slice of the nope rows, all T tokens of a head from one load of ``w_uk``), scaled by
   ``1/sqrt(nope + rope)``, stored in shared memory as BF16 (the MMA's A operand), beside
   ``q_pe``.
3. Key blocks of 64 positions, double-buffered with ``cp.async`` (16-byte pieces, issued two
   blocks ahead; the new rows and the zero fill past the end are plain shared stores). Per
   block: scores ``S[16, 64] = Q K^T`` with ``mma.sync.m16n8k16`` (warp w: keys 8w..8w+7, the
   576-wide K in 36 steps; the K order is permuted inside each 16-chunk so that every A and B
   fragment is one 8-byte shared load), the causal mask (row of token t sees positions
   ``< ctx + t + 1``), the block's row max across warps through shared memory, the online
   softmax (all warps use the same running max), P as BF16 into shared memory, then
   ``O[16, 512] += P V`` with V = the first 512 columns of the same staged keys (warp w:
   output columns 64w..64w+63; the B fragments are 2-byte shared loads, padding chosen so the
   4 key rows of a fragment sit in distinct banks).
4. With one split the CTA normalizes O; with several each writes ``(O, m, l)`` per row to a
   workspace and the CTA that finishes a (sequence, head group) last (acq_rel counter, reset
   by that CTA: graph-replay safe) merges them.
5. ``out = (o_lat @ w_uv[h]) * sigmoid(g)`` (thread = 8 output columns x a slice of the
   latent rows, all T tokens from one load of ``w_uv``).

Head groups and splits are chosen per (batch, tokens) so that the grid covers the SMs while
the per-CTA ``w_uk`` / ``w_uv`` reads (``hg`` x 128 KB each from L2) stay spread: one head per
CTA at batch 1 (as the old kernel), all heads of a sequence from 48 (sequence, group) pairs on.
``heads_per_cta`` overrides (``DECODESCOPE_MLA_HEADS_PER_CTA``), ``splits`` too
(``DECODESCOPE_MLA_TC_SPLITS``).

ldmatrix variant (the default; ``DECODESCOPE_MLA_TC_LDSM=0`` = the loads as before): step 3's
fragments come from ``ldmatrix`` instead of 8- and 2-byte shared loads, in the natural
K order (the permutation above is not needed: A and B agree either way). Per 64-key block and
warp: Q K^T takes the keys by ``x4`` (two k-steps each) and Q by ``x4``, or by ``x2`` when the
CTA has at most 8 rows (rows 8-15 are the zero padding and stay out of the loads), with even and
odd k-steps in two accumulators (two MMA chains of 18 instead of one of 36); P V takes P by
``x4`` / ``x2`` and V by ``x4.trans`` (two n-tiles each); P is stored 4 bytes at a time. ptxas
(sm_90a, TP8 64x1): 74 ``LDSM`` where the default has 108 ``LDS.64`` + 128 ``LDS.U16`` + 32
more; 186 registers (184). Same MMAs, same rounding points (P and q_lat in BF16, FP32
accumulation; only the order of the FP32 sums inside an MMA chain differs). H200 (s9/r2,
notes/gpu-logs/s9/r2/mla_tc, kernel alone, TP8): 32x1 87.8 -> 59.9 us, 64x1 102.6 -> 75.8,
8x8 109.2 -> 93.7, outputs as close to the reference as before (rel. L2 2.9e-3).

Cluster variant (the default from 64 query rows in clusters of 2, see ``cluster_mode``;
``DECODESCOPE_MLA_TC_CLUSTER=1`` everywhere with clusters up to 8, ``=0`` never): the most
heads per CTA that fit 16 rows (all 12 at TP8 with one token: the cache is read
once per sequence, not once per head group) and the keys split so that the grid is about one
CTA per SM, at most 8 splits; the splits of one (sequence, head group) form a thread-block
cluster (1, 1, splits). CTA ``s`` of the cluster absorbs only the heads ``j`` with
``j % splits == s`` and stores each 16-byte piece of their ``q_lat`` into the ``sQ`` of every
CTA of the cluster (``st.shared::cluster``); after the key loop each CTA leaves its unnormalized
``O``, ``m`` and ``l`` in its own shared memory, and CTA ``s`` merges the rows of its heads from
all the splits (``ld.shared::cluster``), then applies ``w_uv`` and the gate for those heads only.
So ``w_uk`` / ``w_uv`` are read once per (sequence, group) and the global partials, the counter
and the last-CTA merge are not used. Four cluster barriers (all CTAs started; q_lat published;
partials published; the merge's remote reads done, waited for before exit). TP8: 64x1 128 CTAs
(2 splits of 9 blocks), 32x1 128 (4 of 5), 16x1 / 8x1 6 splits of 3 blocks. Same rounding
points as the merge of the plain split path.

``DECODESCOPE_MLA_TC_CLUSTER_SEQS=C`` (with the cluster variant; C dividing the batch, C x
tokens <= 8): clusters of (C sequences) x (splits) CTAs, at most 8; the CTA of cluster rank
``rank`` = sequence-in-cluster + split x C absorbs and applies W_UV for the heads
``j % (C x splits) == rank`` for all C sequences (one ``w_uk`` / ``w_uv`` row piece load serves C sequences: their
L2 -> SM bytes / C), merging those rows from the C sequences' splits into a buffer of their own
in the key buffers. TP8 64x1 with C = 4: clusters of 8, two heads or one per CTA.

``DECODESCOPE_MLA_TC_NBUF=1`` (opt-in): one key buffer instead of two, so that two CTAs share
an SM (~100-110 KB of shared memory each, at most 128 registers: ptxas spills 72-96 bytes, in
the absorption, none in the key loop) and the splits double to fill them; the other CTA's work
hides what the missing double buffer exposes. ``DECODESCOPE_MLA_TC_UNROLL=U`` (opt-in): the
``w_uk`` / ``w_uv`` loads of each group of U rows issued before their FMAs.

``DECODESCOPE_MLA_TC_DIAG=1`` is a timing diagnostic with wrong results: no ``w_uk`` / ``w_uv``
reads (q_lat and the output are zeros), to split the kernel's time between the per-CTA
absorption / W_UV (L2 bytes) and the key loop.
"""

# no `from __future__ import annotations`: the Smem struct reads its field annotations
# (the DSL re-reads the source to preprocess a kernel: never edit a kernel file while a
# process that imported it still compiles, its line numbers no longer match)
import dataclasses
import math
import os
from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.utils import (
    block_sum,
    load_vec8,
    pdl_begin,
    pdl_enabled,
    sigmoid,
)

WARPS = 8
NT = WARPS * 32
ROWS = 16  # MMA rows: heads x tokens of one CTA
KBLK = 64  # keys per staged block (8 warps x 8 keys in the score MMAs)
KPAD = 24  # bf16 padding per staged row: 8-byte A/B loads and 2-byte V loads conflict-free
PPAD = 8
NUM_SMS = 132
NEG = -1.0e30
ABSORB_SCRATCH = 40 * 1024  # bytes of shared memory for the absorption's partial sums
SMEM_MAX = 227 * 1024
SMEM_TWO_CTAS = 113 * 1024  # two CTAs per SM (228 KB per SM, 1 KB reserved per CTA)
PAIRS_ONE_SPLIT = 128  # (sequence, head group) pairs from which each pair is one CTA
CLUSTER_MAX = 8  # portable thread-block cluster size (the splits of one pair in a cluster)
# the default: clusters from 64 query rows, of at most 2 CTAs (H200 s9/r4: clusters of 4 or 8
# CTAs of ~184 KB did not all fit at once on the GPCs: 32x1 in clusters of 4 65.3 us against
# 60.0 without, 64x1 in clusters of 4 96.2 against 61.5 in clusters of 2)
CLUSTER_MIN_ROWS = 64
CLUSTER_AUTO_MAX = 2


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def env_int(name: str, default: int = 0) -> int:
    """An integer knob from the environment (unset or empty: ``default``); one-line error."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    try:
        return int(v)
    except ValueError:
        raise ValueError(f"{name}: an integer, got {v!r}") from None


def cluster_mode() -> int:
    """``DECODESCOPE_MLA_TC_CLUSTER`` = 1: the splits of a (sequence, head group) form one
    thread-block cluster that shares the absorption, the merge and the W_UV through distributed
    shared memory (module docstring, "cluster variant"), clusters of up to 8; 0: never; unset
    (-1): the default, clusters of at most 2 from ``CLUSTER_MIN_ROWS`` query rows (batch x
    tokens) on (H200 s9/r4: 64x1 75.7 -> 61.5 us, 8x8 93.9 -> 54.7; 32x1 60.0 -> 65.3, not
    there)."""
    v = env_int("DECODESCOPE_MLA_TC_CLUSTER", -1)
    if v not in (-1, 0, 1):
        raise ValueError(f"DECODESCOPE_MLA_TC_CLUSTER: 0 or 1, got {v}")
    return v


def ldsm_enabled() -> bool:
    """``DECODESCOPE_MLA_TC_LDSM`` = 1 or unset (the default): the MMA fragments from
    ``ldmatrix`` (``.trans`` for V; module docstring, "ldmatrix variant"); 0: the 2- and 8-byte
    shared loads as before. Part of the plan (compile key), read when a plan is made."""
    v = env_int("DECODESCOPE_MLA_TC_LDSM", 1)
    if v not in (0, 1):
        raise ValueError(f"DECODESCOPE_MLA_TC_LDSM: 0 or 1, got {v}")
    return bool(v)


@dataclass(frozen=True)
class MLATCPlan:
    batch: int
    tokens: int
    heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    ctx: int
    eps: float = 1e-5
    pdl: bool = field(default_factory=pdl_enabled)
    heads_per_cta: int = 0  # 0: by batch (see the module docstring)
    splits_force: int = 0
    ldsm: bool = field(default_factory=ldsm_enabled)
    # timing diagnostic, wrong results: 1 = no w_uk / w_uv reads (``DECODESCOPE_MLA_TC_DIAG``)
    diag: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_TC_DIAG", 0))
    # 1 on (clusters <= 8), 0 off, -1 by batch x tokens (clusters <= 2; 2: that, decided on)
    cluster: int = field(default_factory=cluster_mode)
    # sequences per cluster (cluster variant): the absorption / W_UV heads spread over them too
    cluster_seqs: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_TC_CLUSTER_SEQS", 1))
    # w_uk / w_uv loads in flight per thread (0: by tokens, see ``unroll``)
    unroll_force: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_TC_UNROLL", 0))
    # key buffers: 2 (double-buffered, one CTA per SM) or 1 (single, two CTAs per SM)
    nbuf: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_TC_NBUF", 2))

    def __post_init__(self) -> None:
        if self.tokens > ROWS:
            raise ValueError(
                f"mla_decode_tc: at most {ROWS} tokens per sequence, got {self.tokens}"
            )
        if self.lat % 16 or self.kv_lora % (8 * WARPS) or self.v_dim % 8 or self.nope % 8:
            raise ValueError("mla_decode_tc: latent % 16, kv_lora % 64, v_dim % 8, nope % 8")
        if self.nbuf not in (1, 2):
            raise ValueError(f"DECODESCOPE_MLA_TC_NBUF: 1 or 2, got {self.nbuf}")
        if self.cluster_seqs < 1 or self.batch % self.cluster_seqs:
            raise ValueError(
                f"DECODESCOPE_MLA_TC_CLUSTER_SEQS={self.cluster_seqs} must divide the batch "
                f"({self.batch})"
            )
        if self.cl and self.cluster_seqs * self.tokens > 8:
            raise ValueError(
                f"DECODESCOPE_MLA_TC_CLUSTER_SEQS={self.cluster_seqs} x {self.tokens} tokens: "
                "at most 8 (sequence, token) pairs per absorption unit"
            )
        if self.heads_per_cta and (
            self.heads % self.heads_per_cta or self.heads_per_cta * self.tokens > ROWS
        ):
            raise ValueError(
                f"heads_per_cta={self.heads_per_cta} must divide {self.heads} heads and x "
                f"{self.tokens} tokens fit {ROWS} rows"
            )

    @property
    def lat(self) -> int:
        return self.kv_lora + self.rope

    @property
    def a_width(self) -> int:
        return self.q_lora + self.kv_lora + self.rope

    @property
    def hg(self) -> int:
        if self.heads_per_cta:
            return self.heads_per_cta
        fit = [d for d in _divisors(self.heads) if d * self.tokens <= ROWS]
        if self.cl:  # the most heads per CTA: the cache read once per sequence if all fit
            return fit[-1]
        if self.batch * self.tokens < 8:
            return 1
        # the fewest heads per CTA that keep (sequence, group) pairs <= 128 (one token) or
        # <= 64 (several: H200 at 8x8, hg 2 with 3 splits 102.0 us, hg 1 with 2 splits 111.2)
        most = PAIRS_ONE_SPLIT if self.tokens == 1 else PAIRS_ONE_SPLIT // 2
        for d in fit:
            if self.heads // d * self.batch <= most:
                return d
        return fit[-1]

    @property
    def groups(self) -> int:
        return self.heads // self.hg

    @property
    def rows(self) -> int:
        return self.hg * self.tokens

    @property
    def nkeys(self) -> int:
        return self.ctx + self.tokens

    @property
    def keys_per_split(self) -> int:
        pairs = self.groups * self.batch
        sms = NUM_SMS * self.ctas_per_sm
        fill = -(-sms // pairs) if self.nbuf == 2 else max(1, sms // pairs)  # nbuf 1: <= 2/SM
        want = self.splits_force or (1 if pairs >= PAIRS_ONE_SPLIT * self.ctas_per_sm else fill)
        most = -(-self.nkeys // KBLK)
        if self.cl:  # splits of a pair (x cluster_seqs) = one cluster: ~one CTA per SM
            want = self.splits_force or max(1, sms // pairs)
            cmax = CLUSTER_MAX if self.cluster == 1 else CLUSTER_AUTO_MAX  # -1 / 2: the default
            most = min(most, max(1, cmax // self.cluster_seqs))
        s = max(1, min(want, most, 64))
        return -(-self.nkeys // (s * KBLK)) * KBLK

    @property
    def splits(self) -> int:
        return -(-self.nkeys // self.keys_per_split)

    @property
    def nblk(self) -> int:
        return self.keys_per_split // KBLK

    @property
    def cl(self) -> bool:
        """The cluster variant: ``DECODESCOPE_MLA_TC_CLUSTER=1``, or unset with at least
        ``CLUSTER_MIN_ROWS`` query rows where its grid has clusters of 2 and covers at least
        half the SMs (else the plain plan, unchanged)."""
        if self.cluster == -1:
            if self.batch * self.tokens < CLUSTER_MIN_ROWS or self.splits_force > CLUSTER_AUTO_MAX:
                return False
            on = dataclasses.replace(self, cluster=2)
            return on.splits * on.cs_seqs > 1 and on.groups * on.batch * on.splits >= NUM_SMS // 2
        return self.cluster in (1, 2)

    @property
    def ctas_per_sm(self) -> int:
        """CTAs an SM holds: 2 with one key buffer (``nbuf`` 1: <= 113 KB and <= 128 registers)."""
        return 2 if self.nbuf == 1 else 1

    @property
    def clustered(self) -> bool:
        """The cluster variant with more than one CTA per cluster (else the plain path)."""
        return self.cl and self.splits * self.cs_seqs > 1

    @property
    def cs_seqs(self) -> int:
        """Sequences per cluster (1 unless the cluster variant)."""
        return self.cluster_seqs if self.cl else 1

    @property
    def csize(self) -> int:
        """CTAs per cluster: (sequences, splits) = (cs_seqs, splits), rank = seq + split * cs_seqs."""
        return self.cs_seqs * self.splits

    @property
    def hs(self) -> int:
        """Heads whose absorption / merge / W_UV one CTA does: all ``hg``, or in a cluster
        ``ceil(hg / csize)`` (heads ``j`` with ``j % csize`` = the CTA's rank), for all the
        cluster's sequences."""
        return -(-self.hg // self.csize) if self.clustered else self.hg

    @property
    def arows(self) -> int:
        """Rows of the absorption's partial sums: the CTA's rows, or in a cluster its (head,
        sequence, token) rows."""
        return self.hs * self.cs_seqs * self.tokens if self.clustered else self.rows

    @property
    def lp(self) -> int:
        return self.lat + KPAD

    @property
    def ds(self) -> int:
        """Slices of the nope rows in the absorption (a smem reduction when > 1)."""
        ncg = self.kv_lora // 8
        d = 1 << (max(1, NT // (self.hs * ncg)).bit_length() - 1)
        while d > 1 and (self.nope // 8) % d:
            d //= 2
        while d > 1 and d * self.arows * self.kv_lora * 4 > ABSORB_SCRATCH:
            d //= 2
        return d

    @property
    def unroll(self) -> int:
        """w_uk / w_uv loads in flight per thread (the absorption and W_UV loops are L2-latency
        chains: per = 128 loads per unit at 64x1); fewer at T = 8 (8 x 8 accumulators).
        ``DECODESCOPE_MLA_TC_UNROLL`` overrides (an A/B of latency against L2 bandwidth)."""
        return self.unroll_force or (16 if self.tokens <= 2 else 8)

    @property
    def cs(self) -> int:
        """Slices of the latent rows in the W_UV product (reduced in the key buffers)."""
        units = self.hs * (self.v_dim // 8)
        c = 1 << (max(4, NT // units).bit_length() - 1)  # a power of two
        budget = self.nbuf * KBLK * self.lp * 2 - ROWS * self.kv_lora * 4
        while c > 1 and (self.kv_lora % c or c * ROWS * self.v_dim * 4 > budget):
            c //= 2
        return c

    @property
    def smem_bytes(self) -> int:
        """Shared memory of one CTA (the ``Smem`` struct's fields, 16-byte alignment slack)."""
        bf = 2 * (self.nbuf * KBLK * self.lp + ROWS * self.lp + self.tokens * self.lp)
        bf += 2 * ROWS * (KBLK + PPAD)
        f32 = self.arows * self.nope
        f32 += self.ds * self.arows * self.kv_lora if self.ds > 1 else 4
        f32 += 2 * WARPS * ROWS + ROWS * max(self.splits, 2) + 8 + 1
        return bf + 4 * f32 + 8 * 16


class MLADecodeTC:
    def __init__(self, plan: MLATCPlan):
        self.p = plan
        if plan.smem_bytes > SMEM_MAX:
            raise ValueError(f"mla_decode_tc: {plan.smem_bytes} bytes of shared memory per CTA")
        if plan.nbuf == 1 and plan.smem_bytes > SMEM_TWO_CTAS:
            raise ValueError(
                f"DECODESCOPE_MLA_TC_NBUF=1: {plan.smem_bytes} bytes of shared memory per CTA, "
                f"two CTAs per SM need <= {SMEM_TWO_CTAS}"
            )
        kbytes = plan.nbuf * KBLK * plan.lp * 2
        if plan.cs * ROWS * plan.v_dim * 4 + ROWS * plan.kv_lora * 4 > kbytes:
            raise ValueError("mla_decode_tc: the W_UV scratch does not fit the key buffers")
        if plan.clustered:
            ar = plan.arows
            need = (ROWS * plan.kv_lora + ar * plan.kv_lora + plan.cs * ar * plan.v_dim) * 4
            if ar > ROWS or need > kbytes or plan.csize > CLUSTER_MAX:
                raise ValueError(
                    f"mla_decode_tc: cluster of {plan.csize} CTAs, {ar} merged rows: does not "
                    "fit (at most 8 CTAs, 16 rows, the key buffers)"
                )

    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,  # [B*T, a_width] bf16
        mQ: cute.Tensor,  # [B*T, heads*(nope+rope)] bf16
        mG: cute.Tensor,  # [B*T, heads*v] bf16
        mKvNorm: cute.Tensor,  # [kv_lora] bf16
        mWuk: cute.Tensor,  # [heads, nope, kv_lora] bf16
        mWuv: cute.Tensor,  # [heads, kv_lora, v] bf16
        mCache: cute.Tensor,  # [B, ctx+T, lat] bf16
        mPart: cute.Tensor,  # [B, groups, splits, 16, kv_lora + 2] f32
        mCnt: cute.Tensor,  # [B, groups] i32, zero between launches
        mOut: cute.Tensor,  # [B*T, heads*v] bf16
        stream: cuda.CUstream,
    ):
        p = self.p
        LP = p.lp

        @cute.struct
        class Smem:
            k: cute.struct.Align[cute.struct.MemRange[BFloat16, p.nbuf * KBLK * LP], 16]
            q: cute.struct.Align[cute.struct.MemRange[BFloat16, ROWS * LP], 16]
            new: cute.struct.Align[cute.struct.MemRange[BFloat16, p.tokens * LP], 16]
            pm: cute.struct.Align[cute.struct.MemRange[BFloat16, ROWS * (KBLK + PPAD)], 16]
            qn: cute.struct.MemRange[Float32, p.arows * p.nope]
            ascr: cute.struct.Align[
                cute.struct.MemRange[
                    Float32, max(4, p.ds * p.arows * p.kv_lora if p.ds > 1 else 4)
                ],
                16,
            ]
            red: cute.struct.MemRange[Float32, 2 * WARPS * ROWS]
            wgt: cute.struct.MemRange[Float32, ROWS * max(p.splits, 2)]
            misc: cute.struct.MemRange[Float32, 8]
            last: cute.struct.MemRange[Int32, 1]

        self.smem_cls = Smem
        # a cluster per pair (x sequences); nbuf 1: two CTAs per SM (<= 128 registers)
        extra = ({"cluster": [1, p.cs_seqs, p.splits]} if p.clustered else {}) | (
            {"min_blocks_per_mp": 2, "preferred_smem_carveout": 100} if p.nbuf == 1 else {}
        )
        self.kernel(mA, mQ, mG, mKvNorm, mWuk, mWuv, mCache, mPart, mCnt, mOut).launch(
            grid=[p.groups, p.batch, p.splits],
            block=[NT, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
            **extra,
        )

    @cute.kernel
    def kernel(self, mA, mQ, mG, mKvNorm, mWuk, mWuv, mCache, mPart, mCnt, mOut):
        p = self.p
        LP, L, KVL, T, R, HG = p.lp, p.lat, p.kv_lora, p.tokens, p.rows, p.hg
        tidx, _, _ = cute.arch.thread_idx()
        gi, b, sp = cute.arch.block_idx()
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        h0 = gi * HG

        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        NB = p.nbuf
        sK = st.k.get_tensor(cute.make_layout((NB, KBLK, LP), stride=(KBLK * LP, LP, 1)))
        sQ = st.q.get_tensor(cute.make_layout((ROWS, LP), stride=(LP, 1)))
        sNew = st.new.get_tensor(cute.make_layout((T, LP), stride=(LP, 1)))
        sP = st.pm.get_tensor(cute.make_layout((ROWS, KBLK + PPAD), stride=(KBLK + PPAD, 1)))
        sQn = st.qn.get_tensor(cute.make_layout((p.arows, p.nope), stride=(p.nope, 1)))
        sAscr = st.ascr.get_tensor(
            cute.make_layout(max(4, p.ds * p.arows * KVL if p.ds > 1 else 4))
        )
        sRed = st.red.get_tensor(cute.make_layout((2, WARPS, ROWS), stride=(WARPS * ROWS, ROWS, 1)))
        sWgt = st.wgt.get_tensor(
            cute.make_layout((ROWS, max(p.splits, 2)), stride=(max(p.splits, 2), 1))
        )
        sMisc = st.misc.get_tensor(cute.make_layout(8))
        sLast = st.last.get_tensor(cute.make_layout(1))
        # after the key loop the key buffers hold o_lat (f32 [16, KVL]) and the W_UV scratch
        sOlat = st.k.get_tensor(cute.make_layout((ROWS, KVL), stride=(KVL, 1)), dtype=Float32)

        if cutlass.const_expr(p.pdl):
            pdl_begin()
        if cutlass.const_expr(p.clustered):  # phase 0: waited for before the first DSMEM store
            cute.arch.cluster_arrive_relaxed()

        k_begin = sp * p.keys_per_split
        k_end = cutlass.min(k_begin + p.keys_per_split, p.nkeys)
        # -- cached keys of the first two blocks (one: nbuf 1) in flight at once -------------
        for blk0 in cutlass.range_constexpr(NB):
            if cutlass.const_expr(blk0 < p.nblk):
                self.issue_block(mCache, sK, b, k_begin + blk0 * KBLK, blk0, tidx)
            cute.arch.cp_async_commit_group()

        # -- 1. the new latent rows (bf16, as the cache stores them) ------------------------
        self.new_rows(mA, mKvNorm, mCache, sNew, sMisc, b, gi, sp, tidx)

        # -- 2. queries: q_nope (f32) for the absorption, q_pe scaled; padding rows zero ------
        scale = Float32(1.0 / math.sqrt(p.nope + p.rope))
        qw = p.nope + p.rope
        if cutlass.const_expr(p.clustered):  # this CTA's heads, every sequence of the cluster
            C = p.cs_seqs
            b0 = b - b % C
            rank = b % C + sp * C
            for i in cutlass.range_constexpr((p.arows * p.nope + NT - 1) // NT):
                idx = tidx + i * NT
                lr = idx // p.nope  # (jl, cq, t)
                j = (lr // (C * T)) * p.csize + rank
                if idx < p.arows * p.nope and j < HG:
                    d = idx % p.nope
                    tok = (b0 + (lr // T) % C) * T + lr % T
                    sQn[lr, d] = mQ[tok, (h0 + j) * qw + d].to(Float32)
        else:
            for i in cutlass.range_constexpr((R * p.nope + NT - 1) // NT):
                idx = tidx + i * NT
                if idx < R * p.nope:
                    r = idx // p.nope
                    d = idx % p.nope
                    sQn[r, d] = mQ[b * T + r % T, (h0 + r // T) * qw + d].to(Float32)
        self.stage_q_pe(mQ, sQ, b, h0, scale, tidx)
        cute.arch.sync_threads()
        if cutlass.const_expr(p.clustered):
            self.absorb_cluster(mWuk, sQn, sQ, sAscr, h0, b, sp, tidx, scale)
        else:
            self.absorb(mWuk, sQn, sQ, sAscr, h0, tidx, scale)
        cute.arch.sync_threads()

        # -- 3. the key blocks ----------------------------------------------------------------
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        NTL = KVL // 8 // WARPS  # PV n-tiles per warp
        oacc = self.make_acc(NTL)
        fa = cute.make_rmem_tensor((8, 1, 1), BFloat16)
        fb = cute.make_rmem_tensor((4, 1, 1), BFloat16)
        m0 = Float32(NEG)
        m1 = Float32(NEG)
        l0 = Float32(0.0)
        l1 = Float32(0.0)
        r0 = g
        r1 = g + 8
        t0 = r0 % T
        t1 = r1 % T
        for blk in cutlass.range(p.nblk):
            buf = blk % NB
            cute.arch.cp_async_wait_group(NB - 1)
            kb = k_begin + blk * KBLK
            self.fill_block(sK, sNew, kb, buf, tidx)
            cute.arch.sync_threads()
            # scores of keys 8w .. 8w + 7
            sacc = cute.make_rmem_tensor((4, 1, 1), Float32)
            sacc.fill(0.0)
            if cutlass.const_expr(p.ldsm):
                self.scores_ldsm(atom, sacc, fa, fb, sQ, sK, buf, warp, lane)
            for kc in cutlass.range_constexpr(0 if p.ldsm else L // 16):
                alo = cute.make_rmem_tensor((4,), BFloat16)
                ahi = cute.make_rmem_tensor((4,), BFloat16)
                bk = cute.make_rmem_tensor((4,), BFloat16)
                cute.autovec_copy(cute.local_tile(sQ[r0, None], (4,), (kc * 4 + c,)), alo)
                cute.autovec_copy(cute.local_tile(sQ[r1, None], (4,), (kc * 4 + c,)), ahi)
                cute.autovec_copy(
                    cute.local_tile(sK[buf, warp * 8 + g, None], (4,), (kc * 4 + c,)), bk
                )
                fa[0] = alo[0]
                fa[1] = alo[1]
                fa[2] = ahi[0]
                fa[3] = ahi[1]
                fa[4] = alo[2]
                fa[5] = alo[3]
                fa[6] = ahi[2]
                fa[7] = ahi[3]
                for e in cutlass.range_constexpr(4):
                    fb[e] = bk[e]
                cute.gemm(atom, sacc, fa, fb, sacc)
            # online softmax; mask: row r (token r % T) sees positions < ctx + t + 1, this
            # split's only
            pv, l0, l1, m0, m1 = self.softmax_step(
                sacc, sRed, oacc, kb, k_end, warp, c, r0, r1, t0, t1, m0, m1, l0, l1
            )
            kl = warp * 8 + 2 * c
            if cutlass.const_expr(p.ldsm):  # one 4-byte store per row
                pp = cute.make_rmem_tensor((2,), BFloat16)
                pp[0] = pv[0].to(BFloat16)
                pp[1] = pv[1].to(BFloat16)
                cute.autovec_copy(pp, cute.local_tile(sP[r0, None], (2,), (kl // 2,)))
                if cutlass.const_expr(R > 8):
                    pp[0] = pv[2].to(BFloat16)
                    pp[1] = pv[3].to(BFloat16)
                    cute.autovec_copy(pp, cute.local_tile(sP[r1, None], (2,), (kl // 2,)))
            else:
                sP[r0, kl] = pv[0].to(BFloat16)
                sP[r0, kl + 1] = pv[1].to(BFloat16)
                sP[r1, kl] = pv[2].to(BFloat16)
                sP[r1, kl + 1] = pv[3].to(BFloat16)
            cute.arch.sync_threads()
            # O += P V, output columns 64w .. 64w + 63
            if cutlass.const_expr(p.ldsm):
                self.pv_ldsm(atom, oacc, fa, fb, sP, sK, buf, warp, lane)
            for kk in cutlass.range_constexpr(0 if p.ldsm else KBLK // 16):
                k0 = kk * 16 + 2 * c
                fa[0] = sP[r0, k0]
                fa[1] = sP[r0, k0 + 1]
                fa[2] = sP[r1, k0]
                fa[3] = sP[r1, k0 + 1]
                fa[4] = sP[r0, k0 + 8]
                fa[5] = sP[r0, k0 + 9]
                fa[6] = sP[r1, k0 + 8]
                fa[7] = sP[r1, k0 + 9]
                for nt in cutlass.range_constexpr(NTL):
                    col = (warp * NTL + nt) * 8 + g
                    fb[0] = sK[buf, k0, col]
                    fb[1] = sK[buf, k0 + 1, col]
                    fb[2] = sK[buf, k0 + 8, col]
                    fb[3] = sK[buf, k0 + 9, col]
                    cute.gemm(atom, oacc[nt], fa, fb, oacc[nt])
            cute.arch.sync_threads()
            if blk + NB < p.nblk:
                self.issue_block(mCache, sK, b, kb + NB * KBLK, buf, tidx)
            cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)

        # -- 4. row sums; normalize (one split) or write the partial and merge --------------
        la0, la1 = self.row_sums(sRed, l0, l1, warp, c, r0, r1)
        if cutlass.const_expr(p.splits == 1):
            for nt in cutlass.range_constexpr(NTL):
                col = (warp * NTL + nt) * 8 + 2 * c
                sOlat[r0, col] = oacc[nt][0] / la0
                sOlat[r0, col + 1] = oacc[nt][1] / la0
                sOlat[r1, col] = oacc[nt][2] / la1
                sOlat[r1, col + 1] = oacc[nt][3] / la1
            cute.arch.sync_threads()
            self.finish(mG, mWuv, mOut, sOlat, sK, b, h0, tidx)
        elif cutlass.const_expr(p.clustered):
            # this split's O (unnormalized), m and l into its own shared memory; the cluster's
            # CTAs merge the rows of their heads from all of them (DSMEM loads), then W_UV
            for nt in cutlass.range_constexpr(NTL):
                col = (warp * NTL + nt) * 8 + 2 * c
                sOlat[r0, col] = oacc[nt][0]
                sOlat[r0, col + 1] = oacc[nt][1]
                sOlat[r1, col] = oacc[nt][2]
                sOlat[r1, col + 1] = oacc[nt][3]
            if warp == 0 and c == 0:  # sRed[0] (the block maxima) is free after the loop
                sRed[0, 0, r0] = m0
                sRed[0, 1, r0] = la0
                sRed[0, 0, r1] = m1
                sRed[0, 1, r1] = la1
            cute.arch.cluster_arrive()  # phase 2: every split's partial is in place
            cute.arch.cluster_wait()
            self.merge_cluster(sOlat, sRed, sWgt, b, sp, tidx)
            cute.arch.cluster_arrive()  # phase 3: this CTA reads no other's memory after this
            cute.arch.sync_threads()
            self.finish_heads(mG, mWuv, mOut, sOlat, b, h0, sp, tidx)
            cute.arch.cluster_wait()  # nobody exits while another still reads its partial
        else:
            for nt in cutlass.range_constexpr(NTL):
                col = (warp * NTL + nt) * 8 + 2 * c
                if r0 < R:
                    mPart[b, gi, sp, r0, col] = oacc[nt][0]
                    mPart[b, gi, sp, r0, col + 1] = oacc[nt][1]
                if r1 < R:
                    mPart[b, gi, sp, r1, col] = oacc[nt][2]
                    mPart[b, gi, sp, r1, col + 1] = oacc[nt][3]
            if warp == 0 and c == 0:
                if r0 < R:
                    mPart[b, gi, sp, r0, KVL] = m0
                    mPart[b, gi, sp, r0, KVL + 1] = la0
                if r1 < R:
                    mPart[b, gi, sp, r1, KVL] = m1
                    mPart[b, gi, sp, r1, KVL + 1] = la1
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            if tidx == 0:
                old = cute.arch.atomic_add(mCnt.iterator + (b * p.groups + gi), Int32(1),
                                           sem="acq_rel", scope="gpu")  # fmt: skip
                sLast[0] = old
            cute.arch.sync_threads()
            if sLast[0] == p.splits - 1:
                cute.arch.fence_acq_rel_gpu()
                self.merge(mPart, sOlat, sWgt, b, gi, tidx)
                cute.arch.sync_threads()
                self.finish(mG, mWuv, mOut, sOlat, sK, b, h0, tidx)
                if tidx == 0:
                    mCnt[b, gi] = Int32(0)

    @cute.jit
    def new_rows(self, mA, mKvNorm, mCache, sNew, sMisc, b, gi, sp, tidx):
        """The sequence's new latent rows into ``sNew`` (RMSNorm over the ``kv_lora`` part,
        bf16 as the cache stores them, a block reduction per token); the CTA of head group 0
        and split 0 (``gi`` / ``sp``) writes them to the cache too."""
        p = self.p
        L, KVL, T = p.lat, p.kv_lora, p.tokens
        for t in cutlass.range(T):
            row = b * T + t
            ss = Float32(0.0)
            for i in cutlass.range_constexpr((KVL + NT - 1) // NT):
                cc = tidx + i * NT
                if cc < KVL:
                    x = mA[row, p.q_lora + cc].to(Float32)
                    ss = ss + x * x
            ss = block_sum(ss, sMisc, WARPS)
            rstd = cute.math.rsqrt(ss / Float32(KVL) + Float32(p.eps))
            for i in cutlass.range_constexpr((L + NT - 1) // NT):
                cc = tidx + i * NT
                if cc < L:
                    val = mA[row, p.q_lora + cc]
                    if cc < KVL:
                        y = (val.to(Float32) * rstd).to(BFloat16).to(Float32)
                        val = (y * mKvNorm[cc].to(Float32)).to(BFloat16)
                    sNew[t, cc] = val
                    if gi == 0 and sp == 0:
                        mCache[b, p.ctx + t, cc] = val

    @cute.jit
    def stage_q_pe(self, mQ, sQ, b, h0, scale, tidx):
        """``q_pe`` of the sequence's rows (heads from ``h0``) times ``scale`` into ``sQ``'s
        last ``rope`` columns, the padding rows (``rows .. 15``) zero: bf16."""
        p = self.p
        KVL, T, R = p.kv_lora, p.tokens, p.rows
        qw = p.nope + p.rope
        for i in cutlass.range_constexpr((ROWS * p.rope + NT - 1) // NT):
            idx = tidx + i * NT
            if idx < ROWS * p.rope:
                r = idx // p.rope
                e = idx % p.rope
                v = Float32(0.0)
                if r < R:
                    v = mQ[b * T + r % T, (h0 + r // T) * qw + p.nope + e].to(Float32) * scale
                sQ[r, KVL + e] = v.to(BFloat16)
        if cutlass.const_expr(R < ROWS):
            for i in cutlass.range_constexpr(((ROWS - R) * KVL + NT - 1) // NT):
                idx = tidx + i * NT
                if idx < (ROWS - R) * KVL:
                    sQ[R + idx // KVL, idx % KVL] = BFloat16(0.0)

    def make_acc(self, ntl: int):
        """``ntl`` zeroed m16n8 FP32 accumulators (trace-time helper)."""
        acc = []
        for _ in range(ntl):
            a = cute.make_rmem_tensor((4, 1, 1), Float32)
            a.fill(0.0)
            acc.append(a)
        return acc

    @cute.jit
    def softmax_step(self, sacc, sRed, oacc, kb, k_end, warp, c, r0, r1, t0, t1, m0, m1, l0, l1):
        """One key block's online softmax (this kernel's key loop and :mod:`.mla_decode_split`'s):
        the scores ``sacc`` of keys ``kb + 8w ..`` masked (rows ``>= rows``, keys ``>= k_end``
        or after the row's token), the block's row maxima through ``sRed[0]`` (a barrier), the
        probabilities, the running sums and maxima updated, ``oacc`` rescaled. Returns
        ``(p, l0, l1, m0, m1)``, ``p`` the thread's 4 probabilities (FP32)."""
        p = self.p
        R = p.rows
        NTL = p.kv_lora // 8 // WARPS
        kp = kb + warp * 8 + 2 * c
        sv = cute.make_rmem_tensor((4,), Float32)
        for e in cutlass.range_constexpr(4):
            rr = r0 if e < 2 else r1
            tt = t0 if e < 2 else t1
            pos = kp + e % 2
            sv[e] = Float32(NEG)
            if rr < R and pos < k_end and pos < p.ctx + tt + 1:
                sv[e] = sacc[e]
        mx0 = cute.arch.fmax(sv[0], sv[1])
        mx1 = cute.arch.fmax(sv[2], sv[3])
        for off in cutlass.range_constexpr(1, 3):
            mx0 = cute.arch.fmax(mx0, cute.arch.shuffle_sync_bfly(mx0, offset=off))
            mx1 = cute.arch.fmax(mx1, cute.arch.shuffle_sync_bfly(mx1, offset=off))
        if c == 0:
            sRed[0, warp, r0] = mx0
            sRed[0, warp, r1] = mx1
        cute.arch.sync_threads()
        bm0 = sRed[0, 0, r0]
        bm1 = sRed[0, 0, r1]
        for w in cutlass.range_constexpr(1, WARPS):
            bm0 = cute.arch.fmax(bm0, sRed[0, w, r0])
            bm1 = cute.arch.fmax(bm1, sRed[0, w, r1])
        mn0 = cute.arch.fmax(m0, bm0)
        mn1 = cute.arch.fmax(m1, bm1)
        corr0 = cute.math.exp(m0 - mn0, fastmath=True)
        corr1 = cute.math.exp(m1 - mn1, fastmath=True)
        pv = cute.make_rmem_tensor((4,), Float32)
        for e in cutlass.range_constexpr(4):
            mn = mn0 if e < 2 else mn1
            pv[e] = Float32(0.0)
            if sv[e] > Float32(NEG):
                pv[e] = cute.math.exp(sv[e] - mn, fastmath=True)
        l0 = l0 * corr0 + pv[0] + pv[1]
        l1 = l1 * corr1 + pv[2] + pv[3]
        m0 = mn0
        m1 = mn1
        for nt in cutlass.range_constexpr(NTL):
            oacc[nt][0] = oacc[nt][0] * corr0
            oacc[nt][1] = oacc[nt][1] * corr0
            oacc[nt][2] = oacc[nt][2] * corr1
            oacc[nt][3] = oacc[nt][3] * corr1
        return pv, l0, l1, m0, m1

    @cute.jit
    def row_sums(self, sRed, l0, l1, warp, c, r0, r1):
        """After the key loop: the full sums of rows ``r0`` / ``r1`` from every thread's running
        sums (quad shuffles, then the warps through ``sRed[1]``, a barrier)."""
        for off in cutlass.range_constexpr(1, 3):
            l0 = l0 + cute.arch.shuffle_sync_bfly(l0, offset=off)
            l1 = l1 + cute.arch.shuffle_sync_bfly(l1, offset=off)
        if c == 0:
            sRed[1, warp, r0] = l0
            sRed[1, warp, r1] = l1
        cute.arch.sync_threads()
        la0 = Float32(0.0)
        la1 = Float32(0.0)
        for w in cutlass.range_constexpr(WARPS):
            la0 = la0 + sRed[1, w, r0]
            la1 = la1 + sRed[1, w, r1]
        return la0, la1

    @cute.jit
    def scores_ldsm(self, atom, sacc, fa, fb, sQ, sK, buf, warp, lane):
        """``sacc += Q K^T`` for keys ``8w .. 8w + 7`` of buffer ``buf``, fragments by
        ``ldmatrix``: K (B operand) two k-steps per ``x4`` (stored [key][latent] = the B
        operand's column-major form), Q (A operand) one ``x4`` per k-step, or an ``x2`` of rows
        0-7 when the CTA has at most 8 rows (rows 8-15 are the zero padding). Even and odd
        k-steps accumulate apart (two MMA chains of 18 instead of one of 36), summed at the end."""
        p = self.p
        LP, R = p.lp, p.rows
        mi = lane // 8
        ri = lane % 8
        ks = p.lat // 16
        sacc2 = cute.make_rmem_tensor((4, 1, 1), Float32)
        sacc2.fill(0.0)
        fa32 = cute.recast_tensor(fa, Int32)
        fb32 = cute.recast_tensor(fb, Int32)
        # lane addresses: K rows 8w + ri, latent column (k-step of the pair mi // 2) + (mi % 2) * 8
        k_base = sK.iterator + (buf * KBLK + warp * 8 + ri) * LP + (mi // 2) * 16 + (mi % 2) * 8
        if cutlass.const_expr(R <= 8):  # x2: lanes 0-15, matrices (rows 0-7, k +0 / +8)
            q_base = sQ.iterator + ri * LP + (mi % 2) * 8
        else:  # x4: matrices (rows 0-7 | 8-15) x (k +0 | +8)
            q_base = sQ.iterator + ((mi % 2) * 8 + ri) * LP + (mi // 2) * 8
        for kc2 in cutlass.range_constexpr((ks + 1) // 2):
            if cutlass.const_expr(2 * kc2 + 1 < ks):
                kb = ldsm_x4(k_base + kc2 * 32, False)
            else:  # an odd last k-step: matrices 0 and 1 only (lanes 0-15's addresses)
                b0, b1 = ldsm_x2(k_base + kc2 * 32, False)
                kb = (b0, b1, b0, b1)
            for h in cutlass.range_constexpr(2):
                kc = 2 * kc2 + h
                if cutlass.const_expr(kc < ks):
                    if cutlass.const_expr(R <= 8):
                        a0, a2 = ldsm_x2(q_base + kc * 16, False)
                        fa32[0] = a0
                        fa32[1] = Int32(0)
                        fa32[2] = a2
                        fa32[3] = Int32(0)
                    else:
                        aa = ldsm_x4(q_base + kc * 16, False)
                        for e in cutlass.range_constexpr(4):
                            fa32[e] = aa[e]
                    fb32[0] = kb[2 * h]
                    fb32[1] = kb[2 * h + 1]
                    acc = sacc if h == 0 else sacc2
                    cute.gemm(atom, acc, fa, fb, acc)
        for e in cutlass.range_constexpr(4):
            sacc[e] = sacc[e] + sacc2[e]

    @cute.jit
    def pv_ldsm(self, atom, oacc, fa, fb, sP, sK, buf, warp, lane):
        """``O += P V`` for output columns ``64w .. 64w + 63`` (n-tiles of 8), fragments by
        ``ldmatrix``: P (A operand) one ``x4`` (``x2`` at most 8 rows) per 16 keys, V (B
        operand, stored [key][latent]: the transpose of the column-major B) by ``x4.trans``,
        two n-tiles per instruction."""
        p = self.p
        LP, R = p.lp, p.rows
        NTL = p.kv_lora // 8 // WARPS
        PW = KBLK + PPAD
        mi = lane // 8
        ri = lane % 8
        fa32 = cute.recast_tensor(fa, Int32)
        fb32 = cute.recast_tensor(fb, Int32)
        if cutlass.const_expr(R <= 8):
            p_base = sP.iterator + ri * PW + (mi % 2) * 8
        else:
            p_base = sP.iterator + ((mi % 2) * 8 + ri) * PW + (mi // 2) * 8
        # V: matrices (keys +0 | +8) x (n-tile j | j + 1)
        v_base = (
            sK.iterator + (buf * KBLK + (mi % 2) * 8 + ri) * LP + warp * NTL * 8 + (mi // 2) * 8
        )
        for kk in cutlass.range_constexpr(KBLK // 16):
            if cutlass.const_expr(R <= 8):
                a0, a2 = ldsm_x2(p_base + kk * 16, False)
                fa32[0] = a0
                fa32[1] = Int32(0)
                fa32[2] = a2
                fa32[3] = Int32(0)
            else:
                aa = ldsm_x4(p_base + kk * 16, False)
                for e in cutlass.range_constexpr(4):
                    fa32[e] = aa[e]
            self.mma_b_trans(atom, oacc, fa, fb, fb32, v_base + kk * 16 * LP, NTL)

    @cute.jit
    def mma_b_trans(self, atom, acc, fa, fb, fb32, b_row, ntl: int):
        """``acc[nt] += A B`` for ``ntl`` n-tiles of 8 with the A fragment in ``fa``: the B
        fragments of one k-step by ``ldmatrix .trans`` from shared memory stored [k][n] (row
        pointer ``b_row`` of this lane: k row, n-tile pair), two n-tiles per ``x4`` (an ``x2``
        for an odd last one). ``fb32``: ``fb`` as Int32."""
        for j2 in cutlass.range_constexpr((ntl + 1) // 2):
            bptr = b_row + j2 * 16
            if cutlass.const_expr(2 * j2 + 1 < ntl):
                vb = ldsm_x4(bptr, True)
            else:
                b0, b1 = ldsm_x2(bptr, True)
                vb = (b0, b1, b0, b1)
            for h in cutlass.range_constexpr(2):
                nt = 2 * j2 + h
                if cutlass.const_expr(nt < ntl):
                    fb32[0] = vb[2 * h]
                    fb32[1] = vb[2 * h + 1]
                    cute.gemm(atom, acc[nt], fa, fb, acc[nt])

    @cute.jit
    def issue_block(self, mCache, sK, b, kb, buf, tidx):
        """cp.async of the cached positions (< ctx) of block ``kb .. kb + 63`` into ``buf``."""
        p = self.p
        nv = p.lat // 8
        for i in cutlass.range_constexpr((KBLK * nv + NT - 1) // NT):
            idx = tidx + i * NT
            kk = idx // nv
            v = idx % nv
            pos = kb + kk
            if idx < KBLK * nv and pos < p.ctx:
                src = cute.local_tile(mCache[b, pos, None], (8,), (v,))
                dst = cute.local_tile(sK[buf, kk, None], (8,), (v,))
                cute.arch.inline_ptx(
                    "cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
                    read_only_args=[dst.iterator, src.iterator],
                )

    @cute.jit
    def fill_block(self, sK, sNew, kb, buf, tidx):
        """The positions >= ctx of the block: the new rows from shared memory, zeros past them
        (a NaN left in an unused slot would reach O through 0 * NaN)."""
        p = self.p
        nv = p.lat // 8
        if kb + KBLK > p.ctx:
            for i in cutlass.range_constexpr((KBLK * nv + NT - 1) // NT):
                idx = tidx + i * NT
                kk = idx // nv
                v = idx % nv
                pos = kb + kk
                if idx < KBLK * nv and pos >= p.ctx:
                    x = cute.make_rmem_tensor((8,), BFloat16)
                    x.fill(0.0)
                    if pos < p.nkeys:
                        cute.autovec_copy(cute.local_tile(sNew[pos - p.ctx, None], (8,), (v,)), x)
                    cute.autovec_copy(x, cute.local_tile(sK[buf, kk, None], (8,), (v,)))

    @cute.jit
    def absorb(self, mWuk, sQn, sQ, sAscr, h0, tidx, scale):
        """``sQ[r, :kv_lora] = bf16(scale * q_nope[r] @ w_uk[h_r])``. Unit = (head j, nope
        slice, 8 latent columns); a unit loads each ``w_uk`` row piece once for all T tokens."""
        p = self.p
        T, KVL = p.tokens, p.kv_lora
        ncg = KVL // 8
        DS = p.ds
        per = 0 if p.diag else p.nope // DS  # diag: no w_uk reads (q_lat = 0)
        units = p.hg * DS * ncg
        for i in cutlass.range_constexpr((units + NT - 1) // NT):
            u = tidx + i * NT
            if u < units:
                cg = u % ncg
                ds = (u // ncg) % DS
                j = u // (ncg * DS)
                acc = cute.make_rmem_tensor(cute.make_layout((T, 8), stride=(8, 1)), Float32)
                acc.fill(0.0)
                if cutlass.const_expr(p.unroll_force):  # all U loads first, then the FMAs
                    U = min(p.unroll, per)
                    for d0 in cutlass.range(per // U, unroll=1):
                        wvs = self.load_rows8(mWuk, h0 + j, ds * per + d0 * U, U, cg)
                        for uu in cutlass.range_constexpr(U):
                            d = ds * per + d0 * U + uu
                            for t in cutlass.range_constexpr(T):
                                qv = sQn[j * T + t, d]
                                for e in cutlass.range_constexpr(8):
                                    acc[t, e] = acc[t, e] + qv * wvs[uu][e].to(Float32)
                for dd in cutlass.range(0 if p.unroll_force else per, unroll=p.unroll):
                    d = ds * per + dd
                    wv = cute.make_rmem_tensor((8,), BFloat16)
                    load_vec8(mWuk[h0 + j, d, None], cg * 8, wv)
                    for t in cutlass.range_constexpr(T):
                        qv = sQn[j * T + t, d]
                        for e in cutlass.range_constexpr(8):
                            acc[t, e] = acc[t, e] + qv * wv[e].to(Float32)
                for t in cutlass.range_constexpr(T):
                    r = j * T + t
                    for e in cutlass.range_constexpr(8):
                        if cutlass.const_expr(DS == 1):
                            sQ[r, cg * 8 + e] = (acc[t, e] * scale).to(BFloat16)
                        else:
                            sAscr[(ds * p.rows + r) * KVL + cg * 8 + e] = acc[t, e]
        if cutlass.const_expr(DS > 1):
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr((p.rows * KVL + NT - 1) // NT):
                idx = tidx + i * NT
                if idx < p.rows * KVL:
                    tot = Float32(0.0)
                    for s in cutlass.range_constexpr(DS):
                        tot = tot + sAscr[s * p.rows * KVL + idx]
                    sQ[idx // KVL, idx % KVL] = (tot * scale).to(BFloat16)

    def load_rows8(self, mW, h, row0, n: int, cg):
        """``n`` new register tiles ``mW[h, row0 + i, 8 cg : 8 cg + 8]`` (16-byte loads, all
        issued before any is used). Trace-time helper: inlines into the caller."""
        ws = []
        for i in range(n):
            wv = cute.make_rmem_tensor((8,), BFloat16)
            load_vec8(mW[h, row0 + i, None], cg * 8, wv)
            ws.append(wv)
        return ws

    @cute.jit
    def absorb_cluster(self, mWuk, sQn, sQ, sAscr, h0, b, sp, tidx, scale):
        """:meth:`absorb` for the heads ``j = jl * csize + rank`` of this CTA only, for every
        sequence of the cluster (one ``w_uk`` load serves them all); each 16-byte piece of
        ``q_lat`` goes to the ``sQ`` of the sequence's CTAs (all its splits; DSMEM stores, this
        CTA's own included). Ends with the cluster barrier that publishes them."""
        p = self.p
        T, KVL, HG, C = p.tokens, p.kv_lora, p.hg, p.cs_seqs
        ncg = KVL // 8
        DS = p.ds
        AR = p.arows
        per = 0 if p.diag else p.nope // DS
        units = p.hs * DS * ncg
        rank = b % C + sp * C
        cute.arch.cluster_wait()  # phase 0: every CTA of the cluster runs (its smem exists)
        for i in cutlass.range_constexpr((units + NT - 1) // NT):
            u = tidx + i * NT
            jl = u // (ncg * DS)
            j = jl * p.csize + rank
            if u < units and j < HG:
                cg = u % ncg
                ds = (u // ncg) % DS
                acc = cute.make_rmem_tensor(cute.make_layout((C * T, 8), stride=(8, 1)), Float32)
                acc.fill(0.0)
                if cutlass.const_expr(p.unroll_force):  # all U loads first, then the FMAs
                    U = min(p.unroll, per)
                    for d0 in cutlass.range(per // U, unroll=1):
                        wvs = self.load_rows8(mWuk, h0 + j, ds * per + d0 * U, U, cg)
                        for uu in cutlass.range_constexpr(U):
                            d = ds * per + d0 * U + uu
                            for k in cutlass.range_constexpr(C * T):
                                qv = sQn[jl * C * T + k, d]
                                for e in cutlass.range_constexpr(8):
                                    acc[k, e] = acc[k, e] + qv * wvs[uu][e].to(Float32)
                for dd in cutlass.range(0 if p.unroll_force else per, unroll=p.unroll):
                    d = ds * per + dd
                    wv = cute.make_rmem_tensor((8,), BFloat16)
                    load_vec8(mWuk[h0 + j, d, None], cg * 8, wv)
                    for cq in cutlass.range_constexpr(C):
                        for t in cutlass.range_constexpr(T):
                            qv = sQn[(jl * C + cq) * T + t, d]
                            for e in cutlass.range_constexpr(8):
                                acc[cq * T + t, e] = acc[cq * T + t, e] + qv * wv[e].to(Float32)
                for cq in cutlass.range_constexpr(C):
                    for t in cutlass.range_constexpr(T):
                        if cutlass.const_expr(DS == 1):
                            v = cute.make_rmem_tensor((8,), BFloat16)
                            for e in cutlass.range_constexpr(8):
                                v[e] = (acc[cq * T + t, e] * scale).to(BFloat16)
                            self.put_q(sQ, j * T + t, cg, v, cq)
                        else:
                            lr = (jl * C + cq) * T + t
                            for e in cutlass.range_constexpr(8):
                                sAscr[(ds * AR + lr) * KVL + cg * 8 + e] = acc[cq * T + t, e]
        if cutlass.const_expr(DS > 1):
            cute.arch.sync_threads()
            n8 = AR * ncg
            for i in cutlass.range_constexpr((n8 + NT - 1) // NT):
                idx = tidx + i * NT
                cg = idx % ncg
                lr = idx // ncg  # (jl, cq, t)
                j = (lr // (C * T)) * p.csize + rank
                if idx < n8 and j < HG:
                    v = cute.make_rmem_tensor((8,), BFloat16)
                    for e in cutlass.range_constexpr(8):
                        tot = Float32(0.0)
                        for s in cutlass.range_constexpr(DS):
                            tot = tot + sAscr[(s * AR + lr) * KVL + cg * 8 + e]
                        v[e] = (tot * scale).to(BFloat16)
                    self.put_q(sQ, j * T + lr % T, cg, v, (lr // T) % C)
        cute.arch.cluster_arrive()  # phase 1: q_lat complete in every CTA's sQ
        cute.arch.cluster_wait()

    @cute.jit
    def put_q(self, sQ, r, cg, v, cq):
        """``sQ[r, 8 cg : 8 cg + 8] = v`` (8 BF16) in every CTA of the cluster's sequence
        ``cq`` (cluster ranks ``cq + split * cs_seqs``)."""
        p = self.p
        v32 = cute.recast_tensor(v, Int32)
        ptr = cute.local_tile(sQ[r, None], (8,), (cg,)).iterator
        for q in cutlass.range_constexpr(p.splits):
            st_cluster_v4(mapa(ptr, cq + q * p.cs_seqs), v32[0], v32[1], v32[2], v32[3])

    @cute.jit
    def merge_cluster(self, sOlat, sRed, sWgt, b, sp, tidx):
        """Rows of this CTA's heads, for every sequence ``cq`` of the cluster (local row
        ``lr = (jl * cs_seqs + cq) * T + t``): ``o_lat = sum_q O_q exp(m_q - m) / sum_q l_q
        exp(m_q - m)`` over the sequence's splits ``q`` (their ``sOlat`` / ``sRed[0]`` by DSMEM),
        into ``sOm[lr]`` (the key buffers after this CTA's own partial, which others read)."""
        p = self.p
        S, T, KVL, HG, C = p.splits, p.tokens, p.kv_lora, p.hg, p.cs_seqs
        AR = p.arows
        rank = b % C + sp * C
        sOm = cute.make_tensor(
            sOlat.iterator + ROWS * KVL, cute.make_layout((AR, KVL), stride=(KVL, 1))
        )
        j = (tidx // (C * T)) * p.csize + rank
        if tidx < AR and j < HG:
            cq = (tidx // T) % C
            r = j * T + tidx % T
            mq = []
            lq = []
            for q in cutlass.range_constexpr(S):
                mq.append(ld_cluster_f32(mapa(sRed.iterator + r, cq + q * C)))
                lq.append(ld_cluster_f32(mapa(sRed.iterator + ROWS + r, cq + q * C)))
            mall = mq[0]
            for q in cutlass.range_constexpr(1, S):
                mall = cute.arch.fmax(mall, mq[q])
            lall = Float32(0.0)
            for q in cutlass.range_constexpr(S):
                w = cute.math.exp(mq[q] - mall, fastmath=True)
                sWgt[tidx, q] = w
                lall = lall + lq[q] * w
            for q in cutlass.range_constexpr(S):
                sWgt[tidx, q] = sWgt[tidx, q] / lall
        cute.arch.sync_threads()
        n4 = AR * (KVL // 4)
        for i in cutlass.range_constexpr((n4 + NT - 1) // NT):
            idx = tidx + i * NT
            c4 = idx % (KVL // 4)
            lr = idx // (KVL // 4)
            j = (lr // (C * T)) * p.csize + rank
            if idx < n4 and j < HG:
                cq = (lr // T) % C
                r = j * T + lr % T
                src = cute.local_tile(sOlat[r, None], (4,), (c4,))
                acc = cute.make_rmem_tensor((4,), Float32)
                acc.fill(0.0)
                for q in cutlass.range_constexpr(S):
                    v = ld_cluster_v4f32(mapa(src.iterator, cq + q * C))
                    w = sWgt[lr, q]
                    for e in cutlass.range_constexpr(4):
                        acc[e] = acc[e] + v[e] * w
                cute.autovec_copy(acc, cute.local_tile(sOm[lr, None], (4,), (c4,)))

    @cute.jit
    def merge(self, mPart, sOlat, sWgt, b, gi, tidx):
        """The last split's CTA: ``o_lat[r] = sum_s O_s[r] exp(m_s - m) / sum_s l_s exp(m_s - m)``."""
        p = self.p
        S, R, KVL = p.splits, p.rows, p.kv_lora
        if tidx < R:
            mall = Float32(NEG)
            for s in cutlass.range(S):
                mall = cute.arch.fmax(mall, mPart[b, gi, s, tidx, KVL])
            lall = Float32(0.0)
            for s in cutlass.range(S):
                w = cute.math.exp(mPart[b, gi, s, tidx, KVL] - mall, fastmath=True)
                sWgt[tidx, s] = w
                lall = lall + mPart[b, gi, s, tidx, KVL + 1] * w
            for s in cutlass.range(S):
                sWgt[tidx, s] = sWgt[tidx, s] / lall
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr((R * KVL + NT - 1) // NT):
            idx = tidx + i * NT
            if idx < R * KVL:
                r = idx // KVL
                cc = idx % KVL
                acc = Float32(0.0)
                for s in cutlass.range(S):
                    acc = acc + mPart[b, gi, s, r, cc] * sWgt[r, s]
                sOlat[r, cc] = acc

    @cute.jit
    def finish(self, mG, mWuv, mOut, sOlat, sK, b, h0, tidx):
        """``out[b*T + t, h*v + :] = (o_lat[r] @ w_uv[h]) * sigmoid(g)``. Unit = (head j, latent
        slice, 8 output columns); partial sums reduced through the (free) key buffers."""
        p = self.p
        T, KVL, V, R = p.tokens, p.kv_lora, p.v_dim, p.rows
        nvg = V // 8
        CS = p.cs
        per = 0 if p.diag else KVL // CS  # diag: no w_uv reads (out = 0)
        units = p.hg * CS * nvg
        sScr = cute.make_tensor(
            cute.recast_ptr(sK.iterator, dtype=Float32) + ROWS * KVL,
            cute.make_layout((CS, ROWS, V), stride=(ROWS * V, V, 1)),
        )
        for i in cutlass.range_constexpr((units + NT - 1) // NT):
            u = tidx + i * NT
            if u < units:
                vg = u % nvg
                cs = (u // nvg) % CS
                j = u // (nvg * CS)
                acc = cute.make_rmem_tensor(cute.make_layout((T, 8), stride=(8, 1)), Float32)
                acc.fill(0.0)
                if cutlass.const_expr(p.unroll_force):  # all U loads first, then the FMAs
                    U = min(p.unroll, per)
                    for c0 in cutlass.range(per // U, unroll=1):
                        wvs = self.load_rows8(mWuv, h0 + j, cs * per + c0 * U, U, vg)
                        for uu in cutlass.range_constexpr(U):
                            ci = cs * per + c0 * U + uu
                            for t in cutlass.range_constexpr(T):
                                ov = sOlat[j * T + t, ci]
                                for e in cutlass.range_constexpr(8):
                                    acc[t, e] = acc[t, e] + ov * wvs[uu][e].to(Float32)
                for cc in cutlass.range(0 if p.unroll_force else per, unroll=p.unroll):
                    ci = cs * per + cc
                    wv = cute.make_rmem_tensor((8,), BFloat16)
                    load_vec8(mWuv[h0 + j, ci, None], vg * 8, wv)
                    for t in cutlass.range_constexpr(T):
                        ov = sOlat[j * T + t, ci]
                        for e in cutlass.range_constexpr(8):
                            acc[t, e] = acc[t, e] + ov * wv[e].to(Float32)
                for t in cutlass.range_constexpr(T):
                    for e in cutlass.range_constexpr(8):
                        sScr[cs, j * T + t, vg * 8 + e] = acc[t, e]
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr((R * V + NT - 1) // NT):
            idx = tidx + i * NT
            if idx < R * V:
                r = idx // V
                v = idx % V
                tot = Float32(0.0)
                for s in cutlass.range_constexpr(CS):
                    tot = tot + sScr[s, r, v]
                row = b * T + r % T
                col = (h0 + r // T) * V + v
                mOut[row, col] = (tot * sigmoid(mG[row, col].to(Float32))).to(BFloat16)

    @cute.jit
    def finish_heads(self, mG, mWuv, mOut, sOlat, b, h0, sp, tidx):
        """:meth:`finish` for this CTA's heads ``j = jl * csize + rank`` and every sequence of
        the cluster, from the merged rows ``sOm`` (:meth:`merge_cluster`): one ``w_uv`` load
        serves all of them; partial sums through the key buffers after ``sOm``."""
        p = self.p
        T, KVL, V, HG, C = p.tokens, p.kv_lora, p.v_dim, p.hg, p.cs_seqs
        AR = p.arows
        nvg = V // 8
        CS = p.cs
        per = 0 if p.diag else KVL // CS
        units = p.hs * CS * nvg
        rank = b % C + sp * C
        b0 = b - b % C
        sOm = cute.make_tensor(
            sOlat.iterator + ROWS * KVL, cute.make_layout((AR, KVL), stride=(KVL, 1))
        )
        sScr = cute.make_tensor(
            sOlat.iterator + ROWS * KVL + AR * KVL,
            cute.make_layout((CS, AR, V), stride=(AR * V, V, 1)),
        )
        for i in cutlass.range_constexpr((units + NT - 1) // NT):
            u = tidx + i * NT
            jl = u // (nvg * CS)
            j = jl * p.csize + rank
            if u < units and j < HG:
                vg = u % nvg
                cs = (u // nvg) % CS
                acc = cute.make_rmem_tensor(cute.make_layout((C * T, 8), stride=(8, 1)), Float32)
                acc.fill(0.0)
                if cutlass.const_expr(p.unroll_force):  # all U loads first, then the FMAs
                    U = min(p.unroll, per)
                    for c0 in cutlass.range(per // U, unroll=1):
                        wvs = self.load_rows8(mWuv, h0 + j, cs * per + c0 * U, U, vg)
                        for uu in cutlass.range_constexpr(U):
                            ci = cs * per + c0 * U + uu
                            for k in cutlass.range_constexpr(C * T):
                                ov = sOm[jl * C * T + k, ci]
                                for e in cutlass.range_constexpr(8):
                                    acc[k, e] = acc[k, e] + ov * wvs[uu][e].to(Float32)
                for cc in cutlass.range(0 if p.unroll_force else per, unroll=p.unroll):
                    ci = cs * per + cc
                    wv = cute.make_rmem_tensor((8,), BFloat16)
                    load_vec8(mWuv[h0 + j, ci, None], vg * 8, wv)
                    for k in cutlass.range_constexpr(C * T):
                        ov = sOm[jl * C * T + k, ci]
                        for e in cutlass.range_constexpr(8):
                            acc[k, e] = acc[k, e] + ov * wv[e].to(Float32)
                for k in cutlass.range_constexpr(C * T):
                    for e in cutlass.range_constexpr(8):
                        sScr[cs, jl * C * T + k, vg * 8 + e] = acc[k, e]
        cute.arch.sync_threads()
        n = AR * V
        for i in cutlass.range_constexpr((n + NT - 1) // NT):
            idx = tidx + i * NT
            v = idx % V
            lr = idx // V
            j = (lr // (C * T)) * p.csize + rank
            if idx < n and j < HG:
                tot = Float32(0.0)
                for s in cutlass.range_constexpr(CS):
                    tot = tot + sScr[s, lr, v]
                row = (b0 + (lr // T) % C) * T + lr % T
                col = (h0 + j) * V + v
                mOut[row, col] = (tot * sigmoid(mG[row, col].to(Float32))).to(BFloat16)


def mapa(ptr, rank) -> Int32:
    """The shared::cluster address of ``ptr`` (this CTA's shared memory) in CTA ``rank`` of the
    cluster."""
    return cute.arch.inline_ptx(
        "mapa.shared::cluster.u32 {$w0}, {$r0}, {$r1};",
        write_only_types=[Int32],
        read_only_args=[ptr, Int32(rank)],
    )


def st_cluster_v4(addr, v0, v1, v2, v3) -> None:
    """16-byte store to a shared::cluster address (another CTA's shared memory)."""
    cute.arch.inline_ptx(
        "st.shared::cluster.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
        read_only_args=[addr, v0, v1, v2, v3],
    )


def ld_cluster_f32(addr) -> Float32:
    return cute.arch.inline_ptx(
        "ld.shared::cluster.f32 {$w0}, [{$r0}];",
        write_only_types=[Float32],
        read_only_args=[addr],
    )


def ld_cluster_v4f32(addr):
    return cute.arch.inline_ptx(
        "ld.shared::cluster.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Float32, Float32, Float32, Float32],
        read_only_args=[addr],
    )


def ldsm_x4(ptr, trans: bool):
    """``ldmatrix .x4`` (``.trans``): four 8x8 BF16 matrices, row addresses from lanes 0-7,
    8-15, 16-23, 24-31; lane (g, c) gets elements (g, 2c..2c+1) of each (transposed: (2c..2c+1,
    g)) as one 32-bit register per matrix."""
    t = ".trans" if trans else ""
    return cute.arch.inline_ptx(
        f"ldmatrix.sync.aligned.m8n8.x4{t}.shared.b16 {{{{$w0}}, {{$w1}}, {{$w2}}, {{$w3}}}}, "
        "[{$r0}];",
        write_only_types=[Int32, Int32, Int32, Int32],
        read_only_args=[ptr],
    )


def ldsm_x2(ptr, trans: bool):
    """``ldmatrix .x2``: two matrices, row addresses from lanes 0-15."""
    t = ".trans" if trans else ""
    return cute.arch.inline_ptx(
        f"ldmatrix.sync.aligned.m8n8.x2{t}.shared.b16 {{{{$w0}}, {{$w1}}}}, [{{$r0}}];",
        write_only_types=[Int32, Int32],
        read_only_args=[ptr],
    )


# -- torch-facing --------------------------------------------------------------------------


def plan_for(cfg, batch: int, tokens: int, heads_per_cta: int = 0, splits: int = 0) -> MLATCPlan:
    m = cfg.mla
    return MLATCPlan(
        batch=batch,
        tokens=tokens,
        heads=cfg.mla_heads,
        q_lora=m.q_lora_rank,
        kv_lora=m.kv_lora_rank,
        nope=m.qk_nope_head_dim,
        rope=m.qk_rope_head_dim,
        v_dim=m.v_head_dim,
        ctx=cfg.context_len,
        eps=cfg.eps,
        heads_per_cta=heads_per_cta,
        splits_force=splits or env_int("DECODESCOPE_MLA_TC_SPLITS", 0),
    )


def _fake_args(p: MLATCPlan):
    bf = torch.bfloat16
    M = p.batch * p.tokens
    return (
        itf.fake(bf, (M, p.a_width), align=4),
        itf.fake(bf, (M, p.heads * (p.nope + p.rope)), align=4),
        itf.fake(bf, (M, p.heads * p.v_dim), align=4),
        itf.fake(bf, (p.kv_lora,), align=4),
        itf.fake(bf, (p.heads, p.nope, p.kv_lora)),
        itf.fake(bf, (p.heads, p.kv_lora, p.v_dim)),
        itf.fake(bf, (p.batch, p.ctx + p.tokens, p.lat)),
        itf.fake(torch.float32, (p.batch, p.groups, p.splits, ROWS, p.kv_lora + 2), align=4),
        itf.fake(torch.int32, (p.batch, p.groups), align=4),
        itf.fake(bf, (M, p.heads * p.v_dim), align=4),
        itf.env_stream(),
    )


def compile_plan(p: MLATCPlan):
    # the key's name is the op's ("mla_decode"); the plan type tells the two kernels apart
    return itf.compiled(("mla_decode", p), lambda: (MLADecodeTC(p), _fake_args(p)))


_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(p: MLATCPlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (p, str(device))
    ws = _WS.get(key)
    if ws is None:
        part = torch.empty(p.batch, p.groups, p.splits, ROWS, p.kv_lora + 2,
                           dtype=torch.float32, device=device)  # fmt: skip
        cnt = torch.zeros(p.batch, p.groups, dtype=torch.int32, device=device)
        ws = _WS[key] = (part, cnt)
    return ws


def mla_decode_tc(
    cfg, w: dict, a, q, g, kv_cache, out, tokens: int, heads_per_cta: int = 0, splits: int = 0
) -> None:
    """One launch; writes ``out [B*T, heads*v]`` and the T new cache rows (BF16 cache).
    ``heads_per_cta`` / ``splits`` override the plan's choice (0: by batch)."""
    if kv_cache.dtype != torch.bfloat16:
        raise NotImplementedError(f"mla_decode_tc: BF16 latent cache only, got {kv_cache.dtype}")
    plan = plan_for(cfg, a.shape[0] // tokens, tokens, heads_per_cta, splits)
    fn = compile_plan(plan)
    part, cnt = _workspace(plan, a.device)
    fn(a, q, g, w["kv_a_norm"], w["w_uk"], w["w_uv"], kv_cache, part, cnt, out)
