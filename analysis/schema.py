"""The data model: Arrow schemas of a run's tables (DESIGN.md section 5) and the ``Run`` value.

A run is one capture or one imported trace. It holds one row of metadata (``runs``) and four
event tables. Strings that repeat (kernel names, range paths, ops) are dictionary-encoded.
Times are integer nanoseconds on the source's clock; durations are ``end_ns - start_ns``.

This module is pure: it builds and checks tables, it never reads or writes files
(``decodescope.tracer.store`` does that).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = 1

UNATTRIBUTED = "(unattributed)"

_dict_str = pa.dictionary(pa.int32(), pa.string())

RUNS = pa.schema(
    [
        ("run_id", pa.string()),
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("schema_version", pa.int32()),
        ("source", pa.string()),  # cupti | kineto | nsys
        ("source_path", pa.string()),
        ("workload", pa.string()),
        ("backend", pa.string()),  # standard | specialized | other
        ("preset", pa.string()),
        ("batch", pa.int32()),
        ("tokens_per_seq", pa.int32()),
        ("tp_shape", pa.int32()),
        ("tp_world", pa.int32()),
        ("graph_mode", pa.string()),  # graph | eager | mixed | unknown
        ("gpu", pa.string()),
        ("driver", pa.string()),
        ("cuda", pa.string()),
        ("torch", pa.string()),
        ("cutlass_dsl", pa.string()),
        ("git_commit", pa.string()),
        ("host", pa.string()),
        ("notes", pa.string()),
        ("config_json", pa.string()),
        ("copy_bw_tbs", pa.float64()),
        ("gemm_tflops", pa.float64()),  # BF16 GEMM rate beside the run (since session 38)
        ("layer_bytes", pa.map_(pa.string(), pa.int64())),
        ("dropped_records", pa.int64()),
        ("partial", pa.bool_()),
    ],
    metadata={"decodescope.schema_version": str(SCHEMA_VERSION), "decodescope.table": "runs"},
)

KERNELS = pa.schema(
    [
        ("run_id", _dict_str),
        ("rank", pa.int32()),
        ("device", pa.int32()),
        ("stream", pa.int64()),
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("name", _dict_str),  # demangled, short
        ("mangled", _dict_str),  # as the source gave it
        ("correlation_id", pa.int64()),
        ("graph_id", pa.int64()),
        ("graph_node_id", pa.int64()),
        ("grid_x", pa.int32()),
        ("grid_y", pa.int32()),
        ("grid_z", pa.int32()),
        ("block_x", pa.int32()),
        ("block_y", pa.int32()),
        ("block_z", pa.int32()),
        ("registers", pa.int32()),
        ("shared_static", pa.int32()),
        ("shared_dynamic", pa.int32()),
        # the host side of the launch that produced this kernel (runtime / driver API record)
        ("launch_api", _dict_str),
        ("launch_thread", pa.int64()),
        ("launch_start_ns", pa.int64()),
        ("step", pa.int32()),
        # attribution (DESIGN.md section 8)
        ("range_path", _dict_str),
        ("layer", pa.int32()),
        ("layer_kind", _dict_str),  # kda | mla | dense | null
        ("block", _dict_str),  # attn | moe | mlp | ... (the layer's block, not the thread block)
        ("op", _dict_str),
    ],
    metadata={"decodescope.schema_version": str(SCHEMA_VERSION), "decodescope.table": "kernels"},
)

RANGES = pa.schema(
    [
        ("run_id", _dict_str),
        ("rank", pa.int32()),
        ("range_id", pa.int64()),
        ("thread", pa.int64()),
        ("timeline", _dict_str),  # cpu | gpu (Kineto's gpu_user_annotation)
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("domain", _dict_str),
        ("name", _dict_str),
        ("path", _dict_str),  # names from the outermost range, joined by "/"
        ("depth", pa.int32()),
        ("parent", pa.int64()),  # range_id of the enclosing range, null at the top
    ],
    metadata={"decodescope.schema_version": str(SCHEMA_VERSION), "decodescope.table": "ranges"},
)

MEMOPS = pa.schema(
    [
        ("run_id", _dict_str),
        ("rank", pa.int32()),
        ("device", pa.int32()),
        ("stream", pa.int64()),
        ("kind", _dict_str),  # memcpy_htod | memcpy_dtoh | memcpy_dtod | memcpy_other | memset
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("bytes", pa.int64()),
        ("correlation_id", pa.int64()),
        ("graph_id", pa.int64()),
        ("graph_node_id", pa.int64()),
        ("step", pa.int32()),
        ("range_path", _dict_str),
        ("layer", pa.int32()),
        ("op", _dict_str),
    ],
    metadata={"decodescope.schema_version": str(SCHEMA_VERSION), "decodescope.table": "memops"},
)

OVERHEADS = pa.schema(
    [
        ("run_id", _dict_str),
        ("rank", pa.int32()),
        ("kind", _dict_str),  # e.g. cupti_buffer_flush | dropped_records | conversion_errors
        ("start_ns", pa.int64()),
        ("end_ns", pa.int64()),
        ("count", pa.int64()),
        ("detail", pa.string()),
    ],
    metadata={"decodescope.schema_version": str(SCHEMA_VERSION), "decodescope.table": "overheads"},
)

TABLES: dict[str, pa.Schema] = {
    "runs": RUNS,
    "kernels": KERNELS,
    "ranges": RANGES,
    "memops": MEMOPS,
    "overheads": OVERHEADS,
}


class SchemaError(ValueError):
    """A table does not match the decodescope schema."""


def empty(name: str) -> pa.Table:
    """An empty table of the named schema."""
    return TABLES[name].empty_table()


def conform(table: pa.Table, name: str) -> pa.Table:
    """Return ``table`` with exactly the columns of schema ``name``, in order and cast.

    Missing nullable columns are added as nulls; extra columns are an error (nothing is dropped
    silently).
    """
    schema = TABLES[name]
    extra = set(table.column_names) - set(schema.names)
    if extra:
        raise SchemaError(f"table {name!r} has columns not in the schema: {sorted(extra)}")
    n = table.num_rows
    cols = []
    for field in schema:
        if field.name in table.column_names:
            col = table.column(field.name)
            if col.type != field.type:
                try:
                    col = col.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise SchemaError(
                        f"table {name!r} column {field.name!r}: cannot cast {col.type} to {field.type}: {e}"
                    ) from e
        else:
            col = pa.nulls(n, type=field.type)
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=schema)


def from_pydict(columns: Mapping[str, Any], name: str) -> pa.Table:
    """Build a table of schema ``name`` from a dict of columns (lists or arrays); others null."""
    schema = TABLES[name]
    n = None
    arrays = {}
    for k, v in columns.items():
        if k not in schema.names:
            raise SchemaError(f"table {name!r} has no column {k!r}")
        field = schema.field(k)
        arr = (
            v if isinstance(v, pa.Array | pa.ChunkedArray) else pa.array(v, type=_plain(field.type))
        )
        if arr.type != field.type:
            arr = arr.cast(field.type)
        arrays[k] = arr
        n = len(arr) if n is None else n
        if len(arr) != n:
            raise SchemaError(f"table {name!r}: column {k!r} has {len(arr)} rows, expected {n}")
    n = n or 0
    cols = [arrays.get(f.name, pa.nulls(n, type=f.type)) for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


def _plain(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_dictionary(t) else t


@dataclasses.dataclass(frozen=True)
class RunMeta:
    """One row of the ``runs`` table. Unknown values stay ``None``."""

    run_id: str
    source: str
    created_at: Any = None  # datetime (UTC)
    schema_version: int = SCHEMA_VERSION
    source_path: str | None = None
    workload: str | None = None
    backend: str | None = None
    preset: str | None = None
    batch: int | None = None
    tokens_per_seq: int | None = None
    tp_shape: int | None = None
    tp_world: int | None = None
    graph_mode: str | None = None
    gpu: str | None = None
    driver: str | None = None
    cuda: str | None = None
    torch: str | None = None
    cutlass_dsl: str | None = None
    git_commit: str | None = None
    host: str | None = None
    notes: str | None = None
    config_json: str | None = None
    copy_bw_tbs: float | None = None
    gemm_tflops: float | None = None
    layer_bytes: dict[str, int] | None = None
    dropped_records: int | None = None
    partial: bool | None = None

    def to_table(self) -> pa.Table:
        row = dataclasses.asdict(self)
        if row["layer_bytes"] is not None:
            row["layer_bytes"] = list(row["layer_bytes"].items())
        return pa.Table.from_pylist([row], schema=RUNS)

    @classmethod
    def from_table(cls, table: pa.Table) -> RunMeta:
        if table.num_rows != 1:
            raise SchemaError(f"runs table must hold exactly one row, found {table.num_rows}")
        row = table.to_pylist()[0]
        known = {f.name for f in dataclasses.fields(cls)}
        row = {k: v for k, v in row.items() if k in known}
        if row.get("layer_bytes") is not None:
            row["layer_bytes"] = dict(row["layer_bytes"])
        return cls(**row)

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json) if self.config_json else {}

    def replace(self, **changes: Any) -> RunMeta:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Run:
    """A run: its metadata and its event tables, each conforming to its schema."""

    meta: RunMeta
    kernels: pa.Table = dataclasses.field(default_factory=lambda: empty("kernels"))
    ranges: pa.Table = dataclasses.field(default_factory=lambda: empty("ranges"))
    memops: pa.Table = dataclasses.field(default_factory=lambda: empty("memops"))
    overheads: pa.Table = dataclasses.field(default_factory=lambda: empty("overheads"))

    def __post_init__(self) -> None:
        for name in ("kernels", "ranges", "memops", "overheads"):
            t = getattr(self, name)
            if t.schema != TABLES[name]:
                object.__setattr__(self, name, conform(t, name))

    @property
    def run_id(self) -> str:
        return self.meta.run_id

    def tables(self) -> dict[str, pa.Table]:
        return {
            "runs": self.meta.to_table(),
            "kernels": self.kernels,
            "ranges": self.ranges,
            "memops": self.memops,
            "overheads": self.overheads,
        }

    def replace(self, **changes: Any) -> Run:
        return dataclasses.replace(self, **changes)
