"""One layer's kernels in one step, in start order: where the layer's time goes.

For each kernel: its start and end relative to the layer's first kernel start, its duration and
its ``gap``: the start minus the latest end of the kernels before it. A positive gap is a bubble
(no kernel of the layer ran); a negative one an overlap, as when programmatic dependent launch
makes a kernel resident while its predecessor still runs (it waits there, and the span counts
the wait). Its ``share``: what it adds to the timeline, every instant some kernel runs charged
to the running kernel that ends first (:func:`.metrics.first_ending_shares`, the rule of the
op shares) from the end of the previous layer in the step on (the layer share's start,
:mod:`.metrics`): in a chain under PDL a kernel's end minus the end of the one before, its
wait left out. The shares add up to the layer's share less its bubbles. The summary adds the
span, the time covered by at least one kernel (``busy``) and the rest (``idle``), which is what
a fused path's launches leave on the table.

Each kernel's ``ctas_sm`` and ``waves`` (:mod:`.occupancy`): the CTAs of it one SM holds at
once and its grid over all the SMs' CTAs, where the GPU's per-SM limits are known. A grid of
1.45 waves runs a second, partial wave after the first: for a latency-bound kernel a whole
CTA's time more.

The default step is the median of the layer's steps (a typical replay, not the first one after
capture); ``layer=None`` takes the step's every kernel (traces without layer ranges).
"""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decodescope.analysis import metrics, occupancy

# CuTe DSL kernels: kernel_cutlass_kernel_<module path><Class>_object_at_<arguments...>
_CUTE = re.compile(
    r"^kernel_cutlass_kernel_(?:decodescopekernels(?:specialized|standard)?)?(.+?)_object_at_"
)
NAME_MAX = 60


def short_name(name: str) -> str:
    """A kernel name a table can hold: a CuTe DSL kernel as its module and class
    (``experts_t1W13T1``), a C++ one without its argument list and template arguments, at most
    ``NAME_MAX`` characters (an ellipsis where cut)."""
    m = _CUTE.match(name)
    if m:
        s = m.group(1)
    else:
        s = name.split("(", 1)[0]
        s = re.sub(r"<.*>", "<>", s) if "<" in s else s
        s = s.removeprefix("void ").strip() or name
    return s if len(s) <= NAME_MAX else s[: NAME_MAX - 1] + "…"


def select(
    kernels: pa.Table, layer: int | None, step: int | None, rank: int | None = None
) -> pa.Table:
    """The kernels of ``layer`` (None: every layer) in ``step`` (None: those without a step)
    and ``rank`` (None: every rank), unordered."""
    k = kernels
    if rank is not None and "rank" in k.column_names:
        k = k.filter(pc.fill_null(pc.equal(k["rank"], rank), False))
    if layer is not None:
        k = k.filter(pc.fill_null(pc.equal(k["layer"], layer), False))
    if step is None:
        return k.filter(pc.is_null(k["step"]))
    return k.filter(pc.fill_null(pc.equal(k["step"], step), False))


def steps_of(kernels: pa.Table, layer: int | None, rank: int | None = None) -> list[int]:
    """The steps holding kernels of ``layer`` (every layer for None), ascending."""
    k = kernels
    if rank is not None and "rank" in k.column_names:
        k = k.filter(pc.fill_null(pc.equal(k["rank"], rank), False))
    if layer is not None:
        k = k.filter(pc.fill_null(pc.equal(k["layer"], layer), False))
    return sorted(int(s) for s in pc.unique(k["step"].drop_null()).to_pylist())


