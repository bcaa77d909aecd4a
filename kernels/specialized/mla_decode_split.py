"""Gated-MLA absorbed decode for 1-64 sequences in one launch of three phases: the absorption
once per head, the keys split across many CTAs with all heads as the MMA rows, and the split
merge + W_UV + gate per (head, rows). The default for a BF16 cache with one token per sequence
where the plan fits (:func:`.mla_decode.kernel_choice`; ``DECODESCOPE_MLA_KERNEL=split`` forces
it). H200 s10/r2 (TP8, kernel alone, us; notes/gpu-logs/s10/r2/a): 1x1 13.5 (SIMT 19.5, TC
17.5, standard kernels 23.0), 8x1 19.4 (SIMT 61.6, best TC 29.2, standard 27.7), 32x1 31.3 (TC
60.0, standard 41.0), 64x1 48.0 (TC 61.5, standard 57.8).

Same contract as :mod:`.mla_decode` / :mod:`.mla_decode_tc` (one launch: the new cache rows, the
absorbed decode, ``out = (o_lat @ w_uv) * sigmoid(g)``); BF16 latent cache only. The MMA rows
of an attention item are (head, token) pairs, at most 16: all heads at one token (kimi-k3 TP8 /
TP16); with several tokens per sequence (the verify step) the heads split into groups of
``hg`` (``hg x tokens <= 16``, TP8 1+7 tokens: 6 groups of 2), each group its own attention
items and partials, which the W_UV phase merges per head (session 14; the verify step's default
at TP8 / TP16 since session 15: H200 kernel alone, TP8 1x8 25.5 us against tc 46.0, TP16 8x8
32.1 against 73.0).

Why (issue #5, notes/specialized.md "Session 10"): at 8-32 sequences the tensor-core kernel
spends most of its time in per-CTA ``w_uk`` / ``w_uv`` reads (128 KB per head and CTA, a chain
of L2 round trips) and the SIMT kernel re-reads the cache once per head. Here each ``w_uk`` /
``w_uv`` head is staged in shared memory by ``cp.async`` once per launch (``w_uv`` once per
item of rows) and applied with ``mma.sync``, and the cache is read once per sequence.

Grid: one dimension of ``n_abs + n_att + n_uv`` CTAs, 8 warps each. A CTA takes a ticket from
an atomic counter and works on the item of that ticket (not of its block index): tickets are
handed out in order, so every item a CTA waits for belongs to a CTA that is already running
and that waits on nothing later (no deadlock whatever the grid size or the scheduling order).

1. Absorption items ``(head, column chunk)``: ``w_uk[h][:, chunk]`` into shared memory
   (``cp.async``), ``q_nope`` of all ``B*T`` rows in tiles of 16, ``q_lat = q_nope @ w_uk``
   on tensor cores, scaled by ``1/sqrt(nope + rope)``, stored BF16 to a workspace
   ``q_lat [B*T, heads, kv_lora]``; then a release add on the "absorbed" counter.
2. Attention items ``(sequence, split)``: the split's first key blocks are issued (``cp.async``)
   before anything waits, the new latent rows are normalized (split 0 writes them to the
   cache), ``q_pe`` staged; one thread waits (acquire) until every absorption item is done, the
   CTA loads its sequence's ``q_lat`` rows, then the key loop of :class:`.MLADecodeTC` (ldmatrix
   fragments, online softmax, 64-key blocks, the blocks of the split evenly spread: splits
   need not divide the 17 blocks of 1025 keys) and writes ``(O, m, l)`` per row to the
   partials; then a release add on the "attended" counter.
3. W_UV items ``(head, rows, column chunk)``: ``w_uv[h][:, chunk]`` into shared memory first,
   then a wait for every attention item; the rows' splits merged (``o_lat = sum_s O_s
   exp(m_s - m) / sum_s l_s exp(m_s - m)``, BF16), ``o_lat @ w_uv`` on tensor cores, times
   ``sigmoid(g)``.

Every CTA adds one to an "exited" counter last; the CTA that completes it resets all counters
(graph-replay safe). A wait that lasts more than ``SPIN_NS`` gives up and sets the error word
(``cnt[C_ERR]``, checked by the GPU script and test): a wrong result, never a hang.

Rounding points: ``q_lat`` and ``P`` in BF16 (as the tensor-core kernel), and ``o_lat`` in BF16
before W_UV (the tensor-core kernel keeps it FP32; the standard path rounds it to BF16 too).

Knobs (compile key; one H200 run sweeps them): ``DECODESCOPE_MLA_SPLIT_SPLITS`` (key splits per
sequence; 0: ``64 // batch`` below 16 sequences, ``128 // batch`` from 16, at most the 17
blocks; with head groups, ``DECODESCOPE_MLA_SPLIT_WAVES=1``, the default since session 39
(part 52), takes the splits of a wave model, :meth:`MLASplitPlan.wave_splits`, and ``=0`` the
rule), ``_ACHUNKS`` (column chunks of an absorption item: 1, 2, 4; default 2), ``_VROWS`` (rows per W_UV item, 1-16; 0: about 96
items), ``_NBUF`` (key buffers 1 or 2; 0: 1 where each split has one block, which lets two CTAs
share an SM when the shared memory fits 113 KB), ``_FUSE`` (1: no CTAs of their own for the
absorption: the first ``n_abs`` attention CTAs absorb, publish, then attend; unset: where the
absorption + attention CTAs would pass one wave; 0: never).
``DECODESCOPE_MLA_SPLIT_TRACE=1``: each CTA writes its ticket, start, end of wait, end and the
marks of :data:`TRACE_MARKS` (the steps inside each phase; ``%globaltimer``) to a trace buffer
(:func:`trace_summary`); ``DECODESCOPE_MLA_SPLIT_DIAG=1`` (timing only, wrong results): the
waits skipped, so the phases overlap (the cost of the dependency chain).
``DECODESCOPE_MLA_SPLIT_L2PRE=1`` (opt-in): before the PDL wait each CTA issues
``prefetch.global.L2`` for its share of ``w_uk`` and ``w_uv`` (3 MB at TP8), so the absorption's
``w_uk`` stage, the first load on the phase chain, reads L2 after the wait. A hint: safe
whatever the previous kernel is. H200 TP8 1x1 in the layer (s14/r3, bench shares): the decode
19.3 -> 19.1 us, no gain: the chain is not ``w_uk``'s DRAM latency. (A variant that issued
the stages and took the ticket before the wait, s14/r2, saved 1.6 us of the decode's share at
TP8 1x1 in the layer, but two launches of it back to back on one workspace share the ticket
counter while the first runs: 5.4 ms per launch in the kernel-alone loop. Not kept.)
``DECODESCOPE_MLA_SPLIT_EARLYABS`` (default 1 since session 18; 0: off): the absorption CTAs are the grid's
first ``n_abs`` blocks and take no ticket; each stages its ``w_uk`` slice into shared memory
before the PDL wait (nothing before the kernel writes ``w_uk``), so after the wait the
absorption starts at its ``q_nope`` loads. Nothing before the wait touches the counters (a
launch following itself starts while the one before still uses them: what broke s14/r2's
early ticket). Only where every CTA of the grid is resident at once (:attr:`MLASplitPlan.early_abs`:
the absorption then needs no ticket order to be sure it runs beside the CTAs waiting for it):
TP8 1-2 and TP16 1-8 sequences at one token on an H200 (132 SMs; the real GPU's SM count is
used). H200 s18/r6, TP8 batch 1 in the layer (bench shares, same call): the decode 15.4 -> 14.2
us, the MLA layer 113.4 -> 112.4.
``DECODESCOPE_MLA_SPLIT_UVFAST`` (default 1 since session 16; 0: the W_UV phase as before): the
gate's sigmoid before the W_UV wait, the splits' merge in one round trip of L2 reads (one thread
per row and column pair where that covers the item), two MMA chains. H200 s16 (kernel alone, us):
TP8 1x1 13.4 -> 12.4, TP16 1x1 12.1 -> 11.1, TP8 8x1 19.4 -> 18.8, 1x8 25.2 -> 24.2, 8x8 and
64x1 unchanged; in the layer (TP8 batch 1, bench shares) the decode 19.2 -> 15.5 us.
``DECODESCOPE_MLA_SPLIT_TAIL`` (0 | 1 | auto; unset: auto, on only where its extra split is
taken within one wave: TP16 8x1 of the TP8 / TP16 points): the block of the new rows (1-16 keys past the cache)
goes to the split with the fewest cached blocks and is filled before the absorption wait; one
more split where the cached blocks divide evenly and the grid stays one wave (TP16 8x1: 9
splits of at most 2 blocks, not 8 with one of 3). H200 s16 (kernel alone, us): TP8 1x1 12.5 ->
12.3, TP16 1x1 11.3 -> 11.1, TP16 8x1 16.4 -> 14.9; the extra split past one wave (TP8 32x1
30.8 -> 40.2, 64x1 47.6 -> 59.0, measured before that rule) is no longer taken. In the layer
(TP8 batch 1, with ``LL``) the decode's share 15.5 -> 18.5: not on there; at TP16 batch 8
(s17/r1, same call, bench shares) 16.9 -> 15.3 us: ``auto`` takes it where the extra split is.
``DECODESCOPE_MLA_SPLIT_LL=1`` (opt-in): the partials as (value, epoch) pairs, no fence after the
attention phase (:meth:`MLADecodeSplit.merge_pairs_ll`). H200 s16: TP8 1x1 alone 12.5 -> 12.6
(12.3 -> 12.0 with ``TAIL``); the W_UV merge after its wait took 1.4 us instead of 1.2, eating
the fence's 0.5. ``DECODESCOPE_MLA_SPLIT_UVFAST=2``: four MMA chains in the W_UV phase (TP8 1x1
12.8 against 12.5 for two: not kept).
"""

# no `from __future__ import annotations`: the Smem struct reads its field annotations
import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64

