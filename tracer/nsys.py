"""Import an Nsight Systems SQLite export (``nsys export --type sqlite``) as a raw run.

What is read (export schemas 2.9 to 3.25; every optional table and column is looked up first):

- ``CUPTI_ACTIVITY_KIND_KERNEL`` -> ``kernels``: one row per kernel execution. Names come from
  ``StringIds`` (``shortName``, falling back to ``demangledName``; ``mangledName`` as given).
  The launch side (``launch_api``, ``launch_thread``, ``launch_start_ns``) is joined in SQLite
  from ``CUPTI_ACTIVITY_KIND_RUNTIME`` on (process, ``correlationId``); API names lose their
  version suffix (``cudaLaunchKernel_v7000`` -> ``cudaLaunchKernel``).
- ``CUPTI_ACTIVITY_KIND_MEMCPY`` / ``_MEMSET`` -> ``memops``.
- ``NVTX_EVENTS`` push/pop and start/end ranges -> ``ranges`` (``timeline`` "cpu", ``thread`` the
  OS thread id), with domain names from the domain-create events and path / depth / parent from
  nesting on each thread. Marks are not ranges: they are counted in the run's config.
- ``CUPTI_ACTIVITY_KIND_OVERHEAD`` / ``PROFILER_OVERHEAD`` -> ``overheads``.
- ``TARGET_INFO_*``, ``EXPORT_META_DATA`` / ``META_DATA_EXPORT`` -> the run's metadata.

``rank`` is the CUDA device id: an export holds one process per GPU at most as often as not, and
nothing in it names a distributed rank. Ranges and overheads take the device of their process when
that process ran kernels on exactly one device, else 0.

Importers return a *raw* run (docs/internal-api.md): attribution is ``analysis.attribution``'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decodescope.analysis import schema
from decodescope.analysis.schema import Run, RunMeta
from decodescope.tracer.errors import TraceError

__all__ = ["load_nsys"]

KERNEL_TABLE = "CUPTI_ACTIVITY_KIND_KERNEL"
RUNTIME_TABLE = "CUPTI_ACTIVITY_KIND_RUNTIME"

# NVTX_EVENTS.eventType (ENUM_NSYS_EVENT_TYPE): ranges, marks, domain names.
NVTX_RANGE_TYPES = (59, 60, 70, 71)  # PushPop, StartEnd, and their NVTXT (text-file) forms
NVTX_MARK_TYPES = (34, 65)  # Mark, NVTXT Mark
NVTX_DOMAIN_CREATE = 75

# CUPTI_ACTIVITY_KIND_MEMCPY.copyKind (ENUM_CUDA_MEMCPY_OPER) -> memops.kind. Arrays live on the
# device; peer-to-peer and unified-memory copies keep their direction.
COPY_KINDS = {
    1: "memcpy_htod",  # Host-to-Device
    2: "memcpy_dtoh",  # Device-to-Host
    3: "memcpy_htod",  # Host-to-Array
    4: "memcpy_dtoh",  # Array-to-Host
    5: "memcpy_dtod",  # Array-to-Array
    6: "memcpy_dtod",  # Array-to-Device
    7: "memcpy_dtod",  # Device-to-Array
    8: "memcpy_dtod",  # Device-to-Device
    10: "memcpy_dtod",  # Peer-to-Peer
    11: "memcpy_htod",  # Unified Host-to-Device
    12: "memcpy_dtoh",  # Unified Device-to-Host
    13: "memcpy_dtod",  # Unified Device-to-Device
}  # 0 (unknown), 9 (host-to-host) and anything newer: memcpy_other

# ENUM_CUPTI_OVERHEAD_TYPE, for exports without that table; rows without a type: "profiler".
OVERHEAD_KINDS = {
    0: "undefined",
    1: "unknown",
    2: "driver_compiler",
    3: "cupti_buffer_flush",
    4: "cupti_instrumentation",
    5: "cupti_resource",
    6: "runtime_triggered_module_loading",
    7: "lazy_function_loading",
    8: "command_buffer_full",
}

SQLITE_MAGIC = b"SQLite format 3\x00"
LOCK_TIMEOUT_S = 2.0  # how long to wait for a database another process holds locked

_API_SUFFIX = re.compile(r"(?:_v\d+)?(?:_ptsz|_ptds)?(?:_v\d+)?$")
_GRAPH_LAUNCH = r"^(cudaGraphLaunch|cuGraphLaunch)"  # launch_api, version suffix stripped
_TID_MASK = 0xFFFFFF  # globalTid: tid in bits 0-23, pid in bits 24-47, VM / host above


def load_nsys(
    path: str | os.PathLike[str],
    *,
    run_id: str | None = None,
    rank: int | None = None,
    kernel_names: str = "short",
) -> Run:
    """Read the Nsight Systems SQLite export at ``path`` as a raw :class:`Run`.

    ``run_id`` defaults to a stable id derived from the file's content. ``rank`` defaults to the
    CUDA device id of each kernel / memop (and of the process, for ranges); give it to import the
    export of one rank of a distributed job, whose process saw its GPU as device 0.
    ``kernel_names``: ``"short"`` (default: the function name without template arguments or
    parameters, e.g. ``vectorized_elementwise_kernel``) or ``"demangled"`` (the full demangled
    signature). Raises :class:`TraceError` (one line naming the file) for anything unreadable,
    including an export without a kernel table.
    """
    if kernel_names not in ("short", "demangled"):
        raise ValueError(f"kernel_names must be 'short' or 'demangled', not {kernel_names!r}")
    p = Path(path)
    if not p.is_file():
        raise TraceError(p, "no such file" if not p.exists() else "not a regular file")
    try:
        with open(p, "rb") as f:
            head = f.read(len(SQLITE_MAGIC))
    except OSError as e:
        raise TraceError(p, f"cannot read: {e.strerror or e}") from None
    if head != SQLITE_MAGIC:
        found = "an empty file" if not head else f"{head[:8]!r}..."
        raise TraceError(
            p, f"not a SQLite database (expected an Nsight Systems export), found {found}"
        )
    try:
        con = _connect(p)
    except (sqlite3.Error, UnicodeDecodeError) as e:  # a damaged schema can fail to decode
        raise TraceError(p, f"cannot open as SQLite: {e}") from None
    try:
        run = _Export(p, con, kernel_names).run(run_id)
    except sqlite3.Error as e:
        raise TraceError(p, f"cannot read as an Nsight Systems SQLite export: {e}") from None
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as e:
        # a damaged export: values of the wrong type where nsys always writes integers
        raise TraceError(p, f"unexpected values in the export ({type(e).__name__}: {e})") from None
    finally:
        con.close()
    if rank is not None:
        run = run.replace(**{name: _with_rank(getattr(run, name), rank) for name in _EVENT_TABLES})
    return run


def decode_text(raw: bytes) -> str:
    """SQLite TEXT as str: UTF-8, or Latin-1 where the bytes are not UTF-8 (old Windows exports)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def query(con: sqlite3.Connection, sql: str, params: Sequence[Any] = ()) -> tuple[list[tuple], int]:
    """Rows of ``sql`` and how many columns it selects; text decoded by :func:`decode_text`.

    SQLite's own UTF-8 decoding runs first (a Python ``text_factory`` costs a call per value);
    a query whose text is not all UTF-8 is run again with :func:`decode_text`.
    """
    con.text_factory = str
    try:
        cur = con.execute(sql, params)
        return cur.fetchall(), len(cur.description or ())
    except sqlite3.OperationalError as e:
        if "decode" not in str(e).lower():
            raise
    con.text_factory = decode_text
    try:
        cur = con.execute(sql, params)
        return cur.fetchall(), len(cur.description or ())
    finally:
        con.text_factory = str


