"""Streaming GEMV for 1..4 tokens: ``out[m, n] = sum_k x'[m, k] * W[n, k]``, the weights read
once at near-HBM speed, the (normalized) activations from shared memory.

Why (issue #5, batch 1): :mod:`.skinny_gemm` at one token reaches 2.6 TB/s on the 90 MB KDA
in_proj (cuBLAS 3.3): each of its warps walks a chain of per-chunk L2 round trips for the
activations plus the norm math, and keeps only ~32 KB per CTA in flight. Here, per CTA:

- **Tile**: ``warps`` x ``rows`` consecutive weight rows (each warp owns ``rows`` of them), all
  tokens, all of K. Within a warp, lanes split K: lane ``l`` reads the 16-byte pieces at
  columns ``(32 i + l) * 8 .. + 7`` (``i < K / 256``), so one warp-wide load covers 512
  contiguous bytes of a row. Each lane keeps an 8-wide FP32 accumulator per (row, token),
  summed at the end, then a butterfly shuffle sums the 32 lanes; lane 0 stores.
- **Deep in-flight loads**: a warp's loads are walked in groups of ``group`` pieces x
  ``rows`` rows; group ``g + depth`` is issued (16-byte ``ld.global`` into registers) before
  group ``g`` is consumed, so ``depth x group x rows`` loads per lane (512 B per warp each) are
  in flight at all times; the first ``depth`` groups are issued before the PDL wait (the
  weights never come from the previous kernel) and stream during the norm prologue. The loop
  is fully unrolled at trace time (K / 256 <= 28 pieces).
- **Activations once per CTA**: the prologue copies ``x`` (and ``r``) into shared memory by
  ``cp.async`` (every piece in flight at once: one L2 round trip), forms ``bf16(x + r)`` with
  ``add_residual`` (CTA 0 writes it as the new residual stream) in ``[M, K]`` BF16 (14 KB per
  token), computes each token's rstd with one block reduction, and rewrites its own pieces
  normalized, ``bf16(bf16(h * rstd) * w_norm)`` (vLLM's ``fused_add_rms_norm``
  rounding, as :func:`.skinny_gemm.skinny_gemm_ref`). The main loop then reads 16-byte
  activation pieces from shared memory only: no L2 round trip on its critical path.
- **Whole-slice L2 prefetch** (``l2_all``): before the PDL wait, each warp issues one
  ``cp.async.bulk.prefetch.L2`` per weight row it owns (the whole row), so a small projection
  (o_proj 22 MB, q_b 7 MB at TP8) streams into L2 while a light previous kernel (KDA decode:
  12 CTAs, MLA decode) runs, and is then read from L2. Useful only if the grid is resident at
  once (:meth:`GemvPlan.resident_estimate`).
- **Epilogue**: ``bf16(acc)``, or with ``residual_epilogue`` ``bf16(bf16(acc) + res)`` (o_proj
  writing the residual stream; ``res`` may alias the output: same thread reads then writes).
- Several weights ("segments", MLA's qkv_a and g_proj) in one launch: the grid is the
  concatenation of their CTAs.

Selection: :mod:`.skinny_gemm` (``DECODESCOPE_SKINNY_GEMV``, default 1: one-token plans) routes
the plans it supports here, the dense MLP's too (``DECODESCOPE_GEMV_EXT``, default 1: the SiTU
epilogue, each warp holding gate rows and their up rows, and K with a tail past the last
multiple of 256, loaded clamped against zero-padded activations); :class:`GemvStreamBack` is
the LatentMoE back on the same main loop (``DECODESCOPE_MOE_BACK=gemv``, opt-in); the knobs (warps / rows / group / depth) come from ``DECODESCOPE_GEMV_CFG``
(``w8r2g2d2``; unset or ``auto``: :func:`tuned_cfg`, the measured set or :func:`auto_cfg`; suffix ``n``: the weights by
``ld.global.nc.L1::no_allocate.L2::256B``; suffix ``x``: the prologue's x / r by register
loads instead of ``cp.async``) or the sweep's explicit values. ``DECODESCOPE_GEMV_TUNED``: a
file of measured sets that overrides and extends the built-in ``TUNED`` (what the sweep's
``--write-tuned`` writes: tune on your own GPU), ``0`` for none (the A/B against
:func:`auto_cfg`). Compile key: the plan (every shape static).
"""

# no `from __future__ import annotations`: the Smem struct reads its field annotations
import os
import re
from dataclasses import dataclass, field

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32, Int32, Int64

from decodescope.kernels.specialized import env_knobs as knob
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import mma_common as mc
from decodescope.kernels.specialized import skinny_gemm as sg
from decodescope.kernels.specialized.moe_common import situ as situ_fn
from decodescope.kernels.specialized.utils import load_vec8, pdl_begin, pdl_enabled, warp_sum

PIECE = 8  # BF16 per 16-byte load
KSTEP = 32 * PIECE  # K columns covered by one warp-wide load (512 bytes)
MAX_M = 4
CFG_ENV = "DECODESCOPE_GEMV_CFG"
DEFAULT_CFG = (8, 2, 2, 2)  # warps, rows per warp, pieces per group, groups in flight
CFG_MAX = (32, 8, 32, 8)  # the largest warps, rows, group, depth a plan takes
AUTO_CTAS_PER_SM = 2  # "auto": rows per warp so that the grid fits this many CTAs per SM
AUTO_LOADS = 4  # "auto": rows x group, loads per lane in one group
NUM_SMS = 132  # H200
SM_SMEM = 227 * 1024  # usable shared memory per SM (H200), 1 KB reserved per CTA
SM_REGS = 64 * 1024


_CFG_RE = re.compile(r"(?:auto|w(\d+)r(\d+)g(\d+)d(\d+))([nx]*)")


def _match(v: str) -> re.Match:
    mt = _CFG_RE.fullmatch(v.strip())
    if not mt:
        raise ValueError(f"{CFG_ENV}={v!r}: expected auto or wWrRgGdD, optional suffixes n / x, "
                         "e.g. w8r2g2d2, auton")  # fmt: skip
    return mt


def parse_cfg(v: str) -> tuple[int, int, int, int] | None:
    """``w8r2g2d2`` -> (warps, rows, group, depth); ``auto``: None (:func:`auto_cfg`).
    Suffixes (:func:`parse_ld`, :func:`parse_xload`) are allowed."""
    mt = _match(v)
    return None if mt.group(1) is None else tuple(int(g) for g in mt.groups()[:4])  # type: ignore[return-value]


def parse_ld(v: str) -> str:
    """The weight loads of a knob string: ``nc`` with suffix ``n``
    (``ld.global.nc.L1::no_allocate.L2::256B``), else ``plain`` (``ld.global``)."""
    return "nc" if "n" in _match(v).group(5) else "plain"


def parse_xload(v: str) -> str:
    """The prologue's activation loads of a knob string: ``regs`` with suffix ``x``, else
    ``async`` (``cp.async`` into shared memory)."""
    return "regs" if "x" in _match(v).group(5) else "async"


def _env() -> str:
    return os.environ.get(CFG_ENV, "") or "auto"


def env_ld() -> str:
    return parse_ld(_env())


def env_xload() -> str:
    return parse_xload(_env())


def env_cfg() -> tuple[int, int, int, int] | None:
    """``DECODESCOPE_GEMV_CFG`` (unset or ``auto...``: None, :func:`tuned_cfg` per plan)."""
    return parse_cfg(_env())


