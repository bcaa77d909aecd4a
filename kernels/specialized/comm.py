"""Peer-memory plumbing for the fused two-GPU reductions (o_proj and the MoE back end).

Host side: :class:`PeerWorkspace`, one per fused-kernel kind per rank: a torch symmetric-memory
allocation (``torch.distributed._symmetric_memory.empty`` + ``rendezvous``) holding the flags and
the double-buffered receive tiles, the peer's view of the same allocation (``get_buffer(peer,
...)``: its flags and receive tiles, which this rank's kernel *writes* over NVLink), and two
local counters (the epoch and the CTA arrival counter). Device side: the system-scope
synchronization the kernels use, as inline PTX (``ld.acquire.sys``, ``st.release.sys``,
``fence.acq_rel.sys``), a bounded spin and an L2 prefetch of a byte range.

The protocol (every fused-reduction kernel follows it; the kernels' docstrings name it):

- ``epoch`` (int32, local) counts the launches that used this workspace on this rank. Every CTA
  reads it after ``griddepcontrol.wait``; each CTA then adds 1 to the arrival counter
  (acq_rel, gpu scope); the CTA that arrives last (old value = grid - 1) writes ``epoch + 1`` and
  resets the counter to 0. Every CTA of one launch therefore sees the same ``e``, and the next
  launch (which starts after this one has completed: stream order, and ``griddepcontrol.wait``
  under PDL) sees ``e + 1``. Both ranks launch the same sequence of kernels on their workspaces
  (the same step, the same graph), so launch number ``e`` on rank A pairs with launch ``e`` on
  rank B. No host argument changes between graph replays.
- In launch ``e``, CTA ``b`` writes its partial tile into the *peer's* ``recv[e % 2]`` (plain
  stores over NVLink; ``recv[p]`` is a flat FP32 area laid out by the kernel, e.g. the peer's
  partial output as [M, N]), every thread of the CTA passes ``bar.sync``, then thread 0 issues
  ``fence.acq_rel.sys`` and ``st.release.sys`` of ``e + 1`` into the peer's ``flags[b]``. It then
  spins on its *own* ``flags[b'']`` (the peer's flag(s) for the tile(s) it needs) with
  ``ld.acquire.sys`` until the value is ``>= e + 1`` (signed difference), passes ``bar.sync``,
  and the CTA reads those tiles of its own ``recv[e % 2]`` (after the flag: nothing of this
  launch cached them in L1 before, and L1 holds nothing across kernel launches).

Why it is safe (A and B the two ranks; the same argument holds with the names swapped):

1. *The data is there when read.* A reads its tiles of ``recv[e % 2]`` after observing flag ``>= e + 1``,
   which B releases only after its writes of launch ``e`` to that tile (bar.sync orders the
   CTA's stores before thread 0's release; the release is at system scope and A's acquire is at
   system scope: the stores happen-before A's loads). A flag ``>= e + 1`` cannot come from an
   *earlier* launch (flags only grow and launch ``e' < e`` writes ``e' + 1 <= e``).
2. *A rank one launch ahead never overwrites unread data.* B's launch ``e + 1`` writes
   ``recv[(e + 1) % 2]`` (the other half) and may raise A's flag to ``e + 2`` before A's CTA has
   looked (hence ``>=``, not ``==``). For B to write ``recv[e % 2]`` again it must run launch
   ``e + 2``, which starts only after B's launch ``e + 1`` has completed, which needed A's
   flags of launch ``e + 1``, which A writes only in its launch ``e + 1``, which starts after A's
   launch ``e`` completed, reads included. So B is at most one launch ahead, and the parity
   keeps that one launch on the other half.
3. *Graph replay and back-to-back layers.* Nothing depends on host arguments: ``e`` lives on
   the device and advances once per launch, on both ranks alike, whichever layer's weights the
   launch uses; the receive slots hold up to one launch's tiles whatever its grid. Grids of
   different sizes may share a workspace: a slot the current launch does not use keeps an older
   flag that only later launches (with larger ``e``) look at.
4. *Zeroing.* Flags, receive tiles and counters are zeroed, then ``torch.cuda.synchronize`` and a
   process-group barrier run before either rank's first launch: no peer write can precede the
   zeroing.
5. *No hang.* The spin gives up after ``SPIN_TIMEOUT_NS`` of the global timer, sets the
   local ``error`` word to the flag it waited for and goes on (the output is then wrong, never a
   dead GPU); :meth:`PeerWorkspace.check` raises if it is set.

The kernels must run on both ranks in the same order, each launch exactly once per rank
(a kernel run on one rank alone hangs its CTAs until the timeout).

The LL protocol (the default since the H200 run s6r2 showed it correct and faster;
``DECODESCOPE_TP2_PROTO=flag`` selects the flag protocol above, ``auto`` LL for the MoE back end
and for o_proj up to ``AUTO_LL_MAX_M`` tokens, flag above). Every 8-byte store to the peer carries 4 bytes of
payload (an FP32 partial) and 4 bytes of flag (``e + 1``) in one ``st.relaxed.sys.global.b64``
(single-copy atomic: an aligned 64-bit scalar access); the receiver polls the word itself with
``ld.relaxed.sys.global.b64`` until its high half equals ``e + 1`` and takes the low half. No
separate flag store, no ``fence.acq_rel.sys`` between data and flag: one NVLink crossing. The
words live in their own symmetric area ``ll[2][RECV_FLOATS]`` (int64), never written by
flag-protocol kernels (a raw FP32 there could read as a flag). Safety:

1. A word whose flag is ``e + 1`` was written in launch ``e`` (launch ``e'`` writes ``e' + 1``;
   ``e + 1`` is unique), and its payload came in the same single-copy-atomic store.
2. The parity argument of the flag protocol holds unchanged: the peer writes ``ll[e % 2]`` again
   only in launch ``e + 2``, which needs this rank's words of launch ``e + 1``, written after
   this rank's launch ``e`` (reads included) completed. So a word this launch waits for is never
   overwritten before it is read, and no word of ``ll[e % 2]`` can show ``e + 3`` yet: the
   receiver waits for ``== e + 1`` exactly.
3. The epoch is the flag protocol's (``ctl[0]``, counter ``ctl[1]``), taken without blocking
   (:func:`epoch_arrive` / :func:`epoch_finish`): thread 0 adds ``1 << 32`` to ``ctl[0:2]``
   read as one 64-bit word; the old word holds the epoch (low) and the CTA's arrival order
   (high), read in one atomic step. The result is consumed only after the main loop (the
   epoch) and at the end of the CTA, where the last arriver (order ``grid - 1``) resets the
   counter and writes ``e + 1``: every CTA's arrival, which read ``e``, precedes it in the
   location's read-modify-write order. The next launch (stream order, ``griddepcontrol.wait``)
   sees ``e + 1``. Flag- and LL-protocol kernels share the epoch (each launch advances it once).
4. Zeroing and timeouts as above (the LL area is zeroed with the rest; ``e + 1 >= 1`` never
   matches a zeroed word).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import torch  # noqa: E402
from cutlass import Float32, Int32, Int64  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cutlass_dsl import dsl_user_op  # noqa: E402

from decodescope.kernels.specialized import interface as itf  # noqa: F401  (sets CUTE_DSL_ARCH)

SPIN_TIMEOUT_NS = 10_000_000_000  # 10 s of global timer before a spin gives up: more than
# the ranks' compile-time skew before a fused kernel's first launch (2 s was not, run s6r2)
LINE = 128  # bytes per L2 prefetch


# -- device side: system-scope synchronization as inline PTX ----------------------------------


def _ptr(p, loc, ip):
    return p.to_llvm_ptr(loc=loc, ip=ip) if hasattr(p, "to_llvm_ptr") else p


def _ir(ty, x, loc, ip):
    """``x`` converted to the DSL type ``ty``, as an IR value."""
    return ty(x).ir_value(loc=loc, ip=ip)


def _asm(ty, args, asm, constraints, loc, ip, side_effects=True):
    """One AT&T-dialect inline PTX statement over the IR values ``args``; its result wrapped in
    ``ty`` (a DSL numeric type; None: no result)."""
    v = llvm.inline_asm(
        None if ty is None else ty.mlir_type,
        args,
        asm,
        constraints,
        has_side_effects=side_effects,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    return None if ty is None else ty(v)


@dsl_user_op
def ld_acquire_sys(ptr, *, loc=None, ip=None) -> Int32:
    """``ld.acquire.sys.global.b32``: a flag another GPU releases."""
    asm = "ld.acquire.sys.global.b32 $0, [$1];"
    return _asm(Int32, [_ptr(ptr, loc, ip)], asm, "=r,l,~{memory}", loc, ip)


@dsl_user_op
def st_release_sys(ptr, val, *, loc=None, ip=None) -> None:
    """``st.release.sys.global.b32``: raise a flag another GPU acquires."""
    args = [_ptr(ptr, loc, ip), _ir(Int32, val, loc, ip)]
    _asm(None, args, "st.release.sys.global.b32 [$0], $1;", "l,r,~{memory}", loc, ip)


@dsl_user_op
def fence_acq_rel_sys(*, loc=None, ip=None) -> None:
    """``fence.acq_rel.sys``."""
    _asm(None, [], "fence.acq_rel.sys;", "~{memory}", loc, ip)


@dsl_user_op
def global_timer_ns(*, loc=None, ip=None) -> Int64:
    """``mov.u64 %globaltimer``."""
    return _asm(Int64, [], "mov.u64 $0, %globaltimer;", "=l", loc, ip)


@cute.jit
def wait_flag(flag_ptr, target: Int32, err_ptr) -> None:
    """Spin (one thread) until ``*flag_ptr - target >= 0``; after ``SPIN_TIMEOUT_NS`` record
    ``target`` in ``*err_ptr`` and return. Once a spin has timed out (``*err_ptr`` set) later
    ones return at once: a desynchronized pair costs one timeout, not one per launch."""
    v = ld_acquire_sys(flag_ptr)
    if v - target < 0 and cute.arch.load(err_ptr, Int32, sem="relaxed", scope="gpu") == 0:
        t0 = global_timer_ns()
        going = True
        while going:
            v = ld_acquire_sys(flag_ptr)
            if v - target >= 0:
                going = False
            elif global_timer_ns() - t0 > Int64(SPIN_TIMEOUT_NS):
                cute.arch.store(err_ptr, target)
                going = False


@cute.jit
def begin_epoch(mCtl: cute.Tensor, nctas: cutlass.Constexpr[int], sEpoch: cute.Tensor) -> None:
    """Every CTA: read the launch's epoch ``mCtl[0]`` into ``sEpoch[0]`` (thread 0), arrive on
    ``mCtl[1]``; the last CTA to arrive advances the epoch and resets the counter (see the module
    docstring). Ends with ``bar.sync``: ``sEpoch[0]`` is valid for the whole CTA."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        e = cute.arch.load(mCtl.iterator, Int32, sem="relaxed", scope="gpu")
        sEpoch[0] = e
        cute.arch.fence_acq_rel_gpu()
        old = cute.arch.atomic_add(mCtl.iterator + 1, Int32(1), sem="acq_rel", scope="gpu")
        if old == nctas - 1:
            cute.arch.store(mCtl.iterator + 1, Int32(0), sem="relaxed", scope="gpu")
            cute.arch.store(mCtl.iterator, e + 1, sem="relaxed", scope="gpu")
    cute.arch.sync_threads()


