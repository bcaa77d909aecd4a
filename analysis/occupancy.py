"""How many CTAs of a kernel fit on one SM at once, and how many waves its grid makes.

From a kernel record's launch figures (threads per block, registers per thread, static and
dynamic shared memory per block) and the GPU's per-SM limits, the resident CTAs per SM are the
least of what the threads, the registers, the shared memory and the block slots allow, by the
allocation rules of NVIDIA's occupancy calculator (registers in 256-register units per warp,
warps in groups of 4; shared memory in 128-byte units plus 1 KB the runtime reserves per
block). ``waves = grid blocks / (SMs x CTAs per SM)``: 1.45 means a full wave and a second
one 45% full, whose CTAs run after the first wave's (a tail that a latency-bound kernel pays
in full).

The per-SM limits come from the device properties a trace carries (Kineto's
``deviceProperties``, Nsight Systems' TARGET_INFO_GPU, kept by the imports), else from the GPU's
name (:data:`LIMITS`: the GPUs whose figures are checked here); a kernel of another GPU gets no
figures (None), never a guess.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SmLimits:
    """Per-SM limits of one GPU (compute capability 9.0 figures by default)."""

    sms: int
    threads: int = 2048
    blocks: int = 32
    regs: int = 65536
    smem: int = 233472  # 228 KB, the blocks' reservations included
    smem_reserved: int = 1024  # per block, by the runtime
    reg_unit: int = 256  # registers are given to a warp in units of this many
    warp_unit: int = 4  # warps are given registers in groups of this many
    smem_unit: int = 128


# GPU name (as CUPTI and torch report it) -> limits. The SM counts and shared memory per SM are
# the ``deviceProperties`` of the committed Kineto traces (tests/data/traces: H100 80GB HBM3 132
# SMs and 233472 bytes, A100-SXM4-80GB 108 and 167936, B200 148 and 233472) and, for the H200,
# the device of our own runs (132 SMs as torch reported it: notes/gpu-logs/s5/tp2_fused.json).
LIMITS: dict[str, SmLimits] = {
    "NVIDIA H200": SmLimits(sms=132),
    "NVIDIA H100 80GB HBM3": SmLimits(sms=132),
    "NVIDIA A100-SXM4-80GB": SmLimits(sms=108, smem=167936),
    "NVIDIA B200": SmLimits(sms=148),
}


# Resident blocks per SM by compute capability (CUDA programming guide's table); a capability
# not listed gives no limits from device properties.
BLOCKS_BY_CC: dict[tuple[int, int], int] = {
    (6, 0): 32, (6, 1): 32, (6, 2): 32, (7, 0): 32, (7, 5): 16, (8, 0): 32, (8, 6): 16,
    (8, 7): 16, (8, 9): 24, (9, 0): 32, (10, 0): 32,
}  # fmt: skip


def limits_for(gpu: str | None) -> SmLimits | None:
    """The per-SM limits of ``gpu`` (a name of :data:`LIMITS`), else None."""
    return LIMITS.get(gpu or "")


def limits_from_props(props: dict | None) -> SmLimits | None:
    """Per-SM limits from a trace's device properties (Kineto's ``deviceProperties`` names:
    ``numSms``, ``maxThreadsPerMultiprocessor``, ``regsPerMultiprocessor``,
    ``sharedMemPerMultiprocessor``, ``computeMajor`` / ``computeMinor``, and where an Nsight
    Systems import recorded it ``maxBlocksPerSm``); None where one is missing, or where the
    blocks per SM are neither recorded nor in :data:`BLOCKS_BY_CC`."""
    if not isinstance(props, dict):
        return None
    keys = ("numSms", "maxThreadsPerMultiprocessor", "regsPerMultiprocessor",
            "sharedMemPerMultiprocessor", "computeMajor", "computeMinor")  # fmt: skip
    vals = [props.get(k) for k in keys]
    if not all(type(v) is int and v >= 0 for v in vals) or vals[0] == 0:
        return None
    sms, threads, regs, smem, major, minor = vals
    blocks = props.get("maxBlocksPerSm")  # Nsight Systems records it; Kineto does not
    if type(blocks) is not int or blocks <= 0:
        blocks = BLOCKS_BY_CC.get((major, minor))
    if blocks is None:
        return None
    return SmLimits(sms=sms, threads=threads, blocks=blocks, regs=regs, smem=smem,
                    smem_reserved=1024 if major >= 8 else 0)  # fmt: skip


def run_limits(gpu: str | None, config_json: str | None) -> SmLimits | None:
    """A run's per-SM limits: the device properties its import recorded (``config_json``'s
    ``device``), else :func:`limits_for` its GPU name."""
    import json

    try:
        cfg = json.loads(config_json) if config_json else {}
    except ValueError:
        cfg = {}
    lim = limits_from_props(cfg.get("device") if isinstance(cfg, dict) else None)
    return lim or limits_for(gpu)


def ctas_per_sm(
    threads: int, registers: int | None, smem_bytes: int | None, lim: SmLimits
) -> int | None:
    """CTAs of ``threads`` threads, ``registers`` registers per thread and ``smem_bytes`` of
    shared memory (static + dynamic) resident on one SM at once; 0 where one does not fit;
    None where ``threads`` is not positive or the registers are unknown."""
    if threads <= 0 or registers is None:
        return None
    warps = -(-threads // 32)
    by_threads = lim.threads // (warps * 32)
    by_blocks = lim.blocks
    if registers > 0:
        per_warp = -(-registers * 32 // lim.reg_unit) * lim.reg_unit
        warps_sm = (lim.regs // per_warp) // lim.warp_unit * lim.warp_unit
        by_regs = warps_sm // warps
    else:
        by_regs = by_blocks
    per_block = -(-((smem_bytes or 0) + lim.smem_reserved) // lim.smem_unit) * lim.smem_unit
    by_smem = lim.smem // per_block if per_block else by_blocks
    return max(0, min(by_threads, by_blocks, by_regs, by_smem))


def waves(grid_blocks: int, ctas: int | None, lim: SmLimits) -> float | None:
    """``grid_blocks / (SMs x ctas)``; None where ``ctas`` is unknown or 0."""
    if not ctas:
        return None
    return grid_blocks / (lim.sms * ctas)