# Knob sets measured best per shape (H200 s10/r2, kimi-k3 TP8, kernel alone, graph medians,
# notes/gpu-logs/s10/r2/b/gemv): (m, k, segments) -> (warps, rows, group, depth). Other shapes
# (TP16, M > 1): auto_cfg.
TUNED: dict[tuple[int, int, tuple[int, ...]], tuple[int, int, int, int]] = {
    (1, 7168, (6288,)): (8, 3, 2, 2),  # KDA in_proj: 24.1 us (auto w8r3g1d2 24.8)
    (1, 7168, (2112, 1536)): (16, 1, 4, 2),  # MLA qkv_a + g: 14.5 (auto 16.6)
    (1, 1536, (7168,)): (4, 4, 2, 2),  # o_proj: 6.6 (auto w8r4g1d2 7.6)
    (1, 1536, (2304,)): (8, 2, 2, 4),  # MLA q_b: 3.1 (auto 3.4)
    # TP16 (s26, notes/gpu-logs/s26): alone qkv_a + g 13.0 -> 12.4 us, o_proj 4.3 -> 3.9; in
    # the layer (bench, batch 1, same call) the MLA front's share 15.4 -> 10.9 us, the MLA span
    # 106.9 -> 93.5 (one CTA per SM: not resident early beside the previous latent up); o_proj
    # neutral there. The TP16 in_proj and q_b keep auto_cfg: their fastest sets alone
    # (w13r2g2d6, w8r2g2d4) lost in the layer (the KDA decode after the one-CTA-per-SM in_proj
    # +5.2 us, no longer resident early beside it; q_b's 72 CTAs +0.9)
    (1, 7168, (2112, 768)): (22, 1, 4, 3),  # MLA qkv_a + g
    (1, 768, (7168,)): (16, 2, 3, 1),  # o_proj (KDA and MLA)
    # the dense MLP (DECODESCOPE_GEMV_EXT; s29, notes/gpu-logs/s29/n1, alone, us; auto in
    # brackets): gate_up + SiTU TP8 31.6 (33.9), TP16 17.4 (19.0); down TP8 16.7 (18.3), TP16
    # 9.3 (9.5). The skinny kernel they replace: 38.3, 27.5, 30.4, 22.0
    (1, 7168, (8448,)): (4, 4, 2, 2),  # dense gate_up TP8
    (1, 7168, (4224,)): (8, 2, 2, 4),  # dense gate_up TP16
    (1, 4224, (7168,)): (16, 1, 4, 2),  # dense down TP8
    (1, 2112, (7168,)): (4, 4, 2, 2),  # dense down TP16
}


TUNED_ENV = "DECODESCOPE_GEMV_TUNED"
_TUNED_FILES: dict[tuple[str, int], dict] = {}