def median_step(kernels: pa.Table, layer: int | None, rank: int | None = None) -> int | None:
    """The median of the layer's steps (the lower one of an even count); None where the kernels
    carry no step numbers."""
    steps = steps_of(kernels, layer, rank)
    return steps[(len(steps) - 1) // 2] if steps else None


def layers_of(kernels: pa.Table) -> list[int]:
    """The layers the kernels are attributed to, ascending."""
    return sorted(int(x) for x in pc.unique(kernels["layer"].drop_null()).to_pylist())


def layer_timeline(
    kernels: pa.Table,
    layer: int | None,
    step: int | None,
    rank: int | None = None,
    limits: occupancy.SmLimits | None = None,
) -> pa.Table:
    """The kernels of ``layer`` (None: all) in ``step`` (None: those without a step) and
    ``rank``, in start order: ``start_us``, ``end_us`` (from the first start), ``dur_us``,
    ``gap_us`` (start minus the latest earlier end; null for the first), ``share_us`` (what
    the kernel adds to the timeline: see the module docstring), ``op``, ``kernel``
    (:func:`short_name`), ``stream``, ``grid`` ("x,y,z"), ``ctas_sm`` and ``waves``
    (:func:`resident`, with ``limits``: the run's per-SM limits, :func:`.occupancy.run_limits`;
    None: empty) and the full ``name``."""
    before = previous_layer_end(kernels, layer, step, rank)
    k = select(kernels, layer, step, rank)
    if k.num_rows == 0:
        return pa.table(
            {
                c: pa.array([], t)
                for c, t in (
                    ("start_us", pa.float64()), ("end_us", pa.float64()),
                    ("dur_us", pa.float64()), ("gap_us", pa.float64()),
                    ("share_us", pa.float64()), ("op", pa.string()),
                    ("kernel", pa.string()), ("stream", pa.int64()), ("grid", pa.string()),
                    ("ctas_sm", pa.int64()), ("waves", pa.float64()), ("name", pa.string()),
                )
            }
        )  # fmt: skip
    start = k["start_ns"].to_numpy(zero_copy_only=False).astype(np.int64)
    end = k["end_ns"].to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.lexsort((end, start))
    start, end = start[order], end[order]
    t0 = start[0]
    prev_end = np.maximum.accumulate(end)
    gap = np.empty(len(start), dtype=np.float64)
    gap[0] = np.nan
    gap[1:] = (start[1:] - prev_end[:-1]) / 1e3
    share = metrics.first_ending_shares(start if before is None else np.maximum(start, before),
                                        end) / 1e3  # fmt: skip
    names = k["name"].to_pylist()
    ops = k["op"].to_pylist() if "op" in k.column_names else [None] * k.num_rows
    streams = k["stream"].to_pylist() if "stream" in k.column_names else [None] * k.num_rows

    def dims(i: int) -> str | None:
        vals = [k[f"grid_{c}"][i].as_py() if f"grid_{c}" in k.column_names else None
                for c in "xyz"]  # fmt: skip
        if all(v is None for v in vals):
            return None
        return ",".join("-" if v is None else str(v) for v in vals)

    ctas, wv = resident(k, limits)
    return pa.table(
        {
            "start_us": pa.array((start - t0) / 1e3, pa.float64()),
            "end_us": pa.array((end - t0) / 1e3, pa.float64()),
            "dur_us": pa.array((end - start) / 1e3, pa.float64()),
            "gap_us": pa.array(gap, pa.float64(), mask=np.isnan(gap)),
            "share_us": pa.array(share, pa.float64()),
            "op": pa.array([ops[i] for i in order], pa.string()),
            "kernel": pa.array([short_name(names[i]) for i in order], pa.string()),
            "stream": pa.array([streams[i] for i in order], pa.int64()),
            "grid": pa.array([dims(int(i)) for i in order], pa.string()),
            "ctas_sm": pa.array([ctas[i] for i in order], pa.int64()),
            "waves": pa.array([wv[i] for i in order], pa.float64()),
            "name": pa.array([names[i] for i in order], pa.string()),
        }
    )


def resident(
    k: pa.Table, limits: occupancy.SmLimits | None
) -> tuple[list[int | None], list[float | None]]:
    """Per kernel record of ``k``: the CTAs of it resident on one SM at once and the waves its
    grid makes (:mod:`.occupancy`), from its block, registers and shared memory and the GPU's
    per-SM ``limits``; None where a figure or the limits are unknown."""
    n = k.num_rows
    if limits is None:
        return [None] * n, [None] * n

    def col(name: str) -> list:
        return k[name].to_pylist() if name in k.column_names else [None] * n

    regs = col("registers")
    ss, sd = col("shared_static"), col("shared_dynamic")
    g = [col(f"grid_{c}") for c in "xyz"]
    b = [col(f"block_{c}") for c in "xyz"]
    ctas: list[int | None] = []
    wv: list[float | None] = []
    for i in range(n):
        gx, bx = g[0][i], b[0][i]
        if gx is None or bx is None or regs[i] is None:
            ctas.append(None)
            wv.append(None)
            continue
        threads = bx * (b[1][i] or 1) * (b[2][i] or 1)
        c = occupancy.ctas_per_sm(threads, regs[i], (ss[i] or 0) + (sd[i] or 0), limits)
        ctas.append(c)
        wv.append(occupancy.waves(gx * (g[1][i] or 1) * (g[2][i] or 1), c, limits))
    return ctas, wv


def previous_layer_end(
    kernels: pa.Table, layer: int | None, step: int | None, rank: int | None = None
) -> int | None:
    """The last kernel end (ns) of the layer before ``layer`` in ``step`` and ``rank``: the one
    of the next lower index that ran there, as :mod:`.metrics` takes it for the layer share;
    None for the step's first layer, for ``layer`` or ``step`` None."""
    if layer is None or step is None:
        return None
    k = select(kernels, None, step, rank)
    k = k.filter(pc.fill_null(pc.less(k["layer"], layer), False))
    if k.num_rows == 0:
        return None
    prev = pc.max(k["layer"]).as_py()
    return int(pc.max(k.filter(pc.equal(k["layer"], prev))["end_ns"]).as_py())


def summary(t: pa.Table) -> dict:
    """``kernels``, ``span_us`` (last end - first start), ``busy_us`` (covered by at least one
    kernel), ``idle_us`` (span - busy: the bubbles), ``overlap_us`` (the negative gaps summed:
    for each kernel, how long before the latest earlier end it started), ``shares_us`` (the
    kernels' shares summed: the busy time after the previous layer's end)."""
    if t.num_rows == 0:
        return {"kernels": 0, "span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "overlap_us": 0.0,
                "shares_us": 0.0}  # fmt: skip
    s = t["start_us"].to_numpy()
    e = t["end_us"].to_numpy()
    busy, cur_s, cur_e = 0.0, s[0], e[0]
    for a, b in zip(s[1:], e[1:], strict=True):
        if a > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = a, b
        else:
            cur_e = max(cur_e, b)
    busy += cur_e - cur_s
    span = float(e.max() - s.min())
    gaps = t["gap_us"].drop_null().to_numpy()
    return {
        "kernels": t.num_rows,
        "span_us": span,
        "busy_us": float(busy),
        "idle_us": float(span - busy),
        "overlap_us": float(-gaps[gaps < 0].sum()) if (gaps < 0).any() else 0.0,
        "shares_us": float(t["share_us"].to_numpy().sum()),
    }