from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized.comm import global_timer_ns, prefetch_range
from decodescope.kernels.specialized.mla_decode_tc import (
    KBLK,
    KPAD,
    NEG,
    NT,
    NUM_SMS,
    PPAD,
    ROWS,
    WARPS,
    MLADecodeTC,
    env_int,
    ldsm_x4,
)
from decodescope.kernels.specialized.utils import (
    load_vec8,
    pdl_begin,
    pdl_enabled,
    sigmoid,
    warp_sum,
)

WPAD = 8  # bf16 padding of staged rows: 16-byte aligned ldmatrix rows, 4-word bank offset
SMEM_MAX = 227 * 1024
SMEM_TWO_CTAS = 113 * 1024
UV_ITEMS = 96  # W_UV items the default rows-per-item aims at
SPLIT_KEYS_LOW, SPLIT_KEYS = 64, 128  # default splits x batch below / from 16 sequences
SPIN_NS = 200_000_000  # a wait gives up after 0.2 s (sets the error word)
# counters (int32 words of the workspace ``cnt``), each on its own 128-byte line: the
# attention / W_UV CTAs poll C_ABS / C_ATT while others add to C_TICKET / C_EXIT
C_TICKET, C_ABS, C_ATT, C_EXIT, C_ERR = 0, 32, 64, 96, 128
C_EPOCH = 144  # ``ll`` plans: the epoch of the last launch (its flags), set by its last CTA
NCNT = 160
# trace columns per CTA (%globaltimer ns): ticket, start, end of its wait, end, then the marks of
# :data:`TRACE_MARKS` (0 where its item has none)
NTRACE = 8
TRACE_MARKS = {
    "abs": {4: "staged", 5: "computed"},
    "att": {7: "prewait", 4: "q_lat", 5: "keys", 6: "partials"},
    "uv": {7: "prewait", 4: "weights", 5: "o_lat"},
}
POLL_NS = 64  # nanosleep between polls
ITEM_BLOCKS = 2  # an attention item's cost outside its key loop, in key blocks (wave_splits)


def device_sms() -> int:
    """SMs of the current CUDA device; :data:`NUM_SMS` (the H200's 132) without one (CPU
    compiles)."""
    if torch.cuda.is_available():
        return _sms_of(torch.cuda.current_device())
    return NUM_SMS