@cute.jit
def release_to_peer(mPeerFlags: cute.Tensor, slot, value: Int32) -> None:
    """Thread 0, after the CTA's stores to the peer and a ``bar.sync``: make them visible at
    system scope, then raise the peer's ``flags[slot]`` to ``value``."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx == 0:
        fence_acq_rel_sys()
        st_release_sys(mPeerFlags.iterator + slot, value)


@cute.jit
def prefetch_range(mP: cute.Tensor, n, part, nparts: cutlass.Constexpr[int],
                   nthreads: cutlass.Constexpr[int]) -> None:  # fmt: skip
    """Issue ``prefetch.global.L2`` for share ``part`` of ``nparts`` of the ``n`` bf16 elements
    that start at ``mP``'s base (the next op's weights; ``n`` is a runtime count, ``mP`` only
    carries the address), one 128-byte line per thread and step. ``n = 0``: nothing."""
    per_line = LINE // 2
    lines = (n + per_line - 1) // per_line
    share = (lines + nparts - 1) // nparts
    tidx, _, _ = cute.arch.thread_idx()
    l0 = part * share
    for i in cutlass.range((share + nthreads - 1) // nthreads, unroll=1):
        li = l0 + i * nthreads + tidx
        if li < lines and li < l0 + share:
            cute.arch.prefetch((mP.iterator + li * per_line).llvm_ptr, cache_level="L2")


# -- device side: the LL protocol ----------------------------------------------------------------


@dsl_user_op
def st_ll(ptr, val, flag, *, loc=None, ip=None) -> None:
    """``st.relaxed.sys.global.b64`` of ``{val (FP32, low half), flag (high half)}`` at ``ptr``
    (an int64 element of a peer's LL area): payload and flag in one single-copy-atomic store."""
    args = [_ptr(ptr, loc, ip), _ir(Float32, val, loc, ip), _ir(Int32, flag, loc, ip)]
    asm = "{ .reg .b64 w; mov.b64 w, {$1, $2}; st.relaxed.sys.global.b64 [$0], w; }"
    _asm(None, args, asm, "l,f,r,~{memory}", loc, ip)


@dsl_user_op
def ld_ll(ptr, *, loc=None, ip=None) -> Int64:
    """``ld.relaxed.sys.global.b64``: one LL word (payload low, flag high) the peer stores."""
    asm = "ld.relaxed.sys.global.b64 $0, [$1];"
    return _asm(Int64, [_ptr(ptr, loc, ip)], asm, "=l,l,~{memory}", loc, ip)


@dsl_user_op
def hi32(w, *, loc=None, ip=None) -> Int32:
    """High half of a 64-bit word (an LL word's flag, the epoch word's arrival count). An
    opaque instruction: the compiler neither hoists it nor the uses behind it, so a register
    still in flight (an atomic's result) is waited for only here."""
    asm = "{ .reg .b32 lo; mov.b64 {lo, $0}, $1; }"
    return _asm(Int32, [_ir(Int64, w, loc, ip)], asm, "=r,l", loc, ip)


@dsl_user_op
def lo32(w, *, loc=None, ip=None) -> Int32:
    """Low half of a 64-bit word (the epoch word's epoch); opaque like :func:`hi32`."""
    asm = "{ .reg .b32 hi; mov.b64 {$0, hi}, $1; }"
    return _asm(Int32, [_ir(Int64, w, loc, ip)], asm, "=r,l", loc, ip)


@dsl_user_op
def ll_value(w, *, loc=None, ip=None) -> Float32:
    """Low half of an LL word, as FP32."""
    asm = "{ .reg .b32 hi; mov.b64 {$0, hi}, $1; }"
    return _asm(Float32, [_ir(Int64, w, loc, ip)], asm, "=f,l", loc, ip, side_effects=False)


@dsl_user_op
def atom_add_u64(ptr, val, *, loc=None, ip=None) -> Int64:
    """``atom.relaxed.gpu.global.add.u64``: the old 64-bit value."""
    args = [_ptr(ptr, loc, ip), _ir(Int64, val, loc, ip)]
    asm = "atom.relaxed.gpu.global.add.u64 $0, [$1], $2;"
    return _asm(Int64, args, asm, "=l,l,l,~{memory}", loc, ip)


@cute.jit
def wait_ll(ptr, flag: Int32, err_ptr) -> Float32:
    """Poll the LL word at ``ptr`` (this thread alone) until its flag is ``flag``; return its
    payload. After ``SPIN_TIMEOUT_NS`` record ``flag`` in ``*err_ptr`` and return the payload
    as it is (wrong, never a hang); once ``*err_ptr`` is set later waits return at once."""
    return settle_ll(ptr, ld_ll(ptr), flag, err_ptr)


@cute.jit
def settle_ll(ptr, w, flag: Int32, err_ptr) -> Float32:
    """:func:`wait_ll` on a word ``w`` already loaded from ``ptr`` (:func:`ld_ll`): a thread
    issues the loads of all the words it needs first (their round trips overlap) and settles
    them one by one after; only a word not yet arrived is polled again."""
    if hi32(w) != flag and cute.arch.load(err_ptr, Int32, sem="relaxed", scope="gpu") == 0:
        t0 = global_timer_ns()
        going = True
        while going:
            w = ld_ll(ptr)
            if hi32(w) == flag:
                going = False
            elif global_timer_ns() - t0 > Int64(SPIN_TIMEOUT_NS):
                cute.arch.store(err_ptr, flag)
                going = False
    return ll_value(w)


@cute.jit
def wait_local(flag_ptr, target: Int32, err_ptr) -> None:
    """Spin (this thread) with ``ld.acquire.gpu`` until ``*flag_ptr == target`` (a flag another
    CTA of this GPU raises with ``st.release.gpu``); timeout as :func:`wait_flag`."""
    v = cute.arch.load(flag_ptr, Int32, sem="acquire", scope="gpu")
    if v != target and cute.arch.load(err_ptr, Int32, sem="relaxed", scope="gpu") == 0:
        t0 = global_timer_ns()
        going = True
        while going:
            v = cute.arch.load(flag_ptr, Int32, sem="acquire", scope="gpu")
            if v == target:
                going = False
            elif global_timer_ns() - t0 > Int64(SPIN_TIMEOUT_NS):
                cute.arch.store(err_ptr, target)
                going = False


@cute.jit
def epoch_arrive(mCtl: cute.Tensor) -> Int64:
    """Thread 0 only: arrive on the launch's epoch word, ``ctl[0:2]`` read as one 64-bit word
    (low half ``ctl[0]``, the epoch; high half ``ctl[1]``, the arrival counter), by one relaxed
    64-bit atomic add of ``1 << 32``. The old word gives the epoch (:func:`lo32`) and this CTA's
    arrival order (:func:`hi32`) consistently: no separate load, no fence. Nothing waits for
    the atomic until those are used; pass the word to :func:`epoch_finish` at the end."""
    return atom_add_u64(mCtl.iterator, Int64(1 << 32))


@cute.jit
def epoch_finish(mCtl: cute.Tensor, word, nctas: cutlass.Constexpr[int]) -> None:
    """Thread 0, last thing of the CTA: the last arriver resets the counter and advances the
    epoch (every CTA of the launch has arrived, hence read the epoch, before: one location's
    read-modify-writes are totally ordered)."""
    if hi32(word) == nctas - 1:
        cute.arch.store(mCtl.iterator + 1, Int32(0), sem="relaxed", scope="gpu")
        cute.arch.store(mCtl.iterator, lo32(word) + 1, sem="relaxed", scope="gpu")


# -- host side ----------------------------------------------------------------------------------

FLAG_SLOTS = 1024  # CTAs per launch at most
PREFETCH_HEAD = 16  # bf16 elements of the prefetch address argument
_PH: dict[str, torch.Tensor] = {}
RECV_FLOATS = 64 * 16384  # FP32 per parity: 64 tokens x (7168 + 3584 + spare)
DONE_OFF = 8  # ctl[8 + j]: the LL MoE back end's local "slice j reduced" flags
CTL_WORDS = DONE_OFF + FLAG_SLOTS  # epoch, arrival counter, error word, spare x5, done flags
PROTOS = ("flag", "ll")  # the kernels' protocols
PROTO_CHOICES = (*PROTOS, "auto")  # auto: ll for the MoE back end and o_proj up to AUTO_LL_MAX_M
AUTO_LL_MAX_M = 16  # tokens; above, LL's 8-byte words (half payload) double o_proj's NVLink bytes
PROTO_ENV = "DECODESCOPE_TP2_PROTO"


PROTO_DEFAULT = "ll"  # since run s6r2 (two H200): every LL row PASS, o_proj comm 5.18 us vs 12.7


def proto_default() -> str:
    """The fused reductions' protocol: ``$DECODESCOPE_TP2_PROTO`` (``ll``, the default,
    ``flag`` or ``auto``)."""
    v = os.environ.get(PROTO_ENV, PROTO_DEFAULT).strip().lower() or PROTO_DEFAULT
    if v not in PROTO_CHOICES:
        raise ValueError(f"comm: {PROTO_ENV}={v!r}: expected one of {', '.join(PROTO_CHOICES)}")
    return v


def resolve_proto(proto: str | None, kind: str, m: int) -> str:
    """The kernel protocol (``flag`` / ``ll``) of a launch of ``kind`` (``oproj`` / ``moe``) at
    ``m`` tokens: ``proto`` (None: :func:`proto_default`), ``auto`` resolved."""
    p = proto_default() if proto is None else proto
    if p not in PROTO_CHOICES:
        raise ValueError(f"comm: protocol {p!r}: expected one of {', '.join(PROTO_CHOICES)}")
    if p == "auto":
        return "ll" if kind == "moe" or m <= AUTO_LL_MAX_M else "flag"
    return p


@dataclass
class PeerWorkspace:
    """One rank's half of a fused reduction's buffers (see the module docstring).

    ``flags`` / ``recv``: this rank's symmetric allocation (the peer writes them);
    ``peer_flags`` / ``peer_recv``: the peer's (this rank writes them); ``ctl`` int32
    [CTL_WORDS]: epoch, arrival counter, error word, spares, the LL MoE kernel's done flags.
    ``recv`` is [2, RECV_FLOATS] FP32; ``ll`` / ``peer_ll`` the LL protocol's [2, RECV_FLOATS]
    int64 words (payload + flag); ``red`` a local [RECV_FLOATS] FP32 area for reduced values.
    One workspace serves every fused kernel of the process (they run in one stream order)."""

    rank: int
    world: int
    flags: torch.Tensor
    recv: torch.Tensor
    peer_flags: torch.Tensor
    peer_recv: torch.Tensor
    ctl: torch.Tensor
    handle: object = None
    ll: torch.Tensor | None = None
    peer_ll: torch.Tensor | None = None
    red: torch.Tensor | None = None

    @classmethod
    def create(
        cls,
        group=None,
        slots: int = FLAG_SLOTS,
        recv_floats: int = RECV_FLOATS,
        device: torch.device | None = None,
    ) -> PeerWorkspace:
        """Collective: every rank of ``group`` (two ranks) calls it at the same point."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm

        group = group or dist.group.WORLD
        world = dist.get_world_size(group)
        if world != 2:
            raise ValueError(f"comm.PeerWorkspace: the fused reductions are two-rank, got {world}")
        rank = dist.get_rank(group)
        dev = device or torch.device("cuda", torch.cuda.current_device())
        n_flag = -(-slots // 32) * 32  # int32 words, keeps recv 128-byte aligned
        n_recv = 2 * recv_floats
        n_ll = 2 * 2 * recv_floats  # int32 words of the [2, recv_floats] int64 LL area
        buf = symm.empty(n_flag + n_recv + n_ll, dtype=torch.int32, device=dev)
        handle = symm.rendezvous(buf, group)
        buf.zero_()
        peer = 1 - rank

        def views(r: int):
            f = handle.get_buffer(r, (slots,), torch.int32, 0)
            v = handle.get_buffer(r, (2, recv_floats), torch.float32, n_flag)
            ll = handle.get_buffer(r, (n_ll,), torch.int32, n_flag + n_recv)
            return f, v, ll.view(torch.int64).view(2, recv_floats)

        flags, recv, ll = views(rank)
        peer_flags, peer_recv, peer_ll = views(peer)
        ctl = torch.zeros(CTL_WORDS, dtype=torch.int32, device=dev)
        red = torch.zeros(recv_floats, dtype=torch.float32, device=dev)
        torch.cuda.synchronize(dev)
        dist.barrier(group=group)
        return cls(rank, world, flags, recv, peer_flags, peer_recv, ctl, handle, ll, peer_ll, red)

    def check(self) -> None:
        """Raise if a spin timed out (host sync)."""
        err = int(self.ctl[2].item())
        if err:
            raise RuntimeError(
                f"comm: rank {self.rank} waited over {SPIN_TIMEOUT_NS / 1e9:.0f} s for the "
                f"peer's flag of epoch {err - 1}: the ranks launched different kernel sequences"
            )

    def reset(self, group=None) -> None:
        """Collective: zero flags, receive areas and counters on both ranks (after a timeout
        left the pair out of step)."""
        import torch.distributed as dist

        torch.cuda.synchronize()
        dist.barrier(group=group)
        self.flags.zero_()
        self.recv.zero_()
        if self.ll is not None:
            self.ll.zero_()
        self.ctl.zero_()
        torch.cuda.synchronize()
        dist.barrier(group=group)

    @staticmethod
    def prefetch_args(t: torch.Tensor | None, device) -> tuple[torch.Tensor, int]:
        """``(head, n)`` for a kernel's prefetch parameters: a [PREFETCH_HEAD] bf16 view at the
        base of ``t`` (the address) and its length in bf16 elements (the runtime count)."""
        if t is None:
            key = str(device)
            if key not in _PH:
                _PH[key] = torch.zeros(PREFETCH_HEAD, dtype=torch.bfloat16, device=device)
            return _PH[key], 0
        if not t.is_contiguous():
            raise ValueError("prefetch: the next op's weights must be one contiguous tensor")
        nbytes = t.numel() * t.element_size()
        if nbytes < 2 * PREFETCH_HEAD or t.data_ptr() % 16:
            raise ValueError(
                f"prefetch: need a 16-byte aligned tensor of at least {2 * PREFETCH_HEAD} bytes"
            )
        flat = t.view(-1).view(torch.uint8)[: nbytes // 2 * 2].view(torch.bfloat16)
        return flat[:PREFETCH_HEAD], nbytes // 2

    def args(self) -> tuple[torch.Tensor, ...]:
        """The flag-protocol kernels' workspace arguments, in their order."""
        return (self.flags, self.recv, self.peer_flags, self.peer_recv, self.ctl)

    def args_ll(self) -> tuple[torch.Tensor, ...]:
        """The LL-protocol kernels' workspace arguments, in their order."""
        return (self.ll, self.peer_ll, self.red, self.ctl)


def fake_workspace_args(slots: int = FLAG_SLOTS, recv_floats: int = RECV_FLOATS) -> tuple:
    """Fake tensors of a workspace (flags, recv, peer_flags, peer_recv, ctl) for compiling."""
    flags = itf.fake(torch.int32, (slots,))
    recv = itf.fake(torch.float32, (2, recv_floats))
    return (
        flags,
        recv,
        itf.fake(torch.int32, (slots,)),
        itf.fake(torch.float32, (2, recv_floats)),
        itf.fake(torch.int32, (CTL_WORDS,)),
    )


def fake_workspace_args_ll(recv_floats: int = RECV_FLOATS) -> tuple:
    """Fake tensors of a workspace's LL arguments (ll, peer_ll, red, ctl) for compiling."""
    return (
        itf.fake(torch.int64, (2, recv_floats)),
        itf.fake(torch.int64, (2, recv_floats)),
        itf.fake(torch.float32, (recv_floats,)),
        itf.fake(torch.int32, (CTL_WORDS,)),
    )