def _connect(path: Path) -> sqlite3.Connection:
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True, timeout=LOCK_TIMEOUT_S)
    try:
        con.execute("SELECT count(*) FROM sqlite_master").fetchone()  # "not a database" here
    except BaseException:
        con.close()
        raise
    return con


class _Export:
    """One open export: what tables and columns it has, and the queries that build each table."""

    def __init__(self, path: Path, con: sqlite3.Connection, kernel_names: str) -> None:
        self.path = path
        self.con = con
        self.kernel_names = kernel_names
        self._columns: dict[str, set[str]] = {}
        self._strings: dict[int, str] = {}
        self.notes: dict[str, Any] = {}
        self.tables = {
            r[0]
            for r in self.rows("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")
        }

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple]:
        return query(self.con, sql, params)[0]

    def cols(self, sql: str) -> list[tuple]:
        """The query's result as column tuples (empty ones when there are no rows)."""
        rows, n = query(self.con, sql)
        return _columns(rows, n)

    # -- schema discovery ------------------------------------------------------------------------

    def columns(self, table: str) -> set[str]:
        if table not in self._columns:
            if table not in self.tables:
                self._columns[table] = set()
            else:
                rows = self.rows(f'PRAGMA table_info("{table}")')
                self._columns[table] = {r[1] for r in rows}
        return self._columns[table]

    def col(self, table: str, alias: str, name: str) -> str:
        """``alias.name`` where the column exists, else ``NULL`` (columns come and go by version)."""
        return f"{alias}.{name}" if name in self.columns(table) else "NULL"

    def strings(self, ids: Sequence[int | None]) -> dict[int, str]:
        """``StringIds`` values of ``ids`` (only those: a large export holds many strings)."""
        want = sorted({i for i in ids if i is not None and i not in self._strings})
        if want and "StringIds" in self.tables:
            for lo in range(0, len(want), 500):
                chunk = want[lo : lo + 500]
                marks = ", ".join("?" * len(chunk))
                self._strings.update(
                    self.rows(f"SELECT id, value FROM StringIds WHERE id IN ({marks})", chunk)
                )
        return self._strings

    # -- the run ---------------------------------------------------------------------------------

    def run(self, run_id: str | None) -> Run:
        if KERNEL_TABLE not in self.tables:
            found = ", ".join(sorted(t for t in self.tables if not t.startswith("ENUM_"))[:8])
            raise TraceError(
                self.path,
                f"no GPU kernel table ({KERNEL_TABLE}): not an Nsight Systems export with CUDA "
                f"kernel trace (export a report captured with --trace=cuda); "
                f"found tables: {found or 'none'}",
            )
        kernels, pid_device = self.kernels()
        memops = self.memops()
        ranges = self.ranges(pid_device)
        overheads = self.overheads(pid_device)
        meta = self.meta(kernels, pid_device, run_id)
        run_id = meta.run_id
        return Run(
            meta=meta,
            kernels=_with_run_id(kernels, run_id),
            ranges=_with_run_id(ranges, run_id),
            memops=_with_run_id(memops, run_id),
            overheads=_with_run_id(overheads, run_id),
        )

    # -- kernels ---------------------------------------------------------------------------------

    def kernels(self) -> tuple[pa.Table, dict[int, int]]:
        k = KERNEL_TABLE
        if "StringIds" not in self.tables:
            raise TraceError(self.path, "no StringIds table: kernel names cannot be resolved")
        has_runtime = {"correlationId", "nameId", "globalTid"} <= self.columns(RUNTIME_TABLE)
        has_pid = "globalPid" in self.columns(k)
        short = "k.shortName" if "shortName" in self.columns(k) else "k.demangledName"
        name_expr = (
            "k.demangledName"
            if self.kernel_names == "demangled"
            else f"CASE WHEN sn.value IS NULL OR sn.value = '' THEN k.demangledName ELSE {short} END"
        )
        launch_cols = "NULL, NULL, NULL"
        launch_join = ""
        if has_runtime:
            # One launch record per (process, correlation id): the earliest (the outermost call
            # where a runtime call and the driver call under it share the id).
            launch_cols = "r.nameId, r.globalTid, r.start"
            pid_match = "AND (k.globalPid IS NULL OR r.pid = k.globalPid >> 24)" if has_pid else ""
            launch_join = f"""
                LEFT JOIN (
                    SELECT correlationId, globalTid >> 24 AS pid, nameId, globalTid, min(start) AS start
                    FROM {RUNTIME_TABLE}
                    WHERE correlationId IN (SELECT correlationId FROM {k})
                    GROUP BY correlationId, pid
                ) r ON r.correlationId = k.correlationId {pid_match}"""
        sql = f"""
            SELECT k.start, k.end, k.deviceId, k.streamId, k.correlationId,
                   {self.col(k, "k", "graphId")}, {self.col(k, "k", "graphNodeId")},
                   k.gridX, k.gridY, k.gridZ, k.blockX, k.blockY, k.blockZ,
                   k.registersPerThread, k.staticSharedMemory, k.dynamicSharedMemory,
                   {name_expr}, {self.col(k, "k", "mangledName")},
                   {"k.globalPid" if has_pid else "NULL"}, {launch_cols}
            FROM {k} k
            LEFT JOIN StringIds sn ON sn.id = {short}
            {launch_join}
            ORDER BY k.start, k.deviceId, k.streamId"""
        cols = self.cols(sql)
        (start, end, device, stream, corr, graph_id, node_id, gx, gy, gz, bx, by, bz, regs, smem_s,
         smem_d, name_id, mangled_id, gpid, api_id, launch_tid, launch_start) = cols  # fmt: skip
        device_arr = pa.array(device, pa.int32())
        table = schema.from_pydict(
            {
                "rank": device_arr,
                "device": device_arr,
                "stream": pa.array(stream, pa.int64()),
                "start_ns": pa.array(start, pa.int64()),
                "end_ns": pa.array(end, pa.int64()),
                "name": _interned(name_id, self.strings),
                "mangled": _interned(mangled_id, self.strings),
                "correlation_id": pa.array(corr, pa.int64()),
                "graph_id": pa.array(graph_id, pa.int64()),
                "graph_node_id": pa.array(node_id, pa.int64()),
                "grid_x": pa.array(gx, pa.int32()),
                "grid_y": pa.array(gy, pa.int32()),
                "grid_z": pa.array(gz, pa.int32()),
                "block_x": pa.array(bx, pa.int32()),
                "block_y": pa.array(by, pa.int32()),
                "block_z": pa.array(bz, pa.int32()),
                "registers": pa.array(regs, pa.int32()),
                "shared_static": pa.array(smem_s, pa.int32()),
                "shared_dynamic": pa.array(smem_d, pa.int32()),
                "launch_api": _interned(api_id, self.strings, transform=_api_name),
                "launch_thread": _tid(launch_tid),
                "launch_start_ns": pa.array(launch_start, pa.int64()),
            },
            "kernels",
        )
        # process -> the one device it ran kernels on (ranges and overheads take it as rank)
        devices_of: dict[int, set[int]] = {}
        for g, d in set(zip(gpid, device, strict=True)):
            if g is not None:
                devices_of.setdefault(g >> 24, set()).add(d)
        pid_device = {pid: next(iter(ds)) for pid, ds in devices_of.items() if len(ds) == 1}
        self.notes["kernels_without_launch_record"] = (
            table.column("launch_api").null_count if has_runtime else None
        )
        self.notes["runtime_table"] = has_runtime
        return table, pid_device

    # -- memops ----------------------------------------------------------------------------------

    def memops(self) -> pa.Table:
        parts = []
        for table, kind in (
            ("CUPTI_ACTIVITY_KIND_MEMCPY", "c.copyKind"),
            ("CUPTI_ACTIVITY_KIND_MEMSET", "-1"),
        ):
            if table not in self.tables:
                continue
            parts.append(
                f"""SELECT c.start, c.end, c.deviceId, c.streamId, {kind}, c.bytes,
                           {self.col(table, "c", "correlationId")},
                           {self.col(table, "c", "graphId")}, {self.col(table, "c", "graphNodeId")}
                    FROM {table} c"""
            )
        if not parts:
            return schema.empty("memops")
        sql = " UNION ALL ".join(parts) + " ORDER BY 1, 3, 4"
        start, end, device, stream, kind, nbytes, corr, graph_id, node_id = self.cols(sql)
        kinds = {-1: "memset", **COPY_KINDS}.get
        device_arr = pa.array(device, pa.int32())
        return schema.from_pydict(
            {
                "rank": device_arr,
                "device": device_arr,
                "stream": pa.array(stream, pa.int64()),
                "kind": _interned(kind, lambda ids: {i: kinds(i, "memcpy_other") for i in ids}),
                "start_ns": pa.array(start, pa.int64()),
                "end_ns": pa.array(end, pa.int64()),
                "bytes": pa.array(nbytes, pa.int64()),
                "correlation_id": pa.array(corr, pa.int64()),
                "graph_id": pa.array(graph_id, pa.int64()),
                "graph_node_id": pa.array(node_id, pa.int64()),
            },
            "memops",
        )

    # -- NVTX ranges -----------------------------------------------------------------------------

    def ranges(self, pid_device: Mapping[int, int]) -> pa.Table:
        t = "NVTX_EVENTS"
        cols = self.columns(t)
        if not {"start", "end", "eventType", "globalTid"} <= cols:
            self.notes.update(nvtx_ranges=0, nvtx_marks=0, nvtx_unclosed_ranges=0)
            return schema.empty("ranges")
        text = "e.text" if "text" in cols else "NULL"
        text_join = ""
        if "textId" in cols and "StringIds" in self.tables:
            text = f"COALESCE({text}, s.value)"
            text_join = "LEFT JOIN StringIds s ON s.id = e.textId"
        domain = self.col(t, "e", "domainId")
        types = ", ".join(map(str, NVTX_RANGE_TYPES))
        marks = ", ".join(map(str, NVTX_MARK_TYPES))
        ((n_marks, n_unclosed),) = self.rows(
            f"""SELECT count(*) FILTER (WHERE eventType IN ({marks})),
                       count(*) FILTER (WHERE eventType IN ({types}) AND end IS NULL)
                FROM {t}"""
        )
        domains = {
            (gtid >> 24 if gtid is not None else None, dom): name
            for gtid, dom, name in self.rows(
                f"SELECT e.globalTid, {domain}, {text} FROM {t} e {text_join} "
                f"WHERE e.eventType = {NVTX_DOMAIN_CREATE}"
            )
        }
        rows = self.rows(
            f"""SELECT e.start, e.end, e.globalTid, {text}, {domain}
                FROM {t} e {text_join}
                WHERE e.eventType IN ({types}) AND e.end IS NOT NULL
                ORDER BY e.globalTid, e.start, e.end DESC, e.rowid"""
        )
        self.notes.update(
            nvtx_ranges=len(rows), nvtx_marks=n_marks, nvtx_unclosed_ranges=n_unclosed
        )
        if not rows:
            return schema.empty("ranges")
        start, end, gtid, names, dom = _columns(rows, 5)
        parent, depth, path = _nest(start, end, gtid, names)
        pid = [g >> 24 if g is not None else None for g in gtid]
        domain_names = [domains.get((p, d)) if d else None for p, d in zip(pid, dom, strict=True)]
        n = len(rows)
        return schema.from_pydict(
            {
                "rank": pa.array([pid_device.get(p, 0) for p in pid], pa.int32()),
                "range_id": pa.array(np.arange(n, dtype=np.int64)),
                "thread": _tid(gtid),
                "timeline": pa.DictionaryArray.from_arrays(
                    pa.array(np.zeros(n, dtype=np.int32)), pa.array(["cpu"])
                ),
                "start_ns": pa.array(start, pa.int64()),
                "end_ns": pa.array(end, pa.int64()),
                "domain": pa.array(domain_names, pa.string()).dictionary_encode(),
                "name": pa.array(names, pa.string()).dictionary_encode(),
                "path": pa.array(path, pa.string()).dictionary_encode(),
                "depth": pa.array(depth, pa.int32()),
                "parent": pa.array(parent, pa.int64()),
            },
            "ranges",
        )

    # -- overheads -------------------------------------------------------------------------------

    def overheads(self, pid_device: Mapping[int, int]) -> pa.Table:
        parts = []
        for table in ("CUPTI_ACTIVITY_KIND_OVERHEAD", "PROFILER_OVERHEAD"):
            if {"start", "end"} <= self.columns(table):  # overheadType: not before schema 3
                parts.append(
                    f"""SELECT start, end, {self.col(table, table, "overheadType")},
                               {self.col(table, table, "globalTid")},
                               {self.col(table, table, "nameId")}, '{table}'
                        FROM {table}"""
                )
        if not parts:
            return schema.empty("overheads")
        rows = self.rows(" UNION ALL ".join(parts) + " ORDER BY 1")
        if not rows:
            return schema.empty("overheads")
        start, end, otype, gtid, name_id, table = _columns(rows, 6)
        strings = self.strings(name_id)
        detail = [
            f"{tab}: {strings[i]}" if i is not None and i in strings else tab
            for tab, i in zip(table, name_id, strict=True)
        ]
        names = dict(OVERHEAD_KINDS)
        if {"id", "name"} <= self.columns("ENUM_CUPTI_OVERHEAD_TYPE"):  # the export's own names
            for i, name in self.rows("SELECT id, name FROM ENUM_CUPTI_OVERHEAD_TYPE"):
                names[i] = name.lower().removeprefix("overhead_")
        kinds = [("profiler" if o is None else names.get(o, f"overhead_{o}")) for o in otype]
        ranks = [pid_device.get(g >> 24, 0) if g is not None else 0 for g in gtid]
        return schema.from_pydict(
            {
                "rank": pa.array(ranks, pa.int32()),
                "kind": pa.array(kinds, pa.string()).dictionary_encode(),
                "start_ns": pa.array(start, pa.int64()),
                "end_ns": pa.array(end, pa.int64()),
                "count": pa.array(np.ones(len(rows), dtype=np.int64)),
                "detail": pa.array(detail, pa.string()),
            },
            "overheads",
        )

    # -- metadata --------------------------------------------------------------------------------

    def key_values(self, table: str, key: str = "name") -> dict[str, str]:
        if not {key, "value"} <= self.columns(table):
            return {}
        return {k: v for k, v in self.rows(f"SELECT {key}, value FROM {table}")}

    def meta(self, kernels: pa.Table, pid_device: Mapping[int, int], run_id: str | None) -> RunMeta:
        export = self.key_values("META_DATA_EXPORT") or self.key_values("EXPORT_META_DATA")
        env = self.key_values("TARGET_INFO_SYSTEM_ENV")
        devices = sorted(pc.unique(kernels.column("device")).drop_null().to_pylist())
        gpus = self.gpu_names(devices)
        graph_mode = self.graph_mode(kernels)
        processes = self.process_names(pid_device)
        session = None
        if "utcEpochNs" in self.columns("TARGET_INFO_SESSION_START_TIME"):
            rows = self.rows("SELECT utcEpochNs FROM TARGET_INFO_SESSION_START_TIME")
            session = rows[0][0] if rows else None
        created_at = None
        if session is not None:
            created_at = pa.scalar(session // 1000, pa.timestamp("us", tz="UTC")).as_py()
        config = {
            "nsys_version": export.get("EXPORT_PRODUCT_VERSION"),
            "export_schema_version": export.get("EXPORT_SCHEMA_VERSION"),
            "export_platform": export.get("EXPORT_PLATFORM"),
            "session_start_utc_ns": session,
            "kernel_names": self.kernel_names,
            "rank": "CUDA device id",
            "devices": devices,
            "gpus": gpus,
            "processes": processes,
            "device": self.device_props(set(gpus.values())),
            "cuda_from": "TARGET_INFO_SYSTEM_ENV.CudaDriverVersion (the driver's CUDA version)",
            "os": env.get("OsDescription"),
            **self.notes,
        }
        return RunMeta(
            run_id=run_id or f"nsys-{_file_digest(self.path)}",
            source="nsys",
            created_at=created_at,
            source_path=str(self.path),
            tp_world=len(devices) or None,
            graph_mode=graph_mode,
            gpu=", ".join(sorted(set(gpus.values()))) or None,
            driver=_driver_version(env.get("NvDriverVersion")),
            cuda=_cuda_version(env.get("CudaDriverVersion")),
            host=env.get("Hostname") or None,
            config_json=json.dumps(config, sort_keys=True, default=str),
            dropped_records=self.notes.get("nvtx_unclosed_ranges"),
        )

    def device_props(self, names: set[str]) -> dict[str, int] | None:
        """The per-SM figures of the one GPU model the kernels ran on (TARGET_INFO_GPU), in
        Kineto's ``deviceProperties`` names (for :mod:`decodescope.analysis.occupancy`); None
        where the export lacks them or the run spans several models."""
        cols = {"name", "smCount", "maxShmemPerSm", "maxRegistersPerSm", "maxWarpsPerSm",
                "threadsPerWarp", "maxBlocksPerSm", "computeMajor", "computeMinor"}  # fmt: skip
        if len(names) != 1 or not cols <= self.columns("TARGET_INFO_GPU"):
            return None
        rows = self.rows(
            "SELECT smCount, maxShmemPerSm, maxRegistersPerSm, maxWarpsPerSm, threadsPerWarp, "
            "maxBlocksPerSm, computeMajor, computeMinor FROM TARGET_INFO_GPU WHERE name = ?",
            (next(iter(names)),),
        )
        if not rows or not all(type(v) is int for v in rows[0]):
            return None
        sms, smem, regs, warps, tpw, blocks, major, minor = rows[0]
        return {"numSms": sms, "sharedMemPerMultiprocessor": smem, "regsPerMultiprocessor": regs,
                "maxThreadsPerMultiprocessor": warps * tpw, "maxBlocksPerSm": blocks,
                "computeMajor": major, "computeMinor": minor}  # fmt: skip

    def gpu_names(self, devices: Sequence[int]) -> dict[str, str]:
        """CUDA device id -> GPU name, through TARGET_INFO_CUDA_DEVICE where the export has it."""
        if not {"id", "name"} <= self.columns("TARGET_INFO_GPU"):
            return {}
        by_gpu_id = {i: n for i, n in self.rows("SELECT id, name FROM TARGET_INFO_GPU") if n}
        cuda_to_gpu: dict[int, int] = {}
        if {"gpuId", "cudaId"} <= self.columns("TARGET_INFO_CUDA_DEVICE"):
            for gpu_id, cuda_id in self.rows(
                "SELECT gpuId, cudaId FROM TARGET_INFO_CUDA_DEVICE WHERE gpuId IS NOT NULL"
            ):
                cuda_to_gpu.setdefault(cuda_id, gpu_id)
        out = {}
        for d in devices:
            name = by_gpu_id.get(cuda_to_gpu.get(d, d))
            if name:
                out[str(d)] = name
        return out

    def graph_mode(self, kernels: pa.Table) -> str:
        """``graph``: every kernel ran from a CUDA graph; ``mixed``: some did; else ``eager``.

        A kernel ran from a graph when it has a ``graphNodeId`` or its launch record is a graph
        launch; ``mixed`` also where the export holds graph launches that no kernel is tied to.
        """
        n = kernels.num_rows
        if not n:
            return "unknown"
        api = pc.cast(kernels.column("launch_api"), pa.string())
        from_graph = pc.or_(
            pc.is_valid(kernels.column("graph_node_id")),
            pc.fill_null(pc.match_substring_regex(api, _GRAPH_LAUNCH), False),
        )
        graph_kernels = pc.sum(from_graph).as_py() or 0
        if graph_kernels == n:
            return "graph"
        if graph_kernels:
            return "mixed"
        if "nameId" in self.columns(RUNTIME_TABLE):
            ((launched,),) = self.rows(
                f"""SELECT EXISTS (SELECT 1 FROM {RUNTIME_TABLE} r JOIN StringIds s ON s.id = r.nameId
                                   WHERE s.value LIKE 'cudaGraphLaunch%'
                                      OR s.value LIKE 'cuGraphLaunch%')"""
            )
            if launched:
                return "mixed"
        return "eager"

    def process_names(self, pid_device: Mapping[int, int]) -> dict[str, str]:
        """OS pid -> name for the processes that ran kernels."""
        if not {"globalPid", "pid", "name"} <= self.columns("PROCESSES") or not pid_device:
            return {}
        out = {}
        for gpid, pid, name in self.rows("SELECT globalPid, pid, name FROM PROCESSES"):
            if gpid is not None and gpid >> 24 in pid_device:
                out[str(pid)] = name
        return out


# -- helpers ---------------------------------------------------------------------------------------


def _columns(rows: list[tuple], n: int) -> list[tuple]:
    """Rows as ``n`` column tuples (empty ones when there are no rows)."""
    return list(zip(*rows, strict=True)) if rows else [()] * n


def _interned(
    ids: Sequence[int | None],
    lookup: Callable[[list[int]], Mapping[int, str]],
    transform: Callable[[str], str] | None = None,
) -> pa.DictionaryArray:
    """Dictionary-encoded strings from ids: one lookup per distinct id, not per row."""
    enc = pa.array(ids, pa.int64()).dictionary_encode()
    distinct = enc.dictionary.to_pylist()
    strings = lookup(distinct)
    values = [strings.get(i) for i in distinct]
    if transform is not None:
        values = [v if v is None else transform(v) for v in values]
    names = pa.array(values, pa.string())
    uniq = names.dictionary_encode()  # distinct ids may share a string
    indices = pc.take(uniq.indices, enc.indices)
    return pa.DictionaryArray.from_arrays(indices.cast(pa.int32()), uniq.dictionary)


def _tid(global_tids: Sequence[int | None]) -> pa.Array:
    """The OS thread id in a serialized globalTid (bits 0-23)."""
    arr = pa.array(global_tids, pa.int64())
    return pc.bit_wise_and(arr, pa.scalar(_TID_MASK, pa.int64()))


def _api_name(name: str) -> str:
    """``cudaLaunchKernel_v7000`` -> ``cudaLaunchKernel``; ``cudaMemcpyAsync_ptsz_v7000`` too."""
    return _API_SUFFIX.sub("", name) or name


def _nest(
    start: Sequence[int], end: Sequence[int], thread: Sequence[int], names: Sequence[str | None]
) -> tuple[list[int | None], list[int], list[str]]:
    """Parent index, depth and path of each range; input sorted by (thread, start, end desc).

    A range's parent is the innermost range on the same thread that contains it. A start/end
    range that only partly overlaps the open one is not inside it (and closes it for nesting).
    """
    n = len(start)
    parent: list[int | None] = [None] * n
    depth = [0] * n
    path = [""] * n
    stack: list[int] = []
    current = object()
    for i in range(n):
        if thread[i] != current:
            current = thread[i]
            stack.clear()
        e = end[i]
        while stack and end[stack[-1]] < e:
            stack.pop()
        name = names[i] or ""
        if stack:
            top = stack[-1]
            parent[i] = top
            depth[i] = len(stack)
            path[i] = f"{path[top]}/{name}"
        else:
            path[i] = name
        stack.append(i)
    return parent, depth, path


_EVENT_TABLES = ("kernels", "ranges", "memops", "overheads")


def _with_rank(table: pa.Table, rank: int) -> pa.Table:
    col = pa.array(np.full(table.num_rows, rank, dtype=np.int32))
    return table.set_column(table.schema.get_field_index("rank"), "rank", col)


def _with_run_id(table: pa.Table, run_id: str) -> pa.Table:
    n = table.num_rows
    col = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([run_id]))
    return table.set_column(table.schema.get_field_index("run_id"), "run_id", col)


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _driver_version(v: str | None) -> str | None:
    """``580.95.05`` as is; Windows exports give ``42600`` for 426.00."""
    if not v:
        return None
    if v.isdigit() and len(v) >= 4:
        return f"{v[:-2]}.{v[-2:]}"
    return v


def _cuda_version(v: str | None) -> str | None:
    """``13010`` -> ``13.1`` (CUDA's encoding: 1000 * major + 10 * minor)."""
    if not v or not v.isdigit():
        return v or None
    n = int(v)
    return f"{n // 1000}.{n % 1000 // 10}"