@functools.cache
def _sms_of(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class MLASplitPlan:
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
    splits_force: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_SPLITS", 0))
    achunks_force: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_ACHUNKS", 0))
    vrows_force: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_VROWS", 0))
    nbuf_force: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_NBUF", 0))
    # 1: the absorption items done by the first attention CTAs before their own item
    # -1 (unset): where the absorption + attention CTAs would pass one wave; 0 never
    fuse_abs: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_FUSE", -1))
    # 1: each CTA writes (ticket, start, end of its wait, end) in %globaltimer ns to the trace
    trace: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_TRACE", 0))
    # timing diagnostic, wrong results: 1 = no waits (the phases overlap: what the dependency
    # chain costs)
    diag: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_DIAG", 0))
    # 1: before the PDL wait each CTA prefetches its share of w_uk and w_uv into L2 (never
    # written by the kernels before it; a hint, safe whatever runs before)
    l2pre: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_L2PRE", 0))
    # 1 (the default since session 16): the W_UV phase's chain after its wait shortened (gate
    # before the wait, the merge in one round trip of L2 reads, two MMA chains); see
    # :meth:`MLADecodeSplit.uv_item`. 0: the kernel before it; 2: four MMA chains
    uvfast: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_UVFAST", 1))
    # 1: the block(s) holding the new rows (the "tail": 1-16 keys) given to the split with the
    # fewest cached blocks, its fill before the absorption wait, and one more split where the
    # cached blocks divide evenly and the grid stays one wave; see :meth:`block_range`. Unset
    # or "auto" (-1 here, resolved in ``__post_init__``): 1 only where that extra split is
    # taken (H200 s17/r1, TP16 batch 8 in the layer: the decode's share 16.9 -> 15.3 us)
    tail: int = field(default_factory=lambda: _tail_env())
    # 1: the partials carry their launch's epoch beside every word (8-byte (value, epoch)
    # pairs) and the attention CTAs count themselves done without a fence; the W_UV merge
    # checks the epochs and re-reads words not yet there. Only with ``uvfast`` where
    # ``uv_pairs`` holds (:attr:`ll_parts`); elsewhere ignored
    ll: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_LL", 0))
    # 1 (the default since session 18): the absorption CTAs are the grid's first blocks (no
    # ticket) and stage their ``w_uk`` slice into shared memory before the PDL wait (a weight:
    # nothing before it writes it), so the chain after the wait starts at the ``q_nope``
    # loads; only where :attr:`early_abs` holds, elsewhere ignored. 0: off
    earlyabs: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_EARLYABS", 1))
    # SMs of the GPU the kernel runs on (:func:`device_sms`): :attr:`early_abs` needs the
    # whole grid resident at once, so it counts the real GPU's SMs, not the H200's 132
    sms: int = field(default_factory=lambda: device_sms())
    # 1 (the default since session 39, measured in part 52): with head groups (the verify
    # step), the splits from the wave model of :meth:`wave_splits` instead of
    # ``128 // (batch x groups)``; 0: the rule as before
    waves: int = field(default_factory=lambda: env_int("DECODESCOPE_MLA_SPLIT_WAVES", 1))
    # row strides (elements) of ``a`` and ``g`` where they are column slices of one wider
    # buffer (``DECODESCOPE_WIDE_AG``: one GEMM wrote both); 0: compact rows (``a_width``,
    # ``heads * v_dim``). The kernel reads both element by element, so only the layout changes
    lda: int = 0
    ldg: int = 0
    # 1 (``DECODESCOPE_WIDE_QNORM=1``, set by the caller): ``q`` came from the raw ``q_a``
    # (``a[:, :q_lora]``, not normalized) through q_b's weight with the q_a RMSNorm's weight
    # folded in; each attention item computes its tokens' ``rstd`` of ``q_a`` and scales its
    # score rows by it (scores are linear in ``q``: ``q_lat`` and ``q_pe`` alike), so q_b's norm
    # launch goes. 0: ``q`` is normalized already
    qnorm: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.tokens <= ROWS:
            raise ValueError(f"mla_decode_split: 1..{ROWS} tokens per sequence, got {self.tokens}")
        if self.nope % 16 or self.kv_lora % (16 * WARPS) or self.v_dim % (8 * WARPS):
            raise ValueError("mla_decode_split: nope % 16, kv_lora % 128, v_dim % 64")
        if self.lat % 16:
            raise ValueError("mla_decode_split: latent (kv_lora + rope) % 16")
        if self.splits_force < 0:
            raise ValueError(f"DECODESCOPE_MLA_SPLIT_SPLITS: >= 0, got {self.splits_force}")
        if self.achunks_force not in (0, 1, 2, 4) or self.kv_lora % (self.achunks * 8 * WARPS):
            raise ValueError(
                f"DECODESCOPE_MLA_SPLIT_ACHUNKS: 1, 2 or 4 dividing kv_lora / 64, "
                f"got {self.achunks_force}"
            )
        if not 0 <= self.vrows_force <= ROWS:
            raise ValueError(f"DECODESCOPE_MLA_SPLIT_VROWS: 0-{ROWS}, got {self.vrows_force}")
        if self.nbuf_force not in (0, 1, 2):
            raise ValueError(f"DECODESCOPE_MLA_SPLIT_NBUF: 0, 1 or 2, got {self.nbuf_force}")
        if self.fuse_abs not in (-1, 0, 1):
            raise ValueError(f"DECODESCOPE_MLA_SPLIT_FUSE: 0 or 1, got {self.fuse_abs}")
        flags = (self.trace, self.diag, self.l2pre, self.uvfast, self.tail, self.ll)
        allowed = ((0, 1), (0, 1), (0, 1), (0, 1, 2), (-1, 0, 1), (0, 1))
        if any(f not in a for f, a in zip(flags, allowed, strict=True)):
            raise ValueError(
                "DECODESCOPE_MLA_SPLIT_TRACE / _DIAG / _L2PRE / _UVFAST / _TAIL / _LL: 0 or 1 "
                "(_UVFAST 2: four MMA chains; _TAIL auto), got "
                + " / ".join("auto" if f == -1 else str(f) for f in flags)
            )
        if self.earlyabs not in (0, 1):
            raise ValueError(f"DECODESCOPE_MLA_SPLIT_EARLYABS: 0 or 1, got {self.earlyabs}")
        if self.waves not in (0, 1):
            raise ValueError(f"DECODESCOPE_MLA_SPLIT_WAVES: 0 or 1, got {self.waves}")
        if self.qnorm not in (0, 1):
            raise ValueError(f"mla_decode_split: qnorm 0 or 1, got {self.qnorm}")
        for name, ld, width in (("a", self.lda, self.a_width), ("g", self.ldg,
                                                               self.heads * self.v_dim)):  # fmt: skip
            if ld and (ld < width or ld % 2):
                raise ValueError(f"mla_decode_split: {name}'s row stride {ld} (width {width}, "
                                 "even: 4-byte rows)")  # fmt: skip
        if self.tail == -1:  # auto: on only where it buys the extra split within one wave
            on = dataclasses.replace(self, tail=1).splits > dataclasses.replace(self, tail=0).splits
            object.__setattr__(self, "tail", int(on))

    # -- shapes ------------------------------------------------------------------------------
    @property
    def lat(self) -> int:
        return self.kv_lora + self.rope

    @property
    def a_width(self) -> int:
        return self.q_lora + self.kv_lora + self.rope

    @property
    def hg(self) -> int:
        """Heads per attention item: the most that divide ``heads`` with ``hg x tokens`` within
        the 16 MMA rows (all heads at one token for kimi-k3 TP8 / TP16)."""
        for h in range(min(self.heads, ROWS // self.tokens), 0, -1):
            if self.heads % h == 0:
                return h
        return 1

    @property
    def groups(self) -> int:
        """Head groups: attention items per (sequence, split); 1 where every head fits."""
        return self.heads // self.hg

    @property
    def rows(self) -> int:
        """MMA rows of an attention item: row ``r`` = head ``g * hg + r // T``, token ``r % T``
        (head group ``g``)."""
        return self.hg * self.tokens

    @property
    def m(self) -> int:
        return self.batch * self.tokens

    @property
    def lp(self) -> int:
        return self.lat + KPAD

    @property
    def nkeys(self) -> int:
        return self.ctx + self.tokens

    @property
    def nblk_all(self) -> int:
        return -(-self.nkeys // KBLK)

    # -- work split ----------------------------------------------------------------------------
    @property
    def splits(self) -> int:
        """``64 // batch`` below 16 sequences, ``128 // batch`` from 16 (with head groups:
        ``128 // (batch x groups)``, not measured), at most one per 64-key block (H200 s10/r2,
        TP8, kernel alone, us: 1x1 17 splits 13.5 / 8 17.3; 8x1 8 19.4 / 17 21.2 / 4 23.7;
        32x1 4 33.7 / 8 39.3; 64x1 2 49.1 / 4 57.8; other batches by the rule, not
        measured)."""
        if self.waves and self.groups > 1 and not self.splits_force:
            return self.wave_splits()
        bg = self.batch * self.groups  # attention items per split
        keys = SPLIT_KEYS_LOW if bg < 16 and self.groups == 1 else SPLIT_KEYS
        want = self.splits_force or keys // max(1, bg)
        n = max(1, min(want, self.nblk_all))
        f = self.full_blocks
        if self.tail and not self.splits_force and f and f % n == 0 and n < f:
            # the tail's split one cached block short (TP16 8x1: 9 splits of <= 2 blocks), only
            # where the grid stays one wave: past it the extra CTAs wait for a free SM (H200
            # s16/r3, kernel alone: TP8 32x1 30.8 -> 40.2 us, 64x1 47.6 -> 59.0)
            alt = dataclasses.replace(self, splits_force=n + 1)
            if alt.grid <= NUM_SMS * alt.ctas_per_sm:
                n += 1
        return n

    def wave_splits(self) -> int:
        """``DECODESCOPE_MLA_SPLIT_WAVES=1``: the splits ``s`` that minimise the attention
        phase's length in key-block times, ``ceil(items / slots) x (ceil(blocks / s) +
        ITEM_BLOCKS)``. Here ``items = batch x groups x s``, ``slots`` is the CTAs resident at
        once (SMs x CTAs per SM), and ``ITEM_BLOCKS`` is an item's own cost outside its key loop
        (q_lat staged after the wait, the partials stored, the merge's share) in blocks; the
        fewest splits among equals.
        Each item walks its blocks as one latency-bound chain, so a second wave of items costs a
        whole item. E.g. TP8 32x8 (192 items per split, 17 blocks, one CTA per SM): 1 split is
        2 waves x 19, 2 splits 3 x 11, 3 splits 5 x 8. ``ITEM_BLOCKS`` is a guess (2) for the
        A/B to calibrate; the absorption's CTAs are left out."""
        slots = self.sms * dataclasses.replace(self, splits_force=1, waves=0).ctas_per_sm
        bg = self.batch * self.groups
        nb = self.nblk_all

        def cost(s: int) -> tuple[int, int]:
            return -(-bg * s // slots) * (-(-nb // s) + ITEM_BLOCKS), s

        return min(range(1, nb + 1), key=cost)

    @property
    def full_blocks(self) -> int:
        """Blocks of cached keys only (``ctx // 64``); the blocks after them hold the new rows."""
        return self.ctx // KBLK

    def block_range(self, s: int) -> tuple[int, int]:
        """The key blocks ``[begin, end)`` of split ``s``. Default: the blocks evenly spread
        (``s * nblk_all // splits``: the last split the longest). ``tail``: the cached blocks
        spread with the longer spans first, the tail blocks appended to the last split (the
        shortest), so the 1-16 keys of the new rows never make a split one block longer than
        the rest where the cached blocks do not divide evenly."""
        S, NBA, F = self.splits, self.nblk_all, self.full_blocks
        if not self.tail or F == 0:
            return s * NBA // S, (s + 1) * NBA // S
        end = NBA if s == S - 1 else -(-(s + 1) * F // S)
        return -(-s * F // S), end

    @property
    def psplits(self) -> int:
        """Partials per sequence and row: ``groups x splits`` (group-major)."""
        return self.groups * self.splits

    @property
    def blk_max(self) -> int:
        return max(e - b for b, e in map(self.block_range, range(self.splits)))

    @property
    def nbuf(self) -> int:
        return self.nbuf_force or (1 if self.blk_max == 1 else 2)

    @property
    def achunks(self) -> int:
        return self.achunks_force or 2

    @property
    def cw(self) -> int:
        """Latent columns of an absorption item."""
        return self.kv_lora // self.achunks

    @property
    def vchunks(self) -> int:
        """Output column chunks of a W_UV item: 2 with one key buffer (the staged ``w_uv``
        half fits beside it in 113 KB), else 1."""
        return 2 if self.nbuf == 1 and self.v_dim % (16 * WARPS) == 0 else 1

    @property
    def cv(self) -> int:
        return self.v_dim // self.vchunks

    @property
    def vrows(self) -> int:
        if self.vrows_force:
            return self.vrows_force
        r = 1
        while r < ROWS and self.heads * -(-self.m // r) * self.vchunks > UV_ITEMS:
            r *= 2
        return r

    @property
    def uv_pairs(self) -> bool:
        """``uvfast``'s one-round-trip merge: one thread per (row, column pair) of a W_UV item
        fits the CTA (one row per item at kv_lora 512)."""
        return self.vrows * self.kv_lora // 2 <= NT

    @property
    def ll_parts(self) -> bool:
        """``ll`` in effect: the partials as (value, epoch) pairs, read by ``merge_pairs``."""
        return bool(self.ll and self.uvfast and self.uv_pairs)

    @property
    def part_words(self) -> int:
        """32-bit words per partial row: ``kv_lora`` O values, m, l, 2 pad; twice with
        ``ll_parts`` (an epoch beside each)."""
        return (self.kv_lora + 4) * (2 if self.ll_parts else 1)

    @property
    def n_abs(self) -> int:
        return self.heads * self.achunks

    @property
    def n_att(self) -> int:
        return self.batch * self.groups * self.splits

    @property
    def n_uv(self) -> int:
        return self.heads * -(-self.m // self.vrows) * self.vchunks

    @property
    def fused(self) -> bool:
        """The CTAs of tickets ``< n_abs`` absorb first, then attend (no CTAs of their own for
        the absorption), where there are at least as many attention items: with
        ``DECODESCOPE_MLA_SPLIT_FUSE=1``, or unset where the absorption and attention CTAs
        would not fit one wave (H200 s10/r2, TP8: 32x1 33.7 -> 31.3 us, 64x1 49.1 -> 48.0;
        8x1 with 17 splits, one wave either way, 21.2 -> 21.9)."""
        if self.n_abs > self.n_att or self.fuse_abs == 0:
            return False
        return self.fuse_abs == 1 or self.n_abs + self.n_att > NUM_SMS * self.ctas_per_sm

    @property
    def a_ctas(self) -> int:
        """CTAs (tickets) of their own for the absorption: ``n_abs``, or 0 when fused."""
        return 0 if self.fused else self.n_abs

    @property
    def grid(self) -> int:
        return self.a_ctas + self.n_att + self.n_uv

    @property
    def early_abs(self) -> bool:
        """``earlyabs`` in effect: absorption CTAs of their own (not fused) and the whole grid
        within one wave, so every absorption CTA is resident beside the CTAs that wait for it
        whatever order the blocks start in (the ticket order, which guarantees that otherwise,
        is given up for them: they take no ticket)."""
        return bool(self.earlyabs and self.a_ctas and self.grid <= self.sms * self.ctas_per_sm)

    # -- shared memory (one BF16 region, viewed per phase) ------------------------------------
    @property
    def buf_att(self) -> int:
        return (self.nbuf * KBLK + ROWS + self.tokens) * self.lp + ROWS * (KBLK + PPAD)

    @property
    def buf_abs(self) -> int:
        return self.nope * (self.cw + WPAD) + ROWS * (self.nope + WPAD)

    @property
    def buf_uv(self) -> int:
        return self.kv_lora * (self.cv + WPAD) + ROWS * (self.kv_lora + WPAD)

    @property
    def buf_elems(self) -> int:
        return max(self.buf_att, self.buf_abs, self.buf_uv)

    @property
    def smem_bytes(self) -> int:
        f32 = 2 * WARPS * ROWS + ROWS * self.splits + 8
        return 2 * self.buf_elems + 4 * f32 + 4 * 2 + 5 * 16

    @property
    def ctas_per_sm(self) -> int:
        return 2 if self.smem_bytes <= SMEM_TWO_CTAS else 1


class MLADecodeSplit(MLADecodeTC):
    """The three-phase kernel; reuses :class:`.MLADecodeTC`'s key-block helpers
    (``issue_block``, ``fill_block``, ``scores_ldsm``, ``pv_ldsm``: they read ``lp``, ``lat``,
    ``rows``, ``kv_lora``, ``ctx``, ``nkeys`` from the plan)."""

    def __init__(self, plan: MLASplitPlan):
        self.p = plan
        if plan.smem_bytes > SMEM_MAX:
            raise ValueError(f"mla_decode_split: {plan.smem_bytes} bytes of shared memory per CTA")

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
        mQl: cute.Tensor,  # [B*T, heads, kv_lora] bf16 workspace
        mPart: cute.Tensor,  # [B, groups x splits, 16, kv_lora + 4] f32 workspace
        mCnt: cute.Tensor,  # [NCNT] i32, zero between launches (but C_ERR)
        mTrace: cute.Tensor,  # [grid, NTRACE] i64 (written with ``trace`` only)
        mOut: cute.Tensor,  # [B*T, heads*v] bf16
        stream: cuda.CUstream,
    ):
        p = self.p

        @cute.struct
        class Smem:
            buf: cute.struct.Align[cute.struct.MemRange[BFloat16, p.buf_elems], 16]
            red: cute.struct.MemRange[Float32, 2 * WARPS * ROWS]
            wgt: cute.struct.MemRange[Float32, ROWS * p.splits]
            misc: cute.struct.MemRange[Float32, 8]
            tk: cute.struct.MemRange[Int32, 2]
            tm: cute.struct.Align[cute.struct.MemRange[Int64, NTRACE], 8]

        self.smem_cls = Smem
        extra = (
            {"min_blocks_per_mp": 2, "preferred_smem_carveout": 100} if p.ctas_per_sm == 2 else {}
        )
        self.kernel(mA, mQ, mG, mKvNorm, mWuk, mWuv, mCache, mQl, mPart, mCnt, mTrace, mOut).launch(
            grid=[p.grid, 1, 1],
            block=[NT, 1, 1],
            smem=Smem.size_in_bytes(),
            stream=stream,
            use_pdl=p.pdl,
            **extra,
        )

    @cute.kernel
    def kernel(self, mA, mQ, mG, mKvNorm, mWuk, mWuv, mCache, mQl, mPart, mCnt, mTrace, mOut):
        p = self.p
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        st = smem.allocate(self.smem_cls)
        base = st.buf.get_tensor(cute.make_layout(p.buf_elems)).iterator
        sRed = st.red.get_tensor(cute.make_layout((2, WARPS, ROWS), stride=(WARPS * ROWS, ROWS, 1)))
        sWgt = st.wgt.get_tensor(cute.make_layout((ROWS, p.splits), stride=(p.splits, 1)))
        sMisc = st.misc.get_tensor(cute.make_layout(8))
        sTk = st.tk.get_tensor(cute.make_layout(2))
        sTm = st.tm.get_tensor(cute.make_layout(NTRACE))

        if cutlass.const_expr(p.l2pre):
            # this CTA's share of w_uk and w_uv (contiguous [heads, rows, cols] bf16) into L2
            bid, _, _ = cute.arch.block_idx()
            for mW in (mWuk, mWuv):
                prefetch_range(mW, cute.size(mW.shape), bid, p.grid, NT)
        A = p.a_ctas
        if cutlass.const_expr(p.early_abs):
            eb, _, _ = cute.arch.block_idx()
            if eb < A:  # blocks [0, A) absorb: their w_uk slice staged while the wait lasts
                self.stage_wuk(eb, mWuk, base, tidx)
        if cutlass.const_expr(p.pdl):
            pdl_begin()
        if tidx == 0:
            if cutlass.const_expr(p.early_abs):
                tb, _, _ = cute.arch.block_idx()
                if tb < A:
                    sTk[0] = Int32(tb)
                else:  # the other CTAs take tickets after them, in start order as before
                    sTk[0] = A + cute.arch.atomic_add(
                        mCnt.iterator + C_TICKET, Int32(1), sem="acq_rel", scope="gpu"
                    )
            else:
                sTk[0] = cute.arch.atomic_add(
                    mCnt.iterator + C_TICKET, Int32(1), sem="acq_rel", scope="gpu"
                )
            if cutlass.const_expr(p.ll_parts):  # this launch's epoch (never 0: the buffers' init)
                ep = cute.arch.load(mCnt.iterator + C_EPOCH, Int32, sem="relaxed", scope="gpu")
                sTk[1] = ep + Int32(1)
            if cutlass.const_expr(p.trace):
                sTm[0] = global_timer_ns()
                for i in cutlass.range_constexpr(1, NTRACE):
                    sTm[i] = Int64(0)
        cute.arch.sync_threads()
        tk = sTk[0]
        ep = Int32(0)  # the launch's epoch: only ``ll_parts`` plans write and read it
        if cutlass.const_expr(p.ll_parts):
            ep = sTk[1]
        if cutlass.const_expr(p.fused):  # noqa: SIM102 (a trace-time condition)
            if tk < p.n_abs:  # absorb, publish, then attend (the shared memory reused)
                self.absorb_item(tk, mQ, mWuk, mQl, mCnt, base, sTm, tidx)
        if tk < A:
            self.absorb_item(tk, mQ, mWuk, mQl, mCnt, base, sTm, tidx, staged=p.early_abs)
        else:
            if tk < A + p.n_att:
                self.attend_item(
                    tk - A, mA, mKvNorm, mQ, mCache, mQl, mPart, mCnt, base, sRed, sMisc,
                    sTm, tidx, ep, sWgt,
                )  # fmt: skip
            else:
                self.uv_item(
                    tk - A - p.n_att, mG, mWuv, mPart, mCnt, mOut, base, sWgt, sTm, tidx, ep
                )

        # the CTA that exits last resets the counters (every CTA read its last counter before)
        cute.arch.sync_threads()
        if cutlass.const_expr(p.trace):  # noqa: SIM102 (a trace-time condition)
            if tidx == 0:
                mTrace[tk, 0] = Int64(tk)
                mTrace[tk, 1] = sTm[0]
                mTrace[tk, 2] = sTm[1]
                mTrace[tk, 3] = global_timer_ns()
                for i in cutlass.range_constexpr(4, NTRACE):
                    mTrace[tk, i] = sTm[i]
        if tidx == 0:
            old = cute.arch.atomic_add(mCnt.iterator + C_EXIT, Int32(1), sem="acq_rel", scope="gpu")
            if old == p.grid - 1:
                mCnt[C_TICKET] = Int32(0)
                mCnt[C_ABS] = Int32(0)
                mCnt[C_ATT] = Int32(0)
                mCnt[C_EXIT] = Int32(0)
                if cutlass.const_expr(p.ll_parts):
                    mCnt[C_EPOCH] = ep

    # -- helpers ---------------------------------------------------------------------------
    @cute.jit
    def wait_count(self, mCnt, which: cutlass.Constexpr[int], target: cutlass.Constexpr[int], sTm):
        """One thread: spin (acquire) until ``cnt[which] >= target``; after ``SPIN_NS`` set
        the error word and return (a wrong result, not a hang). ``diag``: no wait."""
        ptr = mCnt.iterator + which
        v = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
        if cutlass.const_expr(self.p.diag):
            v = Int32(target)
        if v < target:
            t0 = global_timer_ns()
            going = True
            while going:
                nanosleep(POLL_NS)
                v = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
                if v >= target:
                    going = False
                elif global_timer_ns() - t0 > Int64(SPIN_NS):
                    cute.arch.store(mCnt.iterator + C_ERR, Int32(which))
                    going = False
        if cutlass.const_expr(self.p.trace):
            sTm[1] = global_timer_ns()

    @cute.jit
    def mark(self, sTm, col: cutlass.Constexpr[int], tidx):
        """``trace`` plans: thread 0 notes ``%globaltimer`` in trace column ``col`` (its own
        progress: put it after a barrier to time the CTA's)."""
        if cutlass.const_expr(self.p.trace):  # noqa: SIM102 (a trace-time condition)
            if tidx == 0:
                sTm[col] = global_timer_ns()

    @cute.jit
    def publish(self, mCnt, which: cutlass.Constexpr[int], tidx):
        """Every thread's global stores of this item visible, then ``cnt[which] += 1``."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.atomic_add(mCnt.iterator + which, Int32(1), sem="acq_rel", scope="gpu")

    @cute.jit
    def stage_rows(self, src2d, row0, col0, dst_ptr, dst_ld: cutlass.Constexpr[int],
                   nrows: cutlass.Constexpr[int], ncols: cutlass.Constexpr[int], tidx):  # fmt: skip
        """cp.async (16 B, L2 only) of ``src2d[row0 + i, col0 : col0 + ncols]`` for ``i <
        nrows`` into shared rows of ``dst_ld`` elements."""
        nv = ncols // 8
        for i in cutlass.range_constexpr((nrows * nv + NT - 1) // NT):
            idx = tidx + i * NT
            if idx < nrows * nv:
                r = idx // nv
                v = idx % nv
                src = cute.local_tile(src2d[row0 + r, None], (8,), (col0 // 8 + v,))
                cp_async16(dst_ptr + r * dst_ld + v * 8, src.iterator)

    @cute.jit
    def mma16(self, atom, acc, fa, fb, a_ptr, a_ld: cutlass.Constexpr[int], b_ptr,
              b_ld: cutlass.Constexpr[int], nk: cutlass.Constexpr[int],
              ntl: cutlass.Constexpr[int], lane, more=()):  # fmt: skip
        """``acc[nt] += A[16, 16 nk] @ B[16 nk, 8 ntl]``: A row-major at ``a_ptr`` (rows of
        ``a_ld``), B stored [k][n] at ``b_ptr`` (rows of ``b_ld``); A by ``ldmatrix.x4``, B by
        ``x4.trans`` (two n-tiles each; ``x2`` for an odd last one). With ``more`` (extra
        accumulator lists) k step ``kk`` accumulates into chain ``kk % (1 + len(more))``: that
        many MMA chains of ``nk / chains`` (the caller adds them)."""
        mi = lane // 8
        ri = lane % 8
        fa32 = cute.recast_tensor(fa, Int32)
        fb32 = cute.recast_tensor(fb, Int32)
        a_base = a_ptr + ((mi % 2) * 8 + ri) * a_ld + (mi // 2) * 8
        b_base = b_ptr + ((mi % 2) * 8 + ri) * b_ld + (mi // 2) * 8
        for kk in cutlass.range_constexpr(nk):
            aa = ldsm_x4(a_base + kk * 16, False)
            for e in cutlass.range_constexpr(4):
                fa32[e] = aa[e]
            chains = (acc, *more)
            dst = chains[kk % len(chains)]
            self.mma_b_trans(atom, dst, fa, fb, fb32, b_base + kk * 16 * b_ld, ntl)

    # -- 1. absorption -----------------------------------------------------------------------
    @cute.jit
    def stage_wuk(self, it, mWuk, base, tidx):
        """cp.async of absorption item ``it``'s ``w_uk[h][:, chunk]`` into its shared rows, one
        commit group (:meth:`absorb_item` waits for it)."""
        p = self.p
        CWP = p.cw + WPAD
        self.stage_rows(mWuk[it // p.achunks, None, None], 0, (it % p.achunks) * p.cw, base,
                        CWP, p.nope, p.cw, tidx)  # fmt: skip
        cute.arch.cp_async_commit_group()

    @cute.jit
    def absorb_item(self, it, mQ, mWuk, mQl, mCnt, base, sTm, tidx,
                    staged: cutlass.Constexpr[bool] = False):  # fmt: skip
        """``staged``: :meth:`stage_wuk` ran before the PDL wait (``early_abs``)."""
        p = self.p
        CW, NOPE, M = p.cw, p.nope, p.m
        CWP = CW + WPAD
        AP = NOPE + WPAD
        qw = p.nope + p.rope
        h = it // p.achunks
        col0 = (it % p.achunks) * CW
        sW = cute.make_tensor(base, cute.make_layout((NOPE, CWP), stride=(CWP, 1)))
        sA = cute.make_tensor(base + NOPE * CWP, cute.make_layout((ROWS, AP), stride=(AP, 1)))
        if cutlass.const_expr(not staged):
            self.stage_rows(mWuk[h, None, None], 0, col0, sW.iterator, CWP, NOPE, CW, tidx)
            cute.arch.cp_async_commit_group()
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        NTL = CW // 8 // WARPS
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        fa = cute.make_rmem_tensor((8, 1, 1), BFloat16)
        fb = cute.make_rmem_tensor((4, 1, 1), BFloat16)
        scale = Float32(1.0 / math.sqrt(p.nope + p.rope))
        nvq = NOPE // 8
        for mt in cutlass.range_constexpr((M + ROWS - 1) // ROWS):
            cute.arch.sync_threads()  # the previous tile's ldmatrix reads are done
            for i in cutlass.range_constexpr((ROWS * nvq + NT - 1) // NT):
                idx = tidx + i * NT
                if idx < ROWS * nvq:
                    r = idx // nvq
                    v = idx % nvq
                    x = cute.make_rmem_tensor((8,), BFloat16)
                    x.fill(0.0)
                    if mt * ROWS + r < M:
                        load_vec8(mQ[mt * ROWS + r, None], h * qw + v * 8, x)
                    cute.autovec_copy(x, cute.local_tile(sA[r, None], (8,), (v,)))
            if cutlass.const_expr(mt == 0):
                cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()
            if cutlass.const_expr(mt == 0):
                self.mark(sTm, 4, tidx)  # w_uk and the first q tile staged
            acc = self.make_acc(NTL)
            self.mma16(atom, acc, fa, fb, sA.iterator, AP, sW.iterator + warp * NTL * 8, CWP,
                       NOPE // 16, NTL, lane)  # fmt: skip
            r0 = mt * ROWS + g
            for nt in cutlass.range_constexpr(NTL):
                col = col0 + (warp * NTL + nt) * 8 + 2 * c
                pp = cute.make_rmem_tensor((2,), BFloat16)
                for hh in cutlass.range_constexpr(2):
                    if r0 + 8 * hh < M:
                        pp[0] = (acc[nt][2 * hh] * scale).to(BFloat16)
                        pp[1] = (acc[nt][2 * hh + 1] * scale).to(BFloat16)
                        cute.autovec_copy(
                            pp, cute.local_tile(mQl[r0 + 8 * hh, h, None], (2,), (col // 2,))
                        )
        self.mark(sTm, 5, tidx)  # thread 0's q_lat stores issued
        self.publish(mCnt, C_ABS, tidx)

    # -- 2. attention ------------------------------------------------------------------------
    @cute.jit
    def attend_item(
        self, it, mA, mKvNorm, mQ, mCache, mQl, mPart, mCnt, base, sRed, sMisc, sTm, tidx, ep,
        sWgt,
    ):  # fmt: skip
        p = self.p
        LP, KVL, T, R, NB, S = p.lp, p.kv_lora, p.tokens, p.rows, p.nbuf, p.splits
        NBA = p.nblk_all
        G, HG = p.groups, p.hg
        b = it // S
        sp = it % S
        g0 = 0  # the item's head group; its first head h0; its partials' split index ps
        h0 = 0
        ps = sp
        if cutlass.const_expr(G > 1):
            b = it // (G * S)
            g0 = (it // S) % G
            h0 = g0 * HG
            ps = g0 * S + sp
        sK = cute.make_tensor(base, cute.make_layout((NB, KBLK, LP), stride=(KBLK * LP, LP, 1)))
        o = NB * KBLK * LP
        sQ = cute.make_tensor(base + o, cute.make_layout((ROWS, LP), stride=(LP, 1)))
        o += ROWS * LP
        sNew = cute.make_tensor(base + o, cute.make_layout((T, LP), stride=(LP, 1)))
        o += T * LP
        sP = cute.make_tensor(
            base + o, cute.make_layout((ROWS, KBLK + PPAD), stride=(KBLK + PPAD, 1))
        )
        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4

        if cutlass.const_expr(p.tail and p.full_blocks > 0):
            F = p.full_blocks
            bb = (sp * F + S - 1) // S
            nblk = ((sp + 1) * F + S - 1) // S - bb
            if sp == S - 1:
                nblk = NBA - bb
        else:
            bb = sp * NBA // S
            nblk = (sp + 1) * NBA // S - bb
        k_begin = bb * KBLK
        k_end = cutlass.min(k_begin + nblk * KBLK, p.nkeys)
        for blk0 in cutlass.range_constexpr(NB):
            if blk0 < nblk:
                self.issue_block(mCache, sK, b, k_begin + blk0 * KBLK, blk0, tidx)
            cute.arch.cp_async_commit_group()

        # the new latent rows (bf16, as the cache stores them); group 0's split 0 writes them
        self.new_rows(mA, mKvNorm, mCache, sNew, sMisc, b, g0, sp, tidx)
        if cutlass.const_expr(p.tail):
            # the first block's rows past the cache (the tail: new rows, zeros) before the wait
            cute.arch.sync_threads()  # sNew complete
            self.fill_block(sK, sNew, k_begin, 0, tidx)

        # q_pe scaled; the padding rows zero
        scale = Float32(1.0 / math.sqrt(p.nope + p.rope))
        self.stage_q_pe(mQ, sQ, b, h0, scale, tidx)
        if cutlass.const_expr(p.qnorm):  # the tokens' q_a rstd into sWgt, read after the wait
            self.q_rstd(mA, sWgt, b, tidx)

        # q_lat of this sequence's rows, once every absorption item is done
        self.mark(sTm, 7, tidx)  # the work before the wait done (thread 0's part)
        if tidx == 0:
            self.wait_count(mCnt, C_ABS, p.n_abs, sTm)
        cute.arch.sync_threads()
        rs0 = Float32(1.0)  # the score rows' q_a rstd (qnorm): rows r0 = g and r1 = g + 8
        rs1 = Float32(1.0)
        if cutlass.const_expr(p.qnorm):  # every warp's rstd written before the barrier above
            rs0 = sWgt[g % T, 0]
            rs1 = sWgt[(g + 8) % T, 0]
        nv = KVL // 8
        for i in cutlass.range_constexpr((R * nv + NT - 1) // NT):
            idx = tidx + i * NT
            if idx < R * nv:
                r = idx // nv
                v = idx % nv
                src = cute.local_tile(mQl[b * T + r % T, h0 + r // T, None], (8,), (v,))
                cp_async16(sQ.iterator + r * LP + v * 8, src.iterator)
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        self.mark(sTm, 4, tidx)  # q_lat staged

        # the key blocks (MLADecodeTC's loop, ldmatrix fragments)
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        NTL = KVL // 8 // WARPS
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
        for blk in cutlass.range(nblk):
            buf = blk % NB
            cute.arch.cp_async_wait_group(NB - 1)
            kb = k_begin + blk * KBLK
            if cutlass.const_expr(p.tail):
                if blk > 0:  # the first block's filled before the wait
                    self.fill_block(sK, sNew, kb, buf, tidx)
            else:
                self.fill_block(sK, sNew, kb, buf, tidx)
            cute.arch.sync_threads()
            sacc = cute.make_rmem_tensor((4, 1, 1), Float32)
            sacc.fill(0.0)
            self.scores_ldsm(atom, sacc, fa, fb, sQ, sK, buf, warp, lane)
            if cutlass.const_expr(p.qnorm):  # rows r0 (c0, c1) and r1 (c2, c3)
                sacc[0] = sacc[0] * rs0
                sacc[1] = sacc[1] * rs0
                sacc[2] = sacc[2] * rs1
                sacc[3] = sacc[3] * rs1
            pv, l0, l1, m0, m1 = self.softmax_step(
                sacc, sRed, oacc, kb, k_end, warp, c, r0, r1, t0, t1, m0, m1, l0, l1
            )
            kl = warp * 8 + 2 * c
            pp = cute.make_rmem_tensor((2,), BFloat16)
            pp[0] = pv[0].to(BFloat16)
            pp[1] = pv[1].to(BFloat16)
            cute.autovec_copy(pp, cute.local_tile(sP[r0, None], (2,), (kl // 2,)))
            pp[0] = pv[2].to(BFloat16)
            pp[1] = pv[3].to(BFloat16)
            cute.autovec_copy(pp, cute.local_tile(sP[r1, None], (2,), (kl // 2,)))
            cute.arch.sync_threads()
            self.pv_ldsm(atom, oacc, fa, fb, sP, sK, buf, warp, lane)
            cute.arch.sync_threads()
            if blk + NB < nblk:
                self.issue_block(mCache, sK, b, kb + NB * KBLK, buf, tidx)
            cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        self.mark(sTm, 5, tidx)  # thread 0 through the key loop (its barriers: the CTA's)

        # row sums; the split's (O, m, l) to the partials
        la0, la1 = self.row_sums(sRed, l0, l1, warp, c, r0, r1)
        if cutlass.const_expr(p.ll_parts):
            # (value, epoch) pairs, two values per 16-byte store; no fence: the counter below
            # only tells the W_UV CTAs when to start reading, the epochs tell them what arrived
            for nt in cutlass.range_constexpr(NTL):
                col = (warp * NTL + nt) * 8 + 2 * c
                if r0 < R:
                    st_ll2(mPart[b, ps, r0, None].iterator + 2 * col, oacc[nt][0], oacc[nt][1], ep)
                if r1 < R:
                    st_ll2(mPart[b, ps, r1, None].iterator + 2 * col, oacc[nt][2], oacc[nt][3], ep)
            if warp == 0 and c == 0:
                if r0 < R:
                    st_ll2(mPart[b, ps, r0, None].iterator + 2 * KVL, m0, la0, ep)
                if r1 < R:
                    st_ll2(mPart[b, ps, r1, None].iterator + 2 * KVL, m1, la1, ep)
            self.mark(sTm, 6, tidx)
            cute.arch.sync_threads()
            if tidx == 0:
                cute.arch.atomic_add(mCnt.iterator + C_ATT, Int32(1), sem="relaxed", scope="gpu")
            return
        for nt in cutlass.range_constexpr(NTL):
            col = (warp * NTL + nt) * 8 + 2 * c
            v2 = cute.make_rmem_tensor((2,), Float32)
            if r0 < R:
                v2[0] = oacc[nt][0]
                v2[1] = oacc[nt][1]
                cute.autovec_copy(v2, cute.local_tile(mPart[b, ps, r0, None], (2,), (col // 2,)))
            if r1 < R:
                v2[0] = oacc[nt][2]
                v2[1] = oacc[nt][3]
                cute.autovec_copy(v2, cute.local_tile(mPart[b, ps, r1, None], (2,), (col // 2,)))
        if warp == 0 and c == 0:
            if r0 < R:
                mPart[b, ps, r0, KVL] = m0
                mPart[b, ps, r0, KVL + 1] = la0
            if r1 < R:
                mPart[b, ps, r1, KVL] = m1
                mPart[b, ps, r1, KVL + 1] = la1
        self.mark(sTm, 6, tidx)  # thread 0's partial stores issued
        self.publish(mCnt, C_ATT, tidx)

    @cute.jit
    def q_rstd(self, mA, sRs, b, tidx):
        """``qnorm``: each of the sequence's tokens' ``rsqrt(mean(q_a^2) + eps)`` (``q_a``: the
        first ``q_lora`` columns of ``a``, raw), a warp per token, into ``sRs[t, 0]`` (the W_UV
        items' weights scratch, which attention items do not use). No barrier of its own: the
        caller reads it after the barrier that follows the absorption wait, so the reductions
        overlap thread 0's poll."""
        p = self.p
        T, QL = p.tokens, p.q_lora
        warp = tidx // 32
        lane = tidx % 32
        for tw in cutlass.range_constexpr((T + WARPS - 1) // WARPS):
            t = warp + tw * WARPS
            if t < T:
                ss = Float32(0.0)
                for i in cutlass.range_constexpr((QL + 31) // 32):
                    cc = lane + i * 32
                    if cc < QL:
                        x = mA[b * T + t, cc].to(Float32)
                        ss = ss + x * x
                ss = warp_sum(ss)
                if lane == 0:
                    sRs[t, 0] = cute.math.rsqrt(ss / Float32(QL) + Float32(p.eps))

    # -- 3. merge + W_UV + gate --------------------------------------------------------------
    @cute.jit
    def uv_item(self, it, mG, mWuv, mPart, mCnt, mOut, base, sWgt, sTm, tidx, ep):
        """Merge the rows' splits, ``o_lat @ w_uv[h][:, chunk]``, times ``sigmoid(g)``. With
        ``uvfast`` the chain after the wait is shorter: the gate is loaded and its sigmoid taken
        before the wait; where one thread per (row, column pair) suffices (``uv_pairs``: one row
        per item at kv_lora 512) each thread reads every split's ``(m, l)`` and its two ``O``
        columns in one round trip and merges them itself (no weights through shared memory),
        else the weight threads read ``(m, l)`` in one round trip (two before); the MMA's k
        steps in two chains (even / odd) instead of one."""
        p = self.p
        KVL, CV, T, S, VR, V, M = p.kv_lora, p.cv, p.tokens, p.splits, p.vrows, p.v_dim, p.m
        CVP = CV + WPAD
        AP = KVL + WPAD
        vc = it % p.vchunks
        h = (it // p.vchunks) % p.heads
        m_0 = (it // (p.vchunks * p.heads)) * VR
        sW = cute.make_tensor(base, cute.make_layout((KVL, CVP), stride=(CVP, 1)))
        sA = cute.make_tensor(base + KVL * CVP, cute.make_layout((ROWS, AP), stride=(AP, 1)))
        self.stage_rows(mWuv[h, None, None], 0, vc * CV, sW.iterator, CVP, KVL, CV, tidx)
        cute.arch.cp_async_commit_group()
        # the padding rows of the A tile: zeros
        nv = KVL // 8
        for i in cutlass.range_constexpr(((ROWS - VR) * nv + NT - 1) // NT):
            idx = tidx + i * NT
            if idx < (ROWS - VR) * nv:
                x = cute.make_rmem_tensor((8,), BFloat16)
                x.fill(0.0)
                cute.autovec_copy(x, cute.local_tile(sA[VR + idx // nv, None], (8,), (idx % nv,)))
        NTL = CV // 8 // WARPS
        if cutlass.const_expr(p.uvfast):
            # sigmoid(g) of this thread's outputs (written by a kernel before the PDL wait)
            gwarp = tidx // 32
            gg = (tidx % 32) // 4
            gc = tidx % 4
            gv = cute.make_rmem_tensor((NTL * 4,), Float32)
            for nt in cutlass.range_constexpr(NTL):
                col = h * V + vc * CV + (gwarp * NTL + nt) * 8 + 2 * gc
                for hh in cutlass.range_constexpr(2):
                    ri = gg + 8 * hh
                    mrow = m_0 + ri
                    for e in cutlass.range_constexpr(2):
                        gv[nt * 4 + hh * 2 + e] = Float32(0.0)
                        if ri < VR and mrow < M:
                            gv[nt * 4 + hh * 2 + e] = sigmoid(mG[mrow, col + e].to(Float32))

        self.mark(sTm, 7, tidx)  # the work before the wait done (thread 0's part)
        if tidx == 0:
            self.wait_count(mCnt, C_ATT, p.n_att, sTm)
        cute.arch.sync_threads()
        # split weights of the item's rows (row i: token row m_0 + i; its partials: row
        # (h % hg) * T + t of head group h // hg, splits s0 .. s0 + S - 1)
        s0 = 0
        hr = h
        if cutlass.const_expr(p.groups > 1):
            s0 = (h // p.hg) * S
            hr = h % p.hg
        if cutlass.const_expr(p.ll_parts):
            self.merge_pairs_ll(mPart, mCnt, sA, sWgt, m_0, s0, hr, tidx, ep)
        elif cutlass.const_expr(p.uvfast and p.uv_pairs):
            self.merge_pairs(mPart, sA, m_0, s0, hr, tidx)
        else:
            self.merge_weights(mPart, sWgt, m_0, s0, hr, tidx)
            cute.arch.sync_threads()
            self.mark(sTm, 4, tidx)  # the splits' merge weights
            n4 = VR * (KVL // 4)
            for i in cutlass.range_constexpr((n4 + NT - 1) // NT):
                idx = tidx + i * NT
                ri = idx // (KVL // 4)
                c4 = idx % (KVL // 4)
                mrow = m_0 + ri
                if idx < n4:
                    acc = cute.make_rmem_tensor((4,), Float32)
                    acc.fill(0.0)
                    if mrow < M:
                        bq = mrow // T
                        pr = hr * T + mrow % T
                        for s in cutlass.range_constexpr(S):
                            v = ld_cg_v4f32(mPart[bq, s0 + s, pr, None].iterator + c4 * 4)
                            w = sWgt[ri, s]
                            for e in cutlass.range_constexpr(4):
                                acc[e] = acc[e] + v[e] * w
                    ob = cute.make_rmem_tensor((4,), BFloat16)
                    for e in cutlass.range_constexpr(4):
                        ob[e] = acc[e].to(BFloat16)
                    cute.autovec_copy(ob, cute.local_tile(sA[ri, None], (4,), (c4,)))
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()
        self.mark(sTm, 5, tidx)  # o_lat merged and w_uv staged

        warp = tidx // 32
        lane = tidx % 32
        g = lane // 4
        c = lane % 4
        atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(BFloat16, Float32, (16, 8, 16)))
        fa = cute.make_rmem_tensor((8, 1, 1), BFloat16)
        fb = cute.make_rmem_tensor((4, 1, 1), BFloat16)
        acc = self.make_acc(NTL)
        if cutlass.const_expr(p.uvfast):
            more = [self.make_acc(NTL) for _ in range(2 * p.uvfast - 1)]  # 2 or 4 chains
            self.mma16(atom, acc, fa, fb, sA.iterator, AP, sW.iterator + warp * NTL * 8, CVP,
                       KVL // 16, NTL, lane, more)  # fmt: skip
            for nt in cutlass.range_constexpr(NTL):
                for a in more:
                    for k in cutlass.range_constexpr(4):
                        acc[nt][k] = acc[nt][k] + a[nt][k]
            for nt in cutlass.range_constexpr(NTL):
                col = h * V + vc * CV + (warp * NTL + nt) * 8 + 2 * c
                for hh in cutlass.range_constexpr(2):
                    ri = g + 8 * hh
                    mrow = m_0 + ri
                    if ri < VR and mrow < M:
                        ob = cute.make_rmem_tensor((2,), BFloat16)
                        for e in cutlass.range_constexpr(2):
                            k = 2 * hh + e
                            ob[e] = (acc[nt][k] * gv[nt * 4 + k]).to(BFloat16)
                        cute.autovec_copy(ob, cute.local_tile(mOut[mrow, None], (2,), (col // 2,)))
        else:
            self.mma16(atom, acc, fa, fb, sA.iterator, AP, sW.iterator + warp * NTL * 8, CVP,
                       KVL // 16, NTL, lane)  # fmt: skip
            for nt in cutlass.range_constexpr(NTL):
                col = h * V + vc * CV + (warp * NTL + nt) * 8 + 2 * c
                for hh in cutlass.range_constexpr(2):
                    ri = g + 8 * hh
                    mrow = m_0 + ri
                    if ri < VR and mrow < M:
                        for e in cutlass.range_constexpr(2):
                            gate = sigmoid(mG[mrow, col + e].to(Float32))
                            mOut[mrow, col + e] = (acc[nt][2 * hh + e] * gate).to(BFloat16)

    @cute.jit
    def merge_weights(self, mPart, sWgt, m_0, s0, hr, tidx):
        """Threads ``< vrows``: the merge weights ``exp(m_s - m) / sum_s l_s exp(m_s - m)`` of
        row ``m_0 + tidx`` into ``sWgt`` (``uvfast``: every ``(m, l)`` read in one round trip)."""
        p = self.p
        KVL, T, S, VR, M = p.kv_lora, p.tokens, p.splits, p.vrows, p.m
        if tidx < VR:
            mrow = m_0 + tidx
            if mrow < M:
                bq = mrow // T
                pr = hr * T + mrow % T
                if cutlass.const_expr(p.uvfast):
                    ml = [ld_cg_v2f32(mPart[bq, s0 + s, pr, None].iterator + KVL) for s in range(S)]
                    mall = ml[0][0]
                    for s in cutlass.range_constexpr(1, S):
                        mall = cute.arch.fmax(mall, ml[s][0])
                    ws = [cute.math.exp(ml[s][0] - mall, fastmath=True) for s in range(S)]
                    lall = Float32(0.0)
                    for s in cutlass.range_constexpr(S):
                        lall = lall + ml[s][1] * ws[s]
                    inv = Float32(1.0) / lall
                    for s in cutlass.range_constexpr(S):
                        sWgt[tidx, s] = ws[s] * inv
                else:
                    mall = Float32(NEG)
                    for s in cutlass.range_constexpr(S):
                        mall = cute.arch.fmax(
                            mall, ld_cg_f32(mPart[bq, s0 + s, pr, None].iterator + KVL)
                        )
                    lall = Float32(0.0)
                    for s in cutlass.range_constexpr(S):
                        w = cute.math.exp(
                            ld_cg_f32(mPart[bq, s0 + s, pr, None].iterator + KVL) - mall,
                            fastmath=True,
                        )
                        sWgt[tidx, s] = w
                        lall = lall + ld_cg_f32(mPart[bq, s0 + s, pr, None].iterator + KVL + 1) * w
                    for s in cutlass.range_constexpr(S):
                        sWgt[tidx, s] = sWgt[tidx, s] / lall

    @cute.jit
    def merge_pairs(self, mPart, sA, m_0, s0, hr, tidx):
        """``uvfast`` with ``uv_pairs``: thread ``(row, pair)`` reads the row's ``(m, l)`` and
        its two ``O`` columns of every split (one round trip of ``2 x splits`` 8-byte L2 reads),
        merges them and writes the two BF16 ``o_lat`` values to the A tile (zeros for rows past
        the batch)."""
        p = self.p
        KVL, T, S, VR, M = p.kv_lora, p.tokens, p.splits, p.vrows, p.m
        KV2 = KVL // 2
        if tidx < VR * KV2:
            ri = tidx // KV2
            c2 = tidx % KV2
            mrow = m_0 + ri
            ob = cute.make_rmem_tensor((2,), BFloat16)
            ob.fill(0.0)
            if mrow < M:
                bq = mrow // T
                pr = hr * T + mrow % T
                ml = [ld_cg_v2f32(mPart[bq, s0 + s, pr, None].iterator + KVL) for s in range(S)]
                ov = [ld_cg_v2f32(mPart[bq, s0 + s, pr, None].iterator + 2 * c2) for s in range(S)]
                mall = ml[0][0]
                for s in cutlass.range_constexpr(1, S):
                    mall = cute.arch.fmax(mall, ml[s][0])
                lall = Float32(0.0)
                a0 = Float32(0.0)
                a1 = Float32(0.0)
                for s in cutlass.range_constexpr(S):
                    w = cute.math.exp(ml[s][0] - mall, fastmath=True)
                    lall = lall + ml[s][1] * w
                    a0 = a0 + ov[s][0] * w
                    a1 = a1 + ov[s][1] * w
                inv = Float32(1.0) / lall
                ob[0] = (a0 * inv).to(BFloat16)
                ob[1] = (a1 * inv).to(BFloat16)
            cute.autovec_copy(ob, cute.local_tile(sA[ri, None], (2,), (c2,)))

    @cute.jit
    def merge_pairs_ll(self, mPart, mCnt, sA, sWgt, m_0, s0, hr, tidx, ep):
        """:meth:`merge_pairs` over (value, epoch) partials (one row per item: ``uv_pairs``).
        Every thread issues its ``O`` pair of every split (16-byte volatile loads) first; then
        lane ``s`` of warp 0 reads split ``s``'s ``(m, l)``, the warp takes the max and the sum
        by shuffles and leaves the weights in ``sWgt[0]``; a barrier; each thread merges its
        pair. One round of L2 reads and a barrier. A word whose epoch is not this launch's (its
        store not arrived yet: the attention CTAs count themselves done without a fence) is
        re-read after a short sleep; after ``SPIN_NS`` the error word is set (C_ATT)."""
        p = self.p
        KVL, T, S, M = p.kv_lora, p.tokens, p.splits, p.m
        mrow = m_0
        bq = mrow // T
        pr = hr * T + mrow % T
        c2 = tidx % (KVL // 2)
        val = cute.make_rmem_tensor((2 * S,), Float32)
        bad = Int32(0)
        if mrow < M:
            bad = self.ll_read_o(mPart, val, bq, s0, pr, c2, ep)
        warp = tidx // 32
        if warp == 0:
            lane = tidx % 32
            mv = Float32(NEG)
            lv = Float32(0.0)
            if mrow < M and lane < S:
                x = ld_ll2(mPart[bq, s0 + lane, pr, None].iterator + 2 * KVL)
                if cutlass.const_expr(not self.p.diag):  # noqa: SIM102 (trace-time)
                    if x[1] != ep or x[3] != ep:
                        x = self.ll_spin(mPart[bq, s0 + lane, pr, None].iterator + 2 * KVL, ep,
                                         mCnt)  # fmt: skip
                mv = x[0]
                lv = x[2]
            mall = mv
            for off in (16, 8, 4, 2, 1):
                mall = cute.arch.fmax(mall, cute.arch.shuffle_sync_bfly(mall, offset=off))
            w = Float32(0.0)
            if lane < S:
                w = cute.math.exp(mv - mall, fastmath=True)
            lsum = lv * w
            for off in (16, 8, 4, 2, 1):
                lsum = lsum + cute.arch.shuffle_sync_bfly(lsum, offset=off)
            if lane < S:
                sWgt[0, lane] = w / lsum
        if cutlass.const_expr(not self.p.diag):  # noqa: SIM102 (trace-time)
            if bad > 0:
                t0 = global_timer_ns()
                going = True
                while going:
                    nanosleep(POLL_NS)
                    bad = self.ll_read_o(mPart, val, bq, s0, pr, c2, ep)
                    if bad == 0:
                        going = False
                    elif global_timer_ns() - t0 > Int64(SPIN_NS):
                        cute.arch.store(mCnt.iterator + C_ERR, Int32(C_ATT))
                        going = False
        cute.arch.sync_threads()
        a0 = Float32(0.0)
        a1 = Float32(0.0)
        for s in cutlass.range_constexpr(S):
            ws = sWgt[0, s]
            a0 = a0 + val[2 * s] * ws
            a1 = a1 + val[2 * s + 1] * ws
        ob = cute.make_rmem_tensor((2,), BFloat16)
        ob.fill(0.0)
        if mrow < M:
            ob[0] = a0.to(BFloat16)
            ob[1] = a1.to(BFloat16)
        cute.autovec_copy(ob, cute.local_tile(sA[0, None], (2,), (c2,)))

    @cute.jit
    def ll_read_o(self, mPart, val, bq, s0, pr, c2, ep) -> Int32:
        """One round of the thread's ``O`` pair of every split into ``val``; returns how many
        of the 2 x splits epochs are not ``ep``."""
        S = self.p.splits
        ov = [ld_ll2(mPart[bq, s0 + s, pr, None].iterator + 4 * c2) for s in range(S)]
        bad = Int32(0)
        for s in cutlass.range_constexpr(S):
            val[2 * s] = ov[s][0]
            val[2 * s + 1] = ov[s][2]
            if ov[s][1] != ep:
                bad = bad + Int32(1)
            if ov[s][3] != ep:
                bad = bad + Int32(1)
        return bad

    @cute.jit
    def ll_spin(self, ptr, ep, mCnt):
        """Re-read one 16-byte (value, epoch) x 2 word until both epochs are ``ep`` (after
        ``SPIN_NS`` the error word is set and the last read kept)."""
        x = ld_ll2(ptr)
        t0 = global_timer_ns()
        going = True
        while going:
            nanosleep(POLL_NS)
            x = ld_ll2(ptr)
            if x[1] == ep and x[3] == ep:
                going = False
            elif global_timer_ns() - t0 > Int64(SPIN_NS):
                cute.arch.store(mCnt.iterator + C_ERR, Int32(C_ATT))
                going = False
        return x


def st_ll2(ptr, a: Float32, b: Float32, ep: Int32) -> None:
    """``st.volatile.global.v4.b32 [ptr], {a, ep, b, ep}``: two FP32 values, each beside the
    launch's epoch (16-byte aligned; each 8-byte half is written as one piece)."""
    cute.arch.inline_ptx(
        "st.volatile.global.v4.b32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r2}};",
        read_only_args=[ptr, Float32(a), Int32(ep), Float32(b)],
    )


def ld_ll2(ptr):
    """``ld.volatile.global.v4.b32``: ``(a, epoch_a, b, epoch_b)`` as written by
    :func:`st_ll2` (FP32, Int32, FP32, Int32)."""
    return cute.arch.inline_ptx(
        "ld.volatile.global.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Float32, Int32, Float32, Int32],
        read_only_args=[ptr],
    )


def _tail_env() -> int:
    """``DECODESCOPE_MLA_SPLIT_TAIL``: 0 | 1 | auto (unset: auto, returned as -1)."""
    v = os.environ.get("DECODESCOPE_MLA_SPLIT_TAIL", "").strip().lower()
    if v in ("", "auto"):
        return -1
    if v.lstrip("-").isdigit():
        return int(v)
    raise ValueError(f"DECODESCOPE_MLA_SPLIT_TAIL={v!r}: expected 0, 1 or auto")


def nanosleep(ns: int) -> None:
    """``nanosleep.u32``: a polling thread yields its issue slots for about ``ns``."""
    cute.arch.inline_ptx(f"nanosleep.u32 {ns};")


def cp_async16(dst_ptr, src_ptr) -> None:
    """``cp.async.cg`` of 16 bytes (global -> shared, through L2 only)."""
    cute.arch.inline_ptx(
        "cp.async.cg.shared.global [{$r0}], [{$r1}], 16;", read_only_args=[dst_ptr, src_ptr]
    )


def ld_cg_f32(ptr) -> Float32:
    """One FP32 from global memory at L2 (``ld.global.cg``: another CTA wrote it)."""
    return cute.arch.inline_ptx(
        "ld.global.cg.f32 {$w0}, [{$r0}];", write_only_types=[Float32], read_only_args=[ptr]
    )


def ld_cg_v2f32(ptr):
    """Two FP32 (8-byte aligned) from global memory at L2."""
    return cute.arch.inline_ptx(
        "ld.global.cg.v2.f32 {{$w0}, {$w1}}, [{$r0}];",
        write_only_types=[Float32, Float32],
        read_only_args=[ptr],
    )


def ld_cg_v4f32(ptr):
    """Four FP32 (16-byte aligned) from global memory at L2."""
    return cute.arch.inline_ptx(
        "ld.global.cg.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Float32, Float32, Float32, Float32],
        read_only_args=[ptr],
    )


# -- torch-facing --------------------------------------------------------------------------


def plan_for(cfg, batch: int, tokens: int) -> MLASplitPlan:
    m = cfg.mla
    return MLASplitPlan(
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
    )


def _fake_args(p: MLASplitPlan):
    bf = torch.bfloat16
    M = p.m
    gw = p.heads * p.v_dim

    def rows(width: int, ld: int):
        if ld in (0, width):
            return itf.fake(bf, (M, width), align=4)
        return itf.fake_strided(bf, (M, width), (ld, 1), align=4)

    return (
        rows(p.a_width, p.lda),
        itf.fake(bf, (M, p.heads * (p.nope + p.rope))),
        rows(gw, p.ldg),
        itf.fake(bf, (p.kv_lora,), align=4),
        itf.fake(bf, (p.heads, p.nope, p.kv_lora)),
        itf.fake(bf, (p.heads, p.kv_lora, p.v_dim)),
        itf.fake(bf, (p.batch, p.ctx + p.tokens, p.lat)),
        itf.fake(bf, (M, p.heads, p.kv_lora)),
        itf.fake(
            torch.int32 if p.ll_parts else torch.float32, (p.batch, p.psplits, ROWS, p.part_words)
        ),
        itf.fake(torch.int32, (NCNT,), align=4),
        itf.fake(torch.int64, (p.grid, NTRACE), align=8),
        itf.fake(bf, (M, p.heads * p.v_dim), align=4),
        itf.env_stream(),
    )


def compile_plan(p: MLASplitPlan):
    # the key's name is the op's ("mla_decode"); the plan type tells the kernels apart
    return itf.compiled(("mla_decode", p), lambda: (MLADecodeSplit(p), _fake_args(p)))


_WS: dict[tuple, tuple[torch.Tensor, ...]] = {}


def workspace(p: MLASplitPlan, device) -> tuple[torch.Tensor, ...]:
    """``(q_lat, partials, counters, trace)`` of a plan (the counters zeroed once; the kernel
    resets them, so the same buffers serve every launch and graph replay: one stream at a
    time). ``"cuda"`` and ``"cuda:<current>"`` name the same buffers."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (p, str(device))
    ws = _WS.get(key)
    if ws is None:
        ql = torch.empty(p.m, p.heads, p.kv_lora, dtype=torch.bfloat16, device=device)
        if p.ll_parts:  # epochs start at 1: zeros are never this launch's
            part = torch.zeros(p.batch, p.psplits, ROWS, p.part_words, dtype=torch.int32,
                               device=device)  # fmt: skip
        else:
            part = torch.empty(p.batch, p.psplits, ROWS, p.kv_lora + 4, dtype=torch.float32,
                               device=device)  # fmt: skip
        cnt = torch.zeros(NCNT, dtype=torch.int32, device=device)
        trace = torch.zeros(p.grid, NTRACE, dtype=torch.int64, device=device)
        ws = _WS[key] = (ql, part, cnt, trace)
    return ws


def trace_summary(p: MLASplitPlan, device) -> dict:
    """The last traced launch's timeline (host sync; ``trace`` plans), in us from the first
    CTA's start: per phase the items' start, the marks of :data:`TRACE_MARKS` (``prewait``: the
    work before the wait done; ``waited``: the wait over; then the phase's own steps) and end
    (min / median / max), in time order, and the launch's span. Items that wrote no row (a plan
    without ``trace``) make it empty."""
    tr = workspace(p, device)[3].cpu()
    if not p.trace or int(tr[:, 1].min()) == 0:
        return {}
    t0 = int(tr[:, 1].min())
    out = {"span_us": round((int(tr[:, 3].max()) - t0) / 1e3, 1)}
    A = p.a_ctas
    bounds = {"abs": (0, A), "att": (A, A + p.n_att), "uv": (A + p.n_att, p.grid)}
    if p.fused:
        bounds.pop("abs")
    for name, (lo, hi) in bounds.items():
        rows = tr[lo:hi]
        marks = TRACE_MARKS[name]
        cols = [(1, "start")]
        cols += [(7, marks[7])] if 7 in marks else []
        cols += [(2, "waited")] if name != "abs" else []
        cols += [(c, marks[c]) for c in (4, 5, 6) if c in marks] + [(3, "end")]
        for col, what in cols:
            if int(rows[:, col].min()) == 0:  # a mark this build did not write
                continue
            v = (rows[:, col] - t0).double() / 1e3
            out[f"{name}_{what}"] = (
                f"{v.min().item():.1f}/{v.median().item():.1f}/{v.max().item():.1f}"
            )
    # the three attention items that ended last (the W_UV phase waits for the last one):
    # item (sequence, group, split): start / waited / keys done / end, us
    att = tr[A : A + p.n_att]
    if len(att):
        last = []
        for i in att[:, 3].argsort(descending=True)[:3].tolist():
            b, g, s = i // p.psplits, (i // p.splits) % p.groups, i % p.splits
            t = [(int(att[i, c]) - t0) / 1e3 for c in (1, 2, 5, 3)]
            last.append(f"b{b}g{g}s{s}@" + "/".join(f"{x:.1f}" for x in t))
        out["att_last"] = " ".join(last)
    return out


def error_word(p: MLASplitPlan, device) -> int:
    """The plan's error word (host sync): 0, or the counter a wait gave up on (C_ABS / C_ATT)."""
    return int(workspace(p, device)[2][C_ERR].item())


def mla_decode_split(cfg, w: dict, a, q, g, kv_cache, out, tokens: int,
                     q_raw: bool = False) -> None:  # fmt: skip
    """One launch; writes ``out [B*T, heads*v]`` and the T new cache rows (BF16 cache).
    ``q_raw``: ``q`` was projected from the raw ``q_a`` with the norm weight folded into q_b
    (:attr:`MLASplitPlan.qnorm`): the kernel applies ``q_a``'s rstd to the scores."""
    if kv_cache.dtype != torch.bfloat16:
        raise NotImplementedError(f"mla_decode_split: BF16 latent cache only, got {kv_cache.dtype}")
    if q.data_ptr() % 16:
        raise ValueError("mla_decode_split: q must be 16-byte aligned")
    if a.stride(1) != 1 or g.stride(1) != 1:
        raise ValueError(f"mla_decode_split: a and g need unit column strides, got "
                         f"{tuple(a.stride())} and {tuple(g.stride())}")  # fmt: skip
    plan = plan_for(cfg, a.shape[0] // tokens, tokens)
    lda = int(a.stride(0)) if a.stride(0) != plan.a_width else 0
    ldg = int(g.stride(0)) if g.stride(0) != plan.heads * plan.v_dim else 0
    if lda or ldg:  # column slices of one wider buffer (DECODESCOPE_WIDE_AG)
        plan = dataclasses.replace(plan, lda=lda, ldg=ldg)
    if q_raw:  # DECODESCOPE_WIDE_QNORM
        plan = dataclasses.replace(plan, qnorm=1)
    fn = compile_plan(plan)
    ql, part, cnt, trace = workspace(plan, a.device)
    fn(a, q, g, w["kv_a_norm"], w["w_uk"], w["w_uv"], kv_cache, ql, part, cnt, trace, out)
