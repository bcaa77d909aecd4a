"""The layout of a results dataset (pure helpers; ``decodescope.tracer.dataset`` does the I/O).

A dataset is a folder with one sub-folder per table, each partitioned Hive-style so that DuckDB,
Polars, Spark or pyarrow read it as it is::

    DATASET/<table>/gpu=<gpu>/preset=<preset>/backend=<backend>/run_id=<run_id>/part-0.parquet

One schema per table across runs (the run schemas of :mod:`decodescope.analysis.schema`) minus
the partition columns, which live in the path only (readers add them back). A null value is
written as ``__HIVE_DEFAULT_PARTITION__``, which every one of those readers reads back as null.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa

from decodescope.analysis.schema import TABLES, RunMeta

PARTITIONS = ("gpu", "preset", "backend", "run_id")
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
PART_FILE = "part-0.parquet"
# columns that must agree for a dataset row to serve as a baseline of a run (graph_mode too: an
# eager step of the same layers takes several times a CUDA graph's replay)
BASELINE_KEYS = (
    "workload", "preset", "backend", "batch", "tokens_per_seq", "tp_shape", "tp_world", "gpu",
    "graph_mode",
)  # fmt: skip

_UNSAFE = set('/\\%=:*?"<>|#\n\r\t')


def encode_value(value: Any) -> str:
    """A partition value as a path segment: percent-encode what a path or Hive cannot hold."""
    if value is None or value == "":
        return NULL_PARTITION
    s = str(value)
    return "".join(f"%{ord(c):02X}" if c in _UNSAFE or ord(c) < 32 else c for c in s)


def decode_value(segment: str) -> str | None:
    if segment == NULL_PARTITION:
        return None
    out = []
    i = 0
    while i < len(segment):
        c = segment[i]
        if c == "%" and _is_hex(segment[i + 1 : i + 3]):
            out.append(chr(int(segment[i + 1 : i + 3], 16)))
            i += 3
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _is_hex(s: str) -> bool:
    return len(s) == 2 and all(c in "0123456789abcdefABCDEF" for c in s)


def partition_values(meta: RunMeta) -> dict[str, str | None]:
    return {k: getattr(meta, k) for k in PARTITIONS}


def partition_path(meta: RunMeta) -> str:
    """``gpu=.../preset=.../backend=.../run_id=...`` (relative, "/"-separated)."""
    return "/".join(f"{k}={encode_value(v)}" for k, v in partition_values(meta).items())


def file_schema(table: str) -> pa.Schema:
    """The schema of ``table`` as stored in a dataset: without the partition columns."""
    schema = TABLES[table]
    keep = [f for f in schema if f.name not in PARTITIONS]
    return pa.schema(keep, metadata=schema.metadata)


def strip_partitions(table: pa.Table) -> pa.Table:
    return table.drop_columns([c for c in PARTITIONS if c in table.column_names])


def same_setup(
    a: Mapping[str, Any], b: Mapping[str, Any], keys: Sequence[str] = BASELINE_KEYS
) -> bool:
    return all(a.get(k) == b.get(k) for k in keys)


def setup_differences(
    run: RunMeta, baseline: RunMeta, keys: Sequence[str] = BASELINE_KEYS
) -> list[str]:
    """``"key: run X, baseline Y"`` for each setup column where a run and a baseline run both
    record a value and the values differ ([] where they agree). A column one side leaves unset
    (an imported trace records no preset or batch) is not a difference."""
    out = []
    for k in keys:
        a, b = getattr(run, k, None), getattr(baseline, k, None)
        if a is not None and b is not None and a != b:
            out.append(f"{k}: run {a}, baseline {b}")
    return out


def select_baseline(
    runs: Sequence[Mapping[str, Any]], meta: RunMeta, keys: Sequence[str] = BASELINE_KEYS
) -> list[str]:
    """run_ids of the dataset rows that can serve as a baseline for ``meta``: same workload,
    preset, backend, batch, tokens per sequence, tp_shape, tp_world, gpu and graph mode; never
    the run itself."""
    want = {k: getattr(meta, k) for k in keys}
    return [r["run_id"] for r in runs if r["run_id"] != meta.run_id and same_setup(r, want, keys)]


def median(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None