def load_tuned(path: str) -> dict[tuple[int, int, tuple[int, ...]], tuple[int, int, int, int]]:
    """A file of measured knob sets, as ``scripts/gpu_specialized_attn.py --gemv-only
    --write-tuned`` writes it: a JSON list of ``{"m", "k", "segments", "cfg": "wWrRgGdD"}``
    (other keys ignored). A missing or malformed file: a one-line ``ValueError`` naming the
    variable, the file and the problem. Cached per (path, modification time)."""
    where = f"{TUNED_ENV}={path!r}"
    try:
        key = (path, os.stat(path).st_mtime_ns)
    except OSError as e:
        raise ValueError(f"{where}: cannot read the file ({e.strerror})") from None
    if key in _TUNED_FILES:
        return _TUNED_FILES[key]
    import json
    from pathlib import Path

    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: not a JSON file ({e})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{where}: expected a JSON list of {{m, k, segments, cfg}} entries")
    out = {}
    for i, r in enumerate(rows):
        try:
            shape = (int(r["m"]), int(r["k"]), tuple(int(n) for n in r["segments"]))
            cfg = parse_cfg(str(r["cfg"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: entry {i}: {e}") from None
        if cfg is None or _match(str(r["cfg"])).group(5):
            raise ValueError(f"{where}: entry {i}: cfg {r['cfg']!r} must be wWrRgGdD")
        for name, v, hi in zip(("warps", "rows", "group", "depth"), cfg, CFG_MAX, strict=True):
            if not 1 <= v <= hi:
                raise ValueError(f"{where}: entry {i}: {name}={v} outside 1..{hi}")
        out[shape] = cfg
    _TUNED_FILES[key] = out
    return out


def tuned_table() -> dict[tuple[int, int, tuple[int, ...]], tuple[int, int, int, int]]:
    """The measured knob sets in force: ``TUNED`` (``DECODESCOPE_GEMV_TUNED`` unset or ``1``),
    none (``0``: :func:`auto_cfg` everywhere, the A/B), or ``TUNED`` overridden and extended by
    a file of them (any other value: its path, :func:`load_tuned`; measure your own GPU's)."""
    v = os.environ.get(TUNED_ENV, "")
    if v in ("", "1"):
        return TUNED
    if v == "0":
        return {}
    return {**TUNED, **load_tuned(v)}


def tuned_cfg(m: int, k: int, segments: tuple[int, ...]) -> tuple[int, int, int, int]:
    """:func:`tuned_table` where the shape was measured, else :func:`auto_cfg`."""
    return tuned_table().get((m, k, tuple(segments))) or auto_cfg(segments, m)


def auto_cfg(segments: tuple[int, ...], m: int = 1) -> tuple[int, int, int, int]:
    """8 warps; rows per warp (1..4) so that the grid needs at most ``AUTO_CTAS_PER_SM`` CTAs
    per SM (one wave, one prologue per CTA: TP8 in_proj 3 rows, 262 CTAs; o_proj 4, 224;
    qkv_a + g and q_b 2), at most ``4 / m`` (each (row, token) holds 8 FP32 accumulators);
    groups of ``AUTO_LOADS / rows`` pieces, 2 groups ahead."""
    warps = 8
    rows = -(-sum(segments) // (NUM_SMS * AUTO_CTAS_PER_SM * warps))
    rows = max(1, min(4 // m, rows))
    return (warps, rows, max(1, AUTO_LOADS // rows), 2)


EXT_ENV = "DECODESCOPE_GEMV_EXT"  # 1: also SiTU gate/up plans and K with a tail (the dense MLP)


def ext_enabled() -> bool:
    """``DECODESCOPE_GEMV_EXT`` (``0`` / ``1``, unset: ``EXT_DEFAULT``): whether
    :mod:`.skinny_gemm` routes here the 1-token plans that need the SiTU epilogue or a K that is
    not a multiple of 256 (the dense MLP's gate_up and down)."""
    return bool(knob.read(EXT_ENV, (0, 1), str(int(EXT_DEFAULT))))


# on since s29 (H200, bench, batch 1, dense layer span, same call: TP16 58.4 / 58.0 -> 46.2 /
# 46.3 us with auto_cfg, 44.4 with the measured sets; TP8 98.0 / 98.5 -> 81.2 / 81.6, 78.4)
EXT_DEFAULT = True


def shape_ok(m: int, k: int) -> bool:
    """Shapes the kernel can run: 1..4 tokens, K a multiple of 8 (a tail past the last multiple
    of 256 is loaded clamped and weighted by zero activations)."""
    return 1 <= m <= MAX_M and k % PIECE == 0


def supports(m: int, k: int, situ: bool = False) -> bool:
    """Plans :mod:`.skinny_gemm` routes here: 1..4 tokens and K a multiple of 256, no SiTU
    epilogue; with :func:`ext_enabled` also SiTU gate/up plans and K a multiple of 8."""
    if not shape_ok(m, k):
        return False
    if situ or k % KSTEP:
        return ext_enabled()
    return True


@dataclass(frozen=True)
class GemvPlan:
    m: int
    k: int
    segments: tuple[int, ...]
    norm: bool = False
    add_residual: bool = False
    residual_epilogue: bool = False
    x_stride: int = 0  # row stride of x in elements (0: compact)
    eps: float = 1e-5
    pdl: bool = field(default_factory=pdl_enabled)
    warps: int = DEFAULT_CFG[0]
    rows: int = DEFAULT_CFG[1]  # weight rows per warp
    group: int = DEFAULT_CFG[2]  # 16-byte pieces per lane and row in one load group
    depth: int = DEFAULT_CFG[3]  # groups issued ahead of the one consumed
    l2_all: bool = False  # prefetch the CTA's whole weight slice into L2 before the PDL wait
    ld: str = "plain"  # weight loads: "plain" ld.global, "nc" ld.global.nc.L1::no_allocate.L2::256B
    # the prologue's x (and r) loads: "async" cp.async into shared memory (all in flight at
    # once, no registers), "regs" 16-byte loads into registers
    xload: str = "async"
    # o_proj's post-attention RMSNorm in the epilogue (:class:`GemvStreamNorm`): one grid-wide
    # step (every CTA's sum of squares, a counter, then each CTA normalizes its own rows)
    norm_out: bool = False
    # L2 prefetch of the next kernels' weights before the PDL wait (:class:`GemvStreamPre`): of
    # a [pre_rows, pre_k] BF16 weight, the first ``pre_bytes`` of each of ``pre_slices`` equal
    # slices of every row (where the next kernel's warps start their K walks)
    pre_rows: int = 0
    pre_k: int = 0
    pre_slices: int = 8
    pre_bytes: int = 0
    # those prefetches with an ``evict_last`` L2 cache policy (``DECODESCOPE_OPROJ_PREFETCH_EVICT``)
    pre_last: bool = False
    # SiTU-and-mul epilogue (the dense MLP's gate_up + act): one ``[2D, K]`` gate/up segment;
    # each warp's ``rows`` are ``rows / 2`` gate rows and the matching up rows, ``out [M, D]``
    situ: bool = False
    situ_beta: float = 4.0
    situ_lbeta: float = 25.0
    # the LatentMoE back at 1..4 tokens (:class:`GemvStreamBack`): x is the routed experts' FP32
    # sum, normalized as ``bf16(x * rstd * w)``; ``out = bf16(acc + e)`` with an FP32 ``e``
    back: bool = False

    def __post_init__(self) -> None:
        if not shape_ok(self.m, self.k):
            raise ValueError(
                f"gemv_stream: needs 1..{MAX_M} tokens and K a multiple of {PIECE}, "
                f"got M={self.m}, K={self.k}"
            )
        if self.situ and (
            len(self.segments) != 1 or self.segments[0] % 2 or self.rows % 2
            or self.residual_epilogue or self.norm_out or self.pre_bytes
        ):  # fmt: skip
            raise ValueError(
                f"gemv_stream: situ needs one gate/up segment of an even number of rows, an "
                f"even number of rows per warp and no other epilogue, got segments "
                f"{self.segments}, rows {self.rows}"
            )
        if not 1 <= len(self.segments) <= 3 or any(n < 1 for n in self.segments):
            raise ValueError(f"gemv_stream: 1..3 non-empty segments, got {self.segments}")
        if self.add_residual and not self.norm:
            raise ValueError("gemv_stream: add_residual needs norm")
        if self.x_stride and (self.x_stride < self.k or self.x_stride % PIECE):
            raise ValueError(
                f"gemv_stream: x row stride {self.x_stride} must be >= K and 8-aligned"
            )
        if self.xload not in ("async", "regs"):
            raise ValueError(f"gemv_stream: xload={self.xload!r}: expected 'async' or 'regs'")
        if self.ld not in ("plain", "nc"):
            raise ValueError(f"gemv_stream: ld={self.ld!r}: expected 'plain' or 'nc'")
        if self.norm_out and (
            not self.residual_epilogue or len(self.segments) != 1 or self.norm or self.add_residual
        ):
            raise ValueError(
                "gemv_stream: norm_out needs one segment with the residual epilogue and no "
                "input norm"
            )
        if self.pre_last and not self.pre_bytes:
            raise ValueError("gemv_stream: pre_last needs a pre_bytes plan")
        if self.pre_bytes and (
            self.pre_rows < 1 or self.pre_bytes % 16 or self.pre_k % self.pre_slices
            or self.pre_bytes > self.pre_k * 2 // self.pre_slices or (self.pre_k * 2 // self.pre_slices) % 16
        ):  # fmt: skip
            raise ValueError(
                f"gemv_stream: prefetch of {self.pre_bytes} B per slice of {self.pre_slices} "
                f"slices of a [{self.pre_rows}, {self.pre_k}] weight: needs 16-byte multiples "
                "within a slice"
            )
        if self.back and (
            not self.norm or len(self.segments) != 1 or self.add_residual or self.x_stride
            or self.residual_epilogue or self.situ or self.norm_out or self.pre_bytes
            or self.tail
        ):  # fmt: skip
            raise ValueError(
                "gemv_stream: back needs the norm, one segment, K a multiple of 256 and no "
                "other prologue or epilogue"
            )
        for name, v, hi in zip(("warps", "rows", "group", "depth"),
                               (self.warps, self.rows, self.group, self.depth), CFG_MAX,
                               strict=True):  # fmt: skip
            if not 1 <= v <= hi:
                raise ValueError(f"gemv_stream: {name}={v} outside 1..{hi}")

    @property
    def pieces(self) -> int:
        """16-byte loads per lane and row (K / 256, rounded up: the last one partial where
        K has a tail)."""
        return -(-self.k // KSTEP)

    @property
    def kp(self) -> int:
        """K padded to the pieces (the activations' row in shared memory, zeros past K)."""
        return self.pieces * KSTEP

    @property
    def tail(self) -> bool:
        return self.kp != self.k

    @property
    def grp(self) -> int:
        return min(self.group, self.pieces)

    @property
    def ngroups(self) -> int:
        return -(-self.pieces // self.grp)

    @property
    def cta_rows(self) -> int:
        """Output rows (columns of ``out``) per CTA: with ``situ`` half its weight rows."""
        return self.warps * self.rows // (2 if self.situ else 1)

    @property
    def warp_outs(self) -> int:
        return self.rows // (2 if self.situ else 1)

    def out_width(self, n: int) -> int:
        """Columns of the output of an ``n``-row segment."""
        return n // 2 if self.situ else n

    def ctas(self, n: int) -> int:
        return -(-self.out_width(n) // self.cta_rows)

    @property
    def grid(self) -> int:
        return sum(self.ctas(n) for n in self.segments)

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def ldx(self) -> int:
        return self.x_stride or self.k

    @property
    def r_elems(self) -> int:
        """Shared-memory staging of the residual input (``xload="async"`` with ``add_residual``)."""
        return self.m * self.k if self.add_residual and self.xload == "async" else 8

    @property
    def smem_bytes(self) -> int:
        """Activations [M, K padded] BF16 (+ the staged residual) + warp partials + rstd (+
        alignment)."""
        return (self.m * self.kp + self.r_elems) * 2 + 4 * self.warps * self.m + 4 * self.m + 64

    @property
    def weight_bytes(self) -> int:
        return sum(self.segments) * self.k * 2

    def in_flight_regs(self) -> int:
        """Registers per lane held by weight loads in flight (``(depth + 1)`` groups)."""
        return (min(self.depth, self.ngroups) + 1) * self.grp * self.rows * 4

    def resident_estimate(self, regs: int) -> int:
        """CTAs per SM with ``regs`` registers per thread (ptxas), by registers, threads and
        shared memory; the grid is resident at once if ``grid <= NUM_SMS * this``."""
        by_regs = SM_REGS // (regs * self.threads)
        by_thr = 2048 // self.threads
        by_smem = SM_SMEM // (self.smem_bytes + 1024)
        return max(0, min(by_regs, by_thr, by_smem, 32))


class GemvStream:
    def __init__(self, plan: GemvPlan):
        self.p = plan

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, ldx] bf16 (first K columns used)
        mR: cute.Tensor,  # [M, K] residual in (add_residual) else placeholder
        mRout: cute.Tensor,  # [M, K] new residual out (add_residual) else placeholder
        mNW: cute.Tensor,  # [K] norm weight (norm) else placeholder
        mW0: cute.Tensor,
        mO0: cute.Tensor,
        mW1: cute.Tensor,
        mO1: cute.Tensor,
        mW2: cute.Tensor,
        mO2: cute.Tensor,
        mE: cute.Tensor,  # [M, N0] epilogue residual (residual_epilogue) else placeholder
        stream: cuda.CUstream,
    ):
        self.smem_cls = self.smem_struct()
        self.launch_grid(
            self.kernel(mX, mR, mRout, mNW, mW0, mO0, mW1, mO1, mW2, mO2, mE),
            self.smem_cls.size_in_bytes(),
            stream,
        )

    def launch_grid(self, kernel, smem: int, stream) -> None:
        """Launch one of this class's kernels on the plan's grid (one CTA of ``warps`` warps per
        ``cta_rows`` output rows), with ``smem`` bytes and PDL as the plan says (trace time)."""
        p = self.p
        kernel.launch(grid=[p.grid, 1, 1], block=[p.threads, 1, 1], smem=smem, stream=stream,
                      use_pdl=p.pdl)  # fmt: skip

    @staticmethod
    def ids() -> tuple:
        """``(thread, block, warp, lane)`` indices inside a kernel (trace time)."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        return tidx, bidx, tidx // 32, tidx % 32

    def smem_struct(self):
        p = self.p

        @cute.struct
        class Smem:
            x: cute.struct.Align[cute.struct.MemRange[BFloat16, p.m * p.kp], 16]
            r: cute.struct.Align[cute.struct.MemRange[BFloat16, p.r_elems], 16]
            red: cute.struct.MemRange[Float32, p.warps * p.m]
            rstd: cute.struct.MemRange[Float32, p.m]

        return Smem

    def smem_views(self, st=None):
        """(sX, sR, sRed, sRstd) in this CTA's shared memory (inside the kernel; ``st`` an
        allocated :meth:`smem_struct`, else one is allocated)."""
        p = self.p
        if st is None:
            st = cutlass.memory.SmemAllocator().allocate(self.smem_cls)
        sX = st.x.get_tensor(cute.make_layout((p.m, p.kp), stride=(p.kp, 1)))
        sR = sX
        if cutlass.const_expr(p.r_elems > 8):
            sR = st.r.get_tensor(cute.make_layout((p.m, p.k), stride=(p.k, 1)))
        sRed = st.red.get_tensor(cute.make_layout((p.warps, p.m), stride=(p.m, 1)))
        sRstd = st.rstd.get_tensor(cute.make_layout(p.m))
        return sX, sR, sRed, sRstd

    @cute.kernel
    def kernel(self, mX, mR, mRout, mNW, mW0, mO0, mW1, mO1, mW2, mO2, mE):
        p = self.p
        tidx, bidx, warp, lane = self.ids()
        sX, sR, sRed, sRstd = self.smem_views()
        weights = (mW0, mW1, mW2)
        outs = (mO0, mO1, mO2)
        t0 = 0
        for s in cutlass.range_constexpr(len(p.segments)):
            nc = p.ctas(p.segments[s])
            if bidx >= t0 and bidx < t0 + nc:
                self.body(mX, mR, mRout, mNW, weights[s], outs[s], mE, sX, sR, sRed, sRstd,
                          bidx - t0, p.segments[s], bidx, warp, lane)  # fmt: skip
            t0 += nc

    def issue(self, mW, rows, g: int, lane):
        """Group ``g``'s loads (trace time): ``[(piece, [row])]`` 8-register BF16 tensors. The
        last piece of a K with a tail: lanes past K load the row's last 8 columns again
        (clamped: no branch, no read past the row), which meet zero activations."""
        p = self.p
        buf = []
        for i in range(g * p.grp, min((g + 1) * p.grp, p.pieces)):
            per_row = []
            v = i * 32 + lane
            if p.tail and i == p.pieces - 1:
                v = cutlass.min(v, p.k // PIECE - 1)
            for r in rows:
                if p.ld == "nc":
                    src = cute.local_tile(mW[r, None], (PIECE,), (v,))
                    t = ld_vec8(src, "nc.L1::no_allocate.L2::256B")
                else:
                    t = cute.make_rmem_tensor((PIECE,), BFloat16)
                    load_vec8(mW[r, None], v * PIECE, t)
                per_row.append(t)
            buf.append((i, per_row))
        return buf

    def issue_first(self, mW, rows, lane) -> dict:
        """The first ``depth`` groups (trace time)."""
        return {g: self.issue(mW, rows, g, lane) for g in range(min(self.p.depth, self.p.ngroups))}

    def mainloop(self, mW, rows, bufs: dict, sX, lane) -> list:
        """All groups, fully unrolled (trace time): group ``g + depth`` is issued before group
        ``g`` is consumed. Each (row, token) keeps an 8-wide FP32 vector accumulator (8
        independent FMA chains); returns the per-lane sums ``[row][token]``."""
        p = self.p
        accs: list[list] = [[None] * p.m for _ in range(p.rows)]
        for g in range(p.ngroups):
            if g + p.depth < p.ngroups:
                bufs[g + p.depth] = self.issue(mW, rows, g + p.depth, lane)
            for i, per_row in bufs.pop(g):
                k0 = (i * 32 + lane) * PIECE
                wf = [w.load().to(Float32) for w in per_row]
                for m in range(p.m):
                    xv = cute.make_rmem_tensor((PIECE,), BFloat16)
                    cute.autovec_copy(cute.local_tile(sX[m, None], (PIECE,), (k0 // PIECE,)), xv)
                    xf = xv.load().to(Float32)
                    for r in range(p.rows):
                        prod = wf[r] * xf
                        accs[r][m] = prod if accs[r][m] is None else accs[r][m] + prod
        return [[a.reduce(cute.ReductionOp.ADD, Float32(0.0), 0) for a in row] for row in accs]

    @cute.jit
    def body(self, mX, mR, mRout, mNW, mW, mO, mE, sX, sR, sRed, sRstd, cta, n, bidx, warp,
             lane, post=()):  # fmt: skip
        """One CTA's rows. ``post`` (``norm_out`` plans): ``(norm weight, h_out, partials,
        counters)`` of :class:`GemvStreamNorm`'s epilogue."""
        p = self.p
        row0 = cta * p.cta_rows + warp * p.warp_outs  # this warp's first output row
        nout = p.out_width(n)
        rows = []  # the weight rows it reads (with situ: its gate rows, then their up rows)
        for r in cutlass.range_constexpr(p.rows):
            if cutlass.const_expr(p.situ):
                j = r % p.warp_outs
                rows.append(cutlass.min(row0 + j, nout - 1) + (r // p.warp_outs) * nout)
            else:
                rows.append(cutlass.min(row0 + r, n - 1))

        if cutlass.const_expr(p.l2_all):
            # the whole slice this warp will read, one bulk prefetch per row (lane r: row r)
            for r in cutlass.range_constexpr(p.rows):
                if lane == r and row0 + r % p.warp_outs < nout:
                    src = cute.local_tile(mW[rows[r], None], (p.k,), (0,))
                    cute.arch.inline_ptx(
                        "cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                        read_only_args=[src.iterator, Int32(p.k * 2)],
                    )
        # the first groups' weights go out before the PDL wait (never written by the
        # previous kernel), and so do the norm weights of this thread's prologue pieces
        bufs = self.issue_first(mW, rows, lane)
        if cutlass.const_expr(p.pre_bytes > 0):
            self.prefetch_next(post[0], bidx, warp * 32 + lane)
        nvec = p.k // PIECE
        per = -(-nvec // p.threads)
        tidx = warp * 32 + lane
        nws = []
        if cutlass.const_expr(p.norm):
            for i in cutlass.range_constexpr(per):
                t = cute.make_rmem_tensor((PIECE,), BFloat16)
                load_vec8(mNW, cutlass.min(tidx + i * p.threads, nvec - 1) * PIECE, t)
                nws.append(t)
        if cutlass.const_expr(p.pdl):
            pdl_begin()

        # the epilogue's residual (written by an earlier kernel: after the wait), loaded now so
        # that it is in registers when the sums are
        evs = []
        if cutlass.const_expr(p.residual_epilogue):
            for r in cutlass.range_constexpr(p.rows):
                for m in cutlass.range_constexpr(p.m):
                    evs.append(mE[m, rows[r]].to(Float32))
        if cutlass.const_expr(p.xload == "async"):
            self.prologue_async(mX, mR, mRout, sX, sR, sRed, nws, bidx, warp, lane)
        else:
            self.prologue(mX, mR, mRout, sX, sRed, sRstd, nws, bidx, warp, lane)
        accs = self.mainloop(mW, rows, bufs, sX, lane)

        if cutlass.const_expr(p.norm_out):
            self.store_norm(accs, evs, row0, n, mO, post, sRed, warp, lane)
        elif cutlass.const_expr(p.situ):
            # gate and up sums of each output row are in this warp: bf16-rounded (what the
            # reference's GEMM writes), SiTU-and-mul, one store
            for j in cutlass.range_constexpr(p.warp_outs):
                for m in cutlass.range_constexpr(p.m):
                    g = warp_sum(accs[j][m]).to(BFloat16).to(Float32)
                    u = warp_sum(accs[j + p.warp_outs][m]).to(BFloat16).to(Float32)
                    if lane == 0 and row0 + j < nout:
                        y = situ_fn(g, u, p.situ_beta, p.situ_lbeta)
                        mO[m, row0 + j] = y.to(BFloat16)
        else:
            for r in cutlass.range_constexpr(p.rows):
                for m in cutlass.range_constexpr(p.m):
                    tot = warp_sum(accs[r][m])
                    if lane == 0 and row0 + r < n:
                        if cutlass.const_expr(p.residual_epilogue):
                            tot = tot.to(BFloat16).to(Float32) + evs[r * p.m + m]
                        mO[m, row0 + r] = tot.to(BFloat16)

    @cute.jit
    def prefetch_next(self, mPre, bidx, tidx):
        """``pre_bytes`` plans: one ``cp.async.bulk.prefetch.L2`` per (row, slice) of the next
        kernels' weight, spread over every thread of the grid (before the PDL wait: nothing
        here depends on the previous kernel)."""
        p = self.p
        items = p.pre_rows * p.pre_slices
        nthr = p.grid * p.threads
        step = p.pre_k // p.pre_slices
        g = bidx * p.threads + tidx
        pol = None
        if cutlass.const_expr(p.pre_last):
            pol = cute.arch.inline_ptx(
                "createpolicy.fractional.L2::evict_last.b64 {$w0}, 1.0;",
                write_only_types=[Int64],
            )
        for i in cutlass.range_constexpr(-(-items // nthr)):
            it = g + i * nthr
            if it < items:
                row = it // p.pre_slices
                sl = it - row * p.pre_slices
                src = cute.local_tile(mPre[row, None], (step,), (sl,))
                if cutlass.const_expr(p.pre_last):
                    cute.arch.inline_ptx(
                        "cp.async.bulk.prefetch.L2.global.L2::cache_hint [{$r0}], {$r1}, {$r2};",
                        read_only_args=[src.iterator, Int32(p.pre_bytes), pol],
                    )
                else:
                    cute.arch.inline_ptx(
                        "cp.async.bulk.prefetch.L2.global [{$r0}], {$r1};",
                        read_only_args=[src.iterator, Int32(p.pre_bytes)],
                    )

    @cute.jit
    def store_norm(self, accs, evs, row0, n, mO, post, sRed, warp, lane):
        """``norm_out``: each CTA stores its rows of ``h = bf16(bf16(acc) + res)`` (the new
        residual), then counts itself done (every thread's stores fenced first); the CTA that
        counts last reads the whole ``[M, N]`` of ``h`` back from L2 (one round trip: every
        thread's loads issued together), sums the squares per token in a fixed order (the same
        result whichever CTA is last), and writes ``bf16(bf16(h * rstd) * w)``
        (:func:`.rmsnorm.rmsnorm_ref`'s rounding), then resets the counter. No CTA waits for
        another: any grid size is safe."""
        p = self.p
        mG, mH, mCnt, sFlag = post
        tidx = warp * 32 + lane
        for r in cutlass.range_constexpr(p.rows):
            for m in cutlass.range_constexpr(p.m):
                tot = warp_sum(accs[r][m])
                if lane == 0 and row0 + r < n:
                    tot = tot.to(BFloat16).to(Float32) + evs[r * p.m + m]
                    mO[m, row0 + r] = tot.to(BFloat16)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            old = cute.arch.atomic_add(mCnt.iterator + C_ARRIVE, Int32(1), sem="acq_rel",
                                       scope="gpu")  # fmt: skip
            sFlag[0] = Int32(0)
            if old == p.grid - 1:
                sFlag[0] = Int32(1)
        cute.arch.sync_threads()
        if sFlag[0] == 1:  # the last CTA (a uniform branch: the flag is the CTA's)
            cute.arch.fence_acq_rel_gpu()
            self.norm_rows(mO, mG, mH, sRed, tidx, warp, lane)
            if tidx == 0:
                mCnt[C_ARRIVE] = Int32(0)

    @cute.jit
    def norm_rows(self, mO, mG, mH, sRed, tidx, warp, lane):
        """The last CTA's pass over all of ``h``: loads at L2 (``ld.global.cg``: other CTAs
        wrote them), one block reduction per token, the normalized rows written."""
        p = self.p
        N = p.segments[0]
        nvec = N // PIECE
        per = -(-nvec // p.threads)
        hv = []  # [m][i]: 8 BF16 of h
        gv = []  # [i]: 8 BF16 of the norm weight
        for i in cutlass.range_constexpr(per):
            kv = cutlass.min(tidx + i * p.threads, nvec - 1)
            gv.append(ld_cg_vec8(cute.local_tile(mG, (PIECE,), (kv,))))
        for m in cutlass.range_constexpr(p.m):
            row = []
            for i in cutlass.range_constexpr(per):
                kv = cutlass.min(tidx + i * p.threads, nvec - 1)
                row.append(ld_cg_vec8(cute.local_tile(mO[m, None], (PIECE,), (kv,))))
            hv.append(row)
        for m in cutlass.range_constexpr(p.m):
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(per):
                keep = Float32(1.0)
                if tidx + i * p.threads >= nvec:
                    keep = Float32(0.0)
                hf = hv[m][i].load().to(Float32)
                ss = ss + (hf * hf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0) * keep
            self.publish_ssq(ss, sRed, m, warp, lane)
        cute.arch.sync_threads()
        for m in cutlass.range_constexpr(p.m):
            rs = self.rstd(sRed, m, N)
            for i in cutlass.range_constexpr(per):
                kv = tidx + i * p.threads
                if kv < nvec:
                    t = cute.make_rmem_tensor((PIECE,), BFloat16)
                    for e in cutlass.range_constexpr(PIECE):
                        y = (hv[m][i][e].to(Float32) * rs).to(BFloat16)
                        t[e] = (y.to(Float32) * gv[i][e].to(Float32)).to(BFloat16)
                    cute.autovec_copy(t, cute.local_tile(mH[m, None], (PIECE,), (kv,)))

    @cute.jit
    def prologue_async(self, mX, mR, mRout, sX, sR, sRed, nws, bidx, warp, lane):
        """As :meth:`prologue`, the thread's x (and r) pieces copied by ``cp.async`` into
        shared memory first (all in flight together, no registers held: one L2 round trip),
        then read back by the same thread (visible to it after ``cp.async.wait_group``)."""
        p = self.p
        nt = p.threads
        tidx = warp * 32 + lane
        nvec = p.k // PIECE
        per = -(-nvec // nt)
        for m in cutlass.range_constexpr(p.m):
            for i in cutlass.range_constexpr(per):
                kv = tidx + i * nt
                if kv < nvec:
                    mc.cp_async16(cute.local_tile(sX[m, None], (PIECE,), (kv,)),
                                  cute.local_tile(mX[m, None], (PIECE,), (kv,)))  # fmt: skip
                    if cutlass.const_expr(p.add_residual):
                        mc.cp_async16(cute.local_tile(sR[m, None], (PIECE,), (kv,)),
                                      cute.local_tile(mR[m, None], (PIECE,), (kv,)))  # fmt: skip
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        for m in cutlass.range_constexpr(p.m):
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(per):
                kv = tidx + i * nt
                if kv < nvec:
                    sv = cute.local_tile(sX[m, None], (PIECE,), (kv,))
                    hv = cute.make_rmem_tensor((PIECE,), BFloat16)
                    cute.autovec_copy(sv, hv)
                    if cutlass.const_expr(p.add_residual):
                        rv = cute.make_rmem_tensor((PIECE,), BFloat16)
                        cute.autovec_copy(cute.local_tile(sR[m, None], (PIECE,), (kv,)), rv)
                        for e in cutlass.range_constexpr(PIECE):
                            hv[e] = (hv[e].to(Float32) + rv[e].to(Float32)).to(BFloat16)
                        cute.autovec_copy(hv, sv)
                        if bidx == 0:
                            cute.autovec_copy(hv, cute.local_tile(mRout[m, None], (PIECE,), (kv,)))
                    if cutlass.const_expr(p.norm):
                        hf = hv.load().to(Float32)
                        ss = ss + (hf * hf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            if cutlass.const_expr(p.norm):
                self.publish_ssq(ss, sRed, m, warp, lane)
        self.zero_pad(sX, tidx)
        cute.arch.sync_threads()
        self.normalize(sX, sRed, nws, tidx)

    @cute.jit
    def publish_ssq(self, ss, sRed, m: cutlass.Constexpr[int], warp, lane):
        """This warp's part of token ``m``'s sum of squares (summed over its lanes) into
        ``sRed[warp, m]``; a barrier must follow before :meth:`rstd` reads it."""
        ss = warp_sum(ss)
        if lane == 0:
            sRed[warp, m] = ss

    def rstd(self, sRed, m: int, width: int):
        """Token ``m``'s ``1 / sqrt(mean of squares + eps)`` over ``width`` columns, from every
        warp's part in ``sRed`` (trace time; after the barrier that published them)."""
        p = self.p
        tot = Float32(0.0)
        for w in range(p.warps):
            tot = tot + sRed[w, m]
        return cute.math.rsqrt(tot / Float32(width) + Float32(p.eps))

    @cute.jit
    def zero_pad(self, sX, tidx):
        """K with a tail: zeros in the activations' padding (columns K .. kp - 1 of each
        token), which the last piece's clamped weight loads meet (before the barrier that
        publishes ``sX``)."""
        p = self.p
        if cutlass.const_expr(p.tail):
            npad = (p.kp - p.k) // PIECE
            for m in cutlass.range_constexpr(p.m):
                if tidx < npad:
                    t = cute.make_rmem_tensor((PIECE,), BFloat16)
                    t.fill(0.0)
                    cute.autovec_copy(
                        t, cute.local_tile(sX[m, None], (PIECE,), (p.k // PIECE + tidx,))
                    )

    @cute.jit
    def normalize(self, sX, sRed, nws, tidx):
        """With ``norm`` (after the barrier that published ``sRed``): each thread rewrites
        its own pieces of every token as ``bf16(bf16(h * rstd) * w)``, then a barrier."""
        p = self.p
        nt = p.threads
        nvec = p.k // PIECE
        per = -(-nvec // nt)
        if cutlass.const_expr(p.norm):
            for m in cutlass.range_constexpr(p.m):
                rs = self.rstd(sRed, m, p.k)
                for i in cutlass.range_constexpr(per):
                    kv = tidx + i * nt
                    if kv < nvec:
                        t = cute.make_rmem_tensor((PIECE,), BFloat16)
                        sv = cute.local_tile(sX[m, None], (PIECE,), (kv,))
                        cute.autovec_copy(sv, t)
                        for e in cutlass.range_constexpr(PIECE):
                            y = (t[e].to(Float32) * rs).to(BFloat16)
                            t[e] = (y.to(Float32) * nws[i][e].to(Float32)).to(BFloat16)
                        cute.autovec_copy(t, sv)
            cute.arch.sync_threads()

    @cute.jit
    def prologue(self, mX, mR, mRout, sX, sRed, sRstd, nws, bidx, warp, lane):
        """Stage ``h = x (+ r)`` in shared memory (CTA 0 writes ``h`` to ``mRout``); with
        ``norm``: per-token rstd (one block reduction), then each thread rewrites its own
        pieces normalized. Every thread's loads are issued before any is used (row clamped,
        the surplus pieces weighted 0): one L2 round trip."""
        p = self.p
        nt = p.threads
        tidx = warp * 32 + lane
        nvec = p.k // PIECE
        per = -(-nvec // nt)
        for m in cutlass.range_constexpr(p.m):
            hs = []
            for i in cutlass.range_constexpr(per):
                kv = cutlass.min(tidx + i * nt, nvec - 1)
                xv = cute.make_rmem_tensor((PIECE,), BFloat16)
                load_vec8(mX[m, None], kv * PIECE, xv)
                if cutlass.const_expr(p.add_residual):
                    rv = cute.make_rmem_tensor((PIECE,), BFloat16)
                    load_vec8(mR[m, None], kv * PIECE, rv)
                    for e in cutlass.range_constexpr(PIECE):
                        xv[e] = (xv[e].to(Float32) + rv[e].to(Float32)).to(BFloat16)
                hs.append(xv)
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(per):
                kv = tidx + i * nt
                if kv < nvec:
                    cute.autovec_copy(hs[i], cute.local_tile(sX[m, None], (PIECE,), (kv,)))
                    if cutlass.const_expr(p.add_residual):  # noqa: SIM102 (trace-time test)
                        if bidx == 0:
                            cute.autovec_copy(
                                hs[i], cute.local_tile(mRout[m, None], (PIECE,), (kv,))
                            )
                if cutlass.const_expr(p.norm):
                    keep = Float32(1.0)
                    if kv >= nvec:
                        keep = Float32(0.0)
                    for e in cutlass.range_constexpr(PIECE):
                        f = hs[i][e].to(Float32)
                        ss = ss + f * f * keep
            if cutlass.const_expr(p.norm):
                self.publish_ssq(ss, sRed, m, warp, lane)
        self.zero_pad(sX, tidx)
        cute.arch.sync_threads()
        self.normalize(sX, sRed, nws, tidx)


class GemvStreamNorm(GemvStream):
    """o_proj + residual add + the next RMSNorm in one launch (``norm_out`` plans): the
    streaming GEMV with :meth:`GemvStream.store_norm`'s epilogue: ``out = bf16(bf16(x @ W^T) +
    res)`` and ``h_out = rmsnorm(out) * w``; ``counters`` int32 ``[4]`` (zeroed once; the last
    CTA resets what it used)."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [M, K] bf16
        mW: cute.Tensor,  # [N, K] bf16
        mO: cute.Tensor,  # [M, N] new residual out (may alias mE)
        mE: cute.Tensor,  # [M, N] residual in
        mG: cute.Tensor,  # [N] norm weight
        mH: cute.Tensor,  # [M, N] normalized out
        mCnt: cute.Tensor,  # [4] int32: CTAs done, spare
        stream: cuda.CUstream,
    ):
        base = self.smem_struct()

        @cute.struct
        class Smem:
            s: base
            flag: cute.struct.MemRange[Int32, 4]

        self.smem_cls = base
        self.smem_norm = Smem
        self.launch_grid(
            self.kernel_norm(mX, mW, mO, mE, mG, mH, mCnt), Smem.size_in_bytes(), stream
        )

    @cute.kernel
    def kernel_norm(self, mX, mW, mO, mE, mG, mH, mCnt):
        p = self.p
        tidx, bidx, warp, lane = self.ids()
        st = cutlass.memory.SmemAllocator().allocate(self.smem_norm)
        sX, sR, sRed, sRstd = self.smem_views(st.s)
        sFlag = st.flag.get_tensor(cute.make_layout(4))
        self.body(mX, mX, mX, mG, mW, mO, mE, sX, sR, sRed, sRstd, bidx, p.segments[0], bidx,
                  warp, lane, post=(mG, mH, mCnt, sFlag))  # fmt: skip


class GemvStreamPre(GemvStream):
    """The streaming GEMV (one segment) that also prefetches part of the next kernels' weight
    into L2 before its PDL wait (``pre_bytes`` plans; :meth:`GemvStream.prefetch_next`): o_proj
    waits through the decode kernel before it, whose few CTAs leave HBM idle."""

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mR: cute.Tensor,
        mRout: cute.Tensor,
        mNW: cute.Tensor,
        mW0: cute.Tensor,
        mO0: cute.Tensor,
        mE: cute.Tensor,
        mPre: cute.Tensor,  # [pre_rows, pre_k] bf16: the next kernels' weight (read: address)
        stream: cuda.CUstream,
    ):
        self.smem_cls = self.smem_struct()
        self.launch_grid(
            self.kernel_pre(mX, mR, mRout, mNW, mW0, mO0, mE, mPre),
            self.smem_cls.size_in_bytes(),
            stream,
        )

    @cute.kernel
    def kernel_pre(self, mX, mR, mRout, mNW, mW0, mO0, mE, mPre):
        p = self.p
        tidx, bidx, warp, lane = self.ids()
        sX, sR, sRed, sRstd = self.smem_views()
        self.body(mX, mR, mRout, mNW, mW0, mO0, mE, sX, sR, sRed, sRstd, bidx, p.segments[0],
                  bidx, warp, lane, post=(mPre,))  # fmt: skip


class GemvStreamBack(GemvStream):
    """The LatentMoE back at 1..4 tokens (``back`` plans), the function of
    :func:`.up_proj_shared_add.up_proj_shared_add_ref`: ``out [M, H] = bf16(bf16(acc * rstd *
    latent_norm) @ latent_up^T + shared_out)``, ``acc`` and ``shared_out`` FP32.

    The streaming GEMV's main loop on ``latent_up``; its prologue reads the FP32 routed sum
    (every thread's 32-byte pieces issued together after the PDL wait: one L2 round trip), one
    block reduction per token for rstd, and stages ``bf16(acc * rstd * w)`` (the reference's
    one rounding) in shared memory; the epilogue adds ``shared_out`` (loaded right after the
    wait) to the FP32 sums and rounds once. The first ``depth`` weight groups and the norm
    weights go out before the wait, as in every GEMV plan. :class:`.back_mma.BackMma`'s
    ``post`` norm (the default there) rounds ``bf16(acc * w)`` instead and scales by rstd after
    the MMAs."""

    @cute.jit
    def __call__(
        self,
        mAcc: cute.Tensor,  # [M, K] fp32: the routed experts' sum
        mNW: cute.Tensor,  # [K] bf16 latent norm weight
        mW: cute.Tensor,  # [N, K] bf16 latent_up
        mSh: cute.Tensor,  # [M, N] fp32 shared experts' output
        mOut: cute.Tensor,  # [M, N] bf16
        stream: cuda.CUstream,
    ):
        self.smem_cls = self.smem_struct()
        self.launch_grid(
            self.kernel_back(mAcc, mNW, mW, mSh, mOut), self.smem_cls.size_in_bytes(), stream
        )

    @cute.kernel
    def kernel_back(self, mAcc, mNW, mW, mSh, mOut):
        p = self.p
        tidx, bidx, warp, lane = self.ids()
        sX, _sR, sRed, _sRstd = self.smem_views()
        n = p.segments[0]
        row0 = bidx * p.cta_rows + warp * p.rows
        rows = []
        for r in cutlass.range_constexpr(p.rows):
            rows.append(cutlass.min(row0 + r, n - 1))
        bufs = self.issue_first(mW, rows, lane)  # before the wait: weights
        nt = p.threads
        nvec = p.k // PIECE
        per = -(-nvec // nt)
        nws = []
        for i in cutlass.range_constexpr(per):
            t = cute.make_rmem_tensor((PIECE,), BFloat16)
            load_vec8(mNW, cutlass.min(tidx + i * nt, nvec - 1) * PIECE, t)
            nws.append(t)
        if cutlass.const_expr(p.pdl):
            pdl_begin()
        evs = []  # shared_out of this lane's rows (written by an earlier kernel: after the wait)
        for r in cutlass.range_constexpr(p.rows):
            for m in cutlass.range_constexpr(p.m):
                evs.append(mSh[m, rows[r]])
        xs = []  # [m][i]: 8 FP32 of acc (rows clamped; the surplus pieces weighted 0)
        for m in cutlass.range_constexpr(p.m):
            row = []
            for i in cutlass.range_constexpr(per):
                kv = cutlass.min(tidx + i * nt, nvec - 1)
                xv = cute.make_rmem_tensor((PIECE,), Float32)
                cute.autovec_copy(cute.local_tile(mAcc[m, None], (PIECE,), (kv,)), xv)
                row.append(xv)
            xs.append(row)
        for m in cutlass.range_constexpr(p.m):
            ss = Float32(0.0)
            for i in cutlass.range_constexpr(per):
                keep = Float32(1.0)
                if tidx + i * nt >= nvec:
                    keep = Float32(0.0)
                xf = xs[m][i].load()
                ss = ss + (xf * xf).reduce(cute.ReductionOp.ADD, Float32(0.0), 0) * keep
            self.publish_ssq(ss, sRed, m, warp, lane)
        cute.arch.sync_threads()
        for m in cutlass.range_constexpr(p.m):
            rs = self.rstd(sRed, m, p.k)
            for i in cutlass.range_constexpr(per):
                kv = tidx + i * nt
                if kv < nvec:
                    t = cute.make_rmem_tensor((PIECE,), BFloat16)
                    for e in cutlass.range_constexpr(PIECE):
                        t[e] = (xs[m][i][e] * rs * nws[i][e].to(Float32)).to(BFloat16)
                    cute.autovec_copy(t, cute.local_tile(sX[m, None], (PIECE,), (kv,)))
        cute.arch.sync_threads()
        accs = self.mainloop(mW, rows, bufs, sX, lane)
        for r in cutlass.range_constexpr(p.rows):
            for m in cutlass.range_constexpr(p.m):
                tot = warp_sum(accs[r][m])
                if lane == 0 and row0 + r < n:
                    mOut[m, row0 + r] = (tot + evs[r * p.m + m]).to(BFloat16)


def back_plan(T: int, L: int, H: int, eps: float, cfg: tuple[int, int, int, int] | None = None,
              pdl: bool | None = None) -> GemvPlan:  # fmt: skip
    """The :class:`GemvStreamBack` plan of ``T`` tokens, latent ``L``, hidden ``H`` (the knobs
    from ``cfg``, else ``DECODESCOPE_GEMV_CFG`` or :func:`tuned_cfg`)."""
    w, r, g, d = cfg or env_cfg() or tuned_cfg(T, L, (H,))
    return GemvPlan(m=T, k=L, segments=(H,), norm=True, eps=float(eps),
                    pdl=pdl_enabled() if pdl is None else pdl, warps=w, rows=r, group=g, depth=d,
                    ld=env_ld(), back=True)  # fmt: skip


def compile_back_plan(p: GemvPlan):
    """Compile (cached) :class:`GemvStreamBack` for a ``back`` plan (works without a GPU)."""
    from decodescope.kernels.specialized.up_proj_shared_add import fake_back_args

    if not p.back:
        raise ValueError("gemv_stream: compile_back_plan needs a back plan (back_plan)")
    return itf.compiled(("gemv_stream_back", p), lambda: (
        GemvStreamBack(p), (*fake_back_args(p.m, p.k, p.segments[0]), itf.env_stream())))  # fmt: skip


def back_supports(T: int, L: int, H: int) -> bool:
    return 1 <= T <= MAX_M and L % KSTEP == 0 and H >= 1


def back_gemv(acc, latent_norm, latent_up, shared_out, out, eps: float,
              cfg: tuple[int, int, int, int] | None = None) -> None:  # fmt: skip
    """``out = bf16(bf16(rmsnorm(acc) * latent_norm) @ latent_up^T + shared_out)`` by
    :class:`GemvStreamBack` (the arguments of :func:`.back_mma.back_mma`)."""
    from decodescope.kernels.specialized.up_proj_shared_add import check_back_args

    T, L, H = check_back_args(acc, latent_norm, latent_up, shared_out, out)
    if not back_supports(T, L, H):
        raise ValueError(f"gemv_stream: the back GEMV needs 1..{MAX_M} tokens and a latent that "
                         f"is a multiple of {KSTEP}, got T={T}, L={L}")  # fmt: skip
    compile_back_plan(back_plan(T, L, H, eps, cfg))(acc, latent_norm, latent_up, shared_out, out)


C_ARRIVE = 0  # GemvStreamNorm's counter: CTAs done


def ld_vec8(src: cute.Tensor, qual: str) -> cute.Tensor:
    """8 BF16 (16 bytes, aligned) from global memory by ``ld.global.<qual>.v4.b32`` into a
    register tensor: ``nc.L1::no_allocate.L2::256B`` (the streamed weights), ``cg`` (at L2:
    another CTA wrote them)."""
    v = cute.arch.inline_ptx(
        f"ld.global.{qual}.v4.b32 {{{{$w0}}, {{$w1}}, {{$w2}}, {{$w3}}}}, [{{$r0}}];",
        write_only_types=[Int32, Int32, Int32, Int32],
        read_only_args=[src.iterator],
    )
    u = cute.make_rmem_tensor((4,), Int32)
    for e in range(4):
        u[e] = v[e]
    return cute.recast_tensor(u, BFloat16)


def ld_cg_vec8(src: cute.Tensor) -> cute.Tensor:
    """:func:`ld_vec8` at L2 (``ld.global.cg``)."""
    return ld_vec8(src, "cg")


# -- torch-facing --------------------------------------------------------------------------


def _fake_args(p: GemvPlan):
    return sg.fake_args(p, p.out_width)


def compile_plan(p: GemvPlan):
    """Compile (cached) the kernel of ``p``; works without a GPU (sm_90a)."""
    return itf.compiled(("gemv_stream", p), lambda: (GemvStream(p), _fake_args(p)))


def from_gemm_plan(
    gp, cfg: tuple[int, int, int, int] | None = None, ld: str = "", xload: str = ""
) -> GemvPlan:
    """The GEMV plan serving a :class:`.skinny_gemm.GemmPlan` (its shape and flags; the knobs
    from ``cfg`` or ``DECODESCOPE_GEMV_CFG``)."""
    w, r, g, d = cfg or env_cfg() or tuned_cfg(gp.m, gp.k, gp.segments)
    ld = ld or env_ld()
    xload = xload or env_xload()
    if gp.situ:
        r = situ_rows(r)
    return GemvPlan(
        m=gp.m, k=gp.k, segments=gp.segments, norm=gp.norm, add_residual=gp.add_residual,
        residual_epilogue=gp.residual_epilogue, x_stride=gp.x_stride, eps=gp.eps, pdl=gp.pdl,
        warps=w, rows=r, group=g, depth=d, l2_all=gp.l2_all, ld=ld, xload=xload,
        situ=gp.situ, situ_beta=gp.situ_beta, situ_lbeta=gp.situ_lbeta,
    )  # fmt: skip


def situ_rows(rows: int) -> int:
    """Rows per warp of a SiTU plan: even (gate and up pairs), the knob's value rounded up."""
    return min(rows + rows % 2, CFG_MAX[1])


def gemv(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    outs: list[torch.Tensor],
    *,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    epilogue_residual: torch.Tensor | None = None,
    eps: float = 1e-5,
    cfg: tuple[int, int, int, int] | None = None,
    l2_all: bool = False,
    ld: str = "",
    xload: str = "",
    situ: tuple[float, float] | None = None,
) -> None:
    """:func:`.skinny_gemm.skinny_gemm`'s contract (same reference) by this kernel; ``cfg`` =
    (warps, rows, group, depth) (default ``DECODESCOPE_GEMV_CFG``, else :func:`tuned_cfg`),
    ``l2_all`` the whole-slice L2 prefetch before the PDL wait, ``ld`` the weight loads
    (``plain`` / ``nc``; default from ``DECODESCOPE_GEMV_CFG``'s suffix ``n``), ``xload`` the
    prologue's activation loads (``async`` / ``regs``; suffix ``x``)."""
    if x.stride(1) != 1:
        raise ValueError(f"gemv_stream: x must have unit column stride, got {tuple(x.stride())}")
    f = sg.shape_fields(x, weights, residual, norm_weight, epilogue_residual, eps)
    w_, r_, g_, d_ = cfg or env_cfg() or tuned_cfg(f["m"], f["k"], f["segments"])
    sf = {}
    if situ is not None:
        r_ = situ_rows(r_)
        sf = dict(situ=True, situ_beta=float(situ[0]), situ_lbeta=float(situ[1]))
    p = GemvPlan(
        **f, warps=w_, rows=r_, group=g_, depth=d_, l2_all=l2_all, ld=ld or env_ld(),
        xload=xload or env_xload(), **sf,
    )  # fmt: skip
    launch(p, x, weights, outs, residual, residual_out, norm_weight, epilogue_residual)


def launch(p: GemvPlan, x, weights, outs, residual, residual_out, norm_weight, epilogue_residual):
    sg.call(compile_plan(p), x, weights, outs, residual, residual_out, norm_weight,
            epilogue_residual)  # fmt: skip


# -- o_proj + residual + RMSNorm (norm_out) ----------------------------------------------------

_NORM_CNT: dict[str, torch.Tensor] = {}


def norm_plan(gp: GemvPlan) -> GemvPlan | None:
    """``gp`` with the RMSNorm epilogue (:class:`GemvStreamNorm`), or None where the plan is
    not one segment with the residual epilogue."""
    import dataclasses

    try:
        return dataclasses.replace(gp, norm_out=True)
    except ValueError:
        return None


def _fake_norm_args(p: GemvPlan):
    bf = torch.bfloat16
    M, K, N = p.m, p.k, p.segments[0]
    return (
        itf.fake_strided(bf, (M, K), (p.ldx, 1)),
        itf.fake(bf, (N, K)),
        itf.fake(bf, (M, N)),
        itf.fake(bf, (M, N)),
        itf.fake(bf, (N,)),
        itf.fake(bf, (M, N)),
        itf.fake(torch.int32, (4,), align=4),
        itf.env_stream(),
    )


def compile_norm_plan(p: GemvPlan):
    """Compile (cached) :class:`GemvStreamNorm` for a ``norm_out`` plan (works without a GPU)."""
    if not p.norm_out:
        raise ValueError("gemv_stream: compile_norm_plan needs a norm_out plan (norm_plan)")
    return itf.compiled(("gemv_stream_norm", p), lambda: (GemvStreamNorm(p), _fake_norm_args(p)))


def norm_counters(device) -> torch.Tensor:
    """The counters of every :class:`GemvStreamNorm` launch on ``device`` (made on the first
    call: before graph capture, in the layers' eager warm-up step). One set is enough: launches
    on one stream never overlap in their epilogue (each waits for the kernel before it), and
    the last CTA of each launch leaves the counter at 0."""
    key = str(device)
    c = _NORM_CNT.get(key)
    if c is None:
        c = _NORM_CNT[key] = torch.zeros(4, dtype=torch.int32, device=device)
    return c


def gemv_norm(p: GemvPlan, x, w, out, residual, norm_weight, h_out) -> None:
    """``out = bf16(bf16(x @ w^T) + residual)`` (``out`` may alias ``residual``) and ``h_out =
    rmsnorm(out) * norm_weight`` in one launch of the ``norm_out`` plan ``p``."""
    compile_norm_plan(p)(x, w, out, residual, norm_weight, h_out, norm_counters(x.device))


# -- the next kernels' weights into L2 (pre_bytes) ---------------------------------------------


def pre_plan(gp: GemvPlan, rows: int, k: int, nbytes: int, slices: int = 8,
             last: bool = False) -> GemvPlan | None:  # fmt: skip
    """``gp`` prefetching the first ``nbytes`` of each of ``slices`` K slices of every row of a
    ``[rows, k]`` BF16 weight (:class:`GemvStreamPre`), or None where ``gp`` has more than one
    segment, a norm prologue or ``norm_out`` (those launch other classes) or ``nbytes`` is 0."""
    import dataclasses

    if nbytes <= 0 or len(gp.segments) != 1 or gp.norm or gp.norm_out:
        return None
    return dataclasses.replace(gp, pre_rows=rows, pre_k=k, pre_slices=slices, pre_bytes=nbytes,
                               pre_last=last)  # fmt: skip


def _fake_pre_args(p: GemvPlan):
    a = _fake_args(p)  # x, r, rout, nw, w0, o0, w1, o1, w2, o2, e, stream
    return (*a[:6], a[10], itf.fake(torch.bfloat16, (p.pre_rows, p.pre_k)), a[11])


def compile_pre_plan(p: GemvPlan):
    """Compile (cached) :class:`GemvStreamPre` for a ``pre_bytes`` plan (works without a GPU)."""
    if not p.pre_bytes:
        raise ValueError("gemv_stream: compile_pre_plan needs a pre_bytes plan (pre_plan)")
    return itf.compiled(("gemv_stream_pre", p), lambda: (GemvStreamPre(p), _fake_pre_args(p)))


def gemv_pre(p: GemvPlan, x, w, out, epilogue_residual, pre_w) -> None:
    """``out = x @ w^T (+ epilogue_residual)`` by the ``pre_bytes`` plan ``p``, prefetching its
    share of ``pre_w`` (``[pre_rows, pre_k]`` BF16, contiguous) into L2 before the PDL wait."""
    if p.pre_last:  # the L2 set-aside DECODESCOPE_L2_PERSIST_MB asks for, if any
        from decodescope.kernels.specialized.experts_t1 import apply_l2_persist

        apply_l2_persist()
    ph = itf.placeholder(x.device, sg._PLACEHOLDER)
    e = epilogue_residual if epilogue_residual is not None else ph
    compile_pre_plan(p)(x, ph, ph, ph[0], w, out, e, pre_w)
