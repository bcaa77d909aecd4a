"""Each op's share beside the bytes floor of its own part of the layer, for runs of
decodescope's own workloads (``decodescope report``'s op table, the dashboard's floor view);
where the run measured the GEMM rate beside it (since session 38), the compute floor of the
op's tensor-core FLOPs too, and which of the two bounds it."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from decodescope.analysis.schema import Run


def op_floors(run: Run, ops: pa.Table) -> tuple[pa.Table, str | None]:
    """The op table with each op's bytes (its part of the layer floor, ``kernels.bytes``),
    ``op_floor_us`` at the run's copy bandwidth and ``share_over_floor_us``, for a run of
    decodescope's own workloads that recorded its layer bytes and copy bandwidth. Otherwise the
    table as it is, and why not (None where the run is not one of ours: an imported trace)."""
    m = run.meta
    wl = (m.config.get("workload") or {}).get("config") or {}
    if not wl.get("preset") or not m.layer_bytes or not m.copy_bw_tbs or ops.num_rows == 0:
        return ops, None
    from decodescope.kernels import bytes as kbytes

    per_op: dict[tuple[str, str], int] = {}
    try:
        for kind in sorted(set(pc.drop_null(ops["layer_kind"]).to_pylist())):
            if kind not in m.layer_bytes:
                raise kbytes.OpBytesError(f"no layer bytes recorded for {kind!r}")
            names = ops.filter(pc.equal(ops["layer_kind"], kind))["op"].to_pylist()
            parts = kbytes.run_layer_parts(
                wl, kind, m.batch or 1, m.tokens_per_seq or 1, m.layer_bytes[kind]
            )
            for op, b in kbytes.op_bytes(parts, [o or "" for o in names]).items():
                per_op[(kind, op)] = b
    except kbytes.OpBytesError as e:
        return ops, f"no per-op floors: {e}"
    nbytes = [per_op.get((kd, op or "")) for kd, op in
              zip(ops["layer_kind"].to_pylist(), ops["op"].to_pylist(), strict=True)]  # fmt: skip
    floor = [b / (m.copy_bw_tbs * 1e6) if b is not None else None for b in nbytes]
    over = [s - f if f is not None and s is not None else None
            for s, f in zip(ops["share_us"].to_pylist(), floor, strict=True)]  # fmt: skip
    out = (
        ops.append_column("bytes", pa.array(nbytes, pa.int64()))
        .append_column("op_floor_us", pa.array(floor, pa.float64()))
        .append_column("share_over_floor_us", pa.array(over, pa.float64()))
    )
    if not m.gemm_tflops:
        return out, None
    return _with_compute(out, run, wl), None


def _with_compute(ops: pa.Table, run: Run, wl: dict) -> pa.Table:
    """The op table (with its bytes floors) and each op's tensor-core FLOPs
    (:mod:`decodescope.kernels.flops`), ``compute_floor_us`` at the GEMM rate measured beside the
    run, ``roof_floor_us`` (the larger of the two floors) and ``bound`` (``bytes`` or
    ``compute``: which floor is the larger)."""
    from decodescope.kernels import config as kconfig
    from decodescope.kernels import flops as kflops

    m = run.meta
    opts = {k: wl[k] for k in ("context_len", "kv_cache_dtype", "expert_dtype") if k in wl}
    cfg = kconfig.get_config(wl["preset"], wl["tp"], **opts)
    per_op: dict[tuple[str, str], int] = {}
    for kind in sorted(set(pc.drop_null(ops["layer_kind"]).to_pylist())):
        names = [o or "" for o in ops.filter(pc.equal(ops["layer_kind"], kind))["op"].to_pylist()]
        parts = kflops.layer_flops_breakdown(cfg, kind, m.batch or 1, m.tokens_per_seq or 1)
        for op, f in kflops.op_flops(parts, names).items():
            per_op[(kind, op)] = f
    flops = [per_op.get((kd, op or "")) for kd, op in
             zip(ops["layer_kind"].to_pylist(), ops["op"].to_pylist(), strict=True)]  # fmt: skip
    comp = [kflops.compute_floor_us(f, m.gemm_tflops) if f is not None else None for f in flops]
    byts = ops["op_floor_us"].to_pylist()
    roof = [max(b, c) if b is not None and c is not None else None
            for b, c in zip(byts, comp, strict=True)]  # fmt: skip
    bound = [None if b is None or c is None or max(b, c) <= 0 else
             ("compute" if c > b else "bytes") for b, c in zip(byts, comp, strict=True)]  # fmt: skip
    return (
        ops.append_column("flops", pa.array(flops, pa.int64()))
        .append_column("compute_floor_us", pa.array(comp, pa.float64()))
        .append_column("roof_floor_us", pa.array(roof, pa.float64()))
        .append_column("bound", pa.array(bound, pa.string()))
    )
