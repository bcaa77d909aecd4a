"""The Nsight Systems SQLite importer on the real exports in tests/data/traces.

Every expected figure is taken straight from the file with SQL in the test, independently of
the importer (which joins and nests in its own way).
"""

from __future__ import annotations

import json
import re
import shutil
import sqlite3
from pathlib import Path

import pyarrow as pa
import pytest

from decodescope.analysis import schema
from decodescope.tracer import load, nsys, read_run, write_run
from decodescope.tracer.errors import TraceError
from decodescope.tracer.nsys import load_nsys

TRACES = Path(__file__).parent / "data" / "traces"
EXPORTS = sorted(TRACES.glob("*.sqlite"))
NESTED = TRACES / "nsys_gtx1060_schema2.9.1_nvtx_nested__extrap_profile16.sqlite"
H100X2 = TRACES / "nsys_h100x2_fastvideo_nvtx_aten__nsys-ai_h100_2gpu_1s.sqlite"
RTX3080 = TRACES / "nsys_rtx3080_tiny_full_schema3.24__nsys-ai_mock.sqlite"
RANGE_TYPES = "59, 60, 70, 71"  # NvtxPushPopRange, NvtxStartEndRange and their NVTXT forms


def _sql(path: Path, query: str, factory=None) -> list[tuple]:
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    if factory is not None:
        con.text_factory = factory
    try:
        return con.execute(query).fetchall()
    finally:
        con.close()


def _tables(path: Path) -> set[str]:
    return {r[0] for r in _sql(path, "SELECT name FROM sqlite_master WHERE type = 'table'")}


@pytest.fixture(scope="module")
def runs() -> dict[Path, schema.Run]:
    return {p: load_nsys(p) for p in EXPORTS}


def test_the_three_exports_are_there():
    assert {NESTED, H100X2, RTX3080} <= set(EXPORTS)


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.name[:30])
def test_imports_conform_to_the_schema(runs, path):
    run = runs[path]
    assert run.meta.source == "nsys"
    assert run.meta.source_path == str(path)
    for name, table in run.tables().items():
        assert table.schema == schema.TABLES[name], name
        if name != "runs" and table.num_rows:
            assert table.column("run_id").unique().to_pylist() == [run.run_id]
    # a raw run: importers never attribute
    for col in ("step", "layer", "layer_kind", "block", "op", "range_path"):
        assert run.kernels.column(col).null_count == run.kernels.num_rows
    # the id is derived from the content: the same file gives the same run
    assert load_nsys(path).run_id == run.run_id


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.name[:30])
def test_kernel_count_and_total_time_equal_sql(runs, path):
    ((count, total),) = _sql(
        path, "SELECT count(*), sum(end - start) FROM CUPTI_ACTIVITY_KIND_KERNEL"
    )
    k = runs[path].kernels
    assert count > 0
    assert k.num_rows == count
    ns = pa.compute.subtract(k.column("end_ns"), k.column("start_ns"))
    assert pa.compute.sum(ns).as_py() == total
    assert k.column("name").null_count == 0


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.name[:30])
def test_kernel_fields_equal_sql(runs, path):
    rows = _sql(
        path,
        """SELECT k.start, k.deviceId, k.streamId, k.correlationId, k.gridX, k.gridY, k.gridZ,
                  k.blockX, k.blockY, k.blockZ, k.registersPerThread, k.staticSharedMemory,
                  k.dynamicSharedMemory, s.value, m.value
           FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.shortName
           LEFT JOIN StringIds m ON m.id = k.mangledName""",
    )
    cols = [
        "start_ns",
        "device",
        "stream",
        "correlation_id",
        "grid_x",
        "grid_y",
        "grid_z",
        "block_x",
        "block_y",
        "block_z",
        "registers",
        "shared_static",
        "shared_dynamic",
        "name",
        "mangled",
    ]
    got = runs[path].kernels.select(cols).to_pylist()
    assert sorted(tuple(r[c] for c in cols) for r in got) == sorted(rows)


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.name[:30])
def test_memop_counts_and_bytes_equal_sql(runs, path):
    tables = _tables(path)
    expected: dict[str, tuple[int, int]] = {}
    if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
        for kind, direction in (
            ("memcpy_htod", "1, 3, 11"),
            ("memcpy_dtoh", "2, 4, 12"),
            ("memcpy_dtod", "5, 6, 7, 8, 10, 13"),
        ):
            ((n, b),) = _sql(
                path,
                f"SELECT count(*), coalesce(sum(bytes), 0) FROM CUPTI_ACTIVITY_KIND_MEMCPY "
                f"WHERE copyKind IN ({direction})",
            )
            expected[kind] = (n, b)
        ((n, b),) = _sql(
            path,
            "SELECT count(*), coalesce(sum(bytes), 0) FROM CUPTI_ACTIVITY_KIND_MEMCPY "
            "WHERE copyKind NOT IN (1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13)",
        )
        expected["memcpy_other"] = (n, b)
    if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
        ((n, b),) = _sql(
            path, "SELECT count(*), coalesce(sum(bytes), 0) FROM CUPTI_ACTIVITY_KIND_MEMSET"
        )
        expected["memset"] = (n, b)
    expected = {k: v for k, v in expected.items() if v[0]}
    assert expected, "every export here holds memory operations"
    m = runs[path].memops
    got: dict[str, tuple[int, int]] = {}
    for row in m.select(["kind", "bytes"]).to_pylist():
        n, b = got.get(row["kind"], (0, 0))
        got[row["kind"]] = (n + 1, b + row["bytes"])
    assert got == expected
    counts = [
        _sql(path, f"SELECT count(*) FROM {t}")[0][0]
        for t in ("CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET")
        if t in tables
    ]
    assert m.num_rows == sum(counts)


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.name[:30])
def test_nvtx_range_count_equals_sql(runs, path):
    r = runs[path].ranges
    if "NVTX_EVENTS" not in _tables(path):
        assert r.num_rows == 0
        return
    ((n, marks),) = _sql(
        path,
        f"""SELECT count(*) FILTER (WHERE eventType IN ({RANGE_TYPES}) AND end IS NOT NULL),
                   count(*) FILTER (WHERE eventType IN (34, 65))
            FROM NVTX_EVENTS""",
    )
    assert r.num_rows == n
    config = runs[path].meta.config
    assert config["nvtx_ranges"] == n
    assert config["nvtx_marks"] == marks
    assert set(r.column("timeline").to_pylist()) <= {"cpu"}
    assert r.column("range_id").to_pylist() == list(range(n))


def _containment(rows: list[tuple[int, int, int, str]]) -> dict[tuple, tuple]:
    """(start, end, tid) -> (depth, parent key, path) by brute-force containment on each thread."""
    out = {}
    for s, e, t, name in rows:
        containers = [
            (s2, e2, t2, n2)
            for s2, e2, t2, n2 in rows
            if t2 == t and (s2, e2) != (s, e) and s2 <= s and e <= e2
        ]
        chain = sorted(containers, key=lambda c: (c[0], -c[1]))  # outermost first
        parent = chain[-1][:3] if chain else None
        out[(s, e, t)] = (len(chain), parent, "/".join([c[3] for c in chain] + [name]))
    return out


def test_nesting_equals_an_independent_containment_computation(runs):
    rows = _sql(
        NESTED,
        f"""SELECT start, end, globalTid & 16777215, text FROM NVTX_EVENTS
            WHERE eventType IN ({RANGE_TYPES}) AND end IS NOT NULL""",
    )
    assert len({(s, e, t) for s, e, t, _ in rows}) == len(rows), "keys must be unique"
    expected = _containment(rows)
    r = runs[NESTED].ranges.to_pylist()
    by_id = {x["range_id"]: x for x in r}
    got = {}
    for x in r:
        p = by_id.get(x["parent"])
        parent = (p["start_ns"], p["end_ns"], p["thread"]) if p else None
        got[(x["start_ns"], x["end_ns"], x["thread"])] = (x["depth"], parent, x["path"])
    assert got == expected
    assert max(d for d, _, _ in expected.values()) >= 3  # really nested
    # the export's domain-create event names the domain of every range
    ((domain,),) = _sql(NESTED, "SELECT text FROM NVTX_EVENTS WHERE eventType = 75")
    assert {x["domain"] for x in r} == {domain}


def test_nesting_is_consistent_on_the_large_export(runs):
    r = runs[H100X2].ranges.to_pylist()
    by_id = {x["range_id"]: x for x in r}
    nested = 0
    for x in r:
        p = by_id.get(x["parent"])
        if p is None:
            assert x["depth"] == 0 and x["path"] == x["name"]
            continue
        nested += 1
        assert p["thread"] == x["thread"]
        assert p["start_ns"] <= x["start_ns"] and x["end_ns"] <= p["end_ns"]
        assert x["depth"] == p["depth"] + 1
        assert x["path"] == f"{p['path']}/{x['name']}"
    assert nested > 1000


def test_non_utf8_strings_are_decoded(runs):
    # Extra-P's export holds a user name in a Windows code page: not valid UTF-8.
    ((raw,),) = _sql(NESTED, "SELECT value FROM EXPORT_META_DATA WHERE name = 'EXPORT_USER'", bytes)
    with pytest.raises(UnicodeDecodeError):
        raw.decode("utf-8")
    with pytest.raises(sqlite3.OperationalError):  # what a default connection does with it
        _sql(NESTED, "SELECT value FROM EXPORT_META_DATA WHERE name = 'EXPORT_USER'")
    assert nsys.decode_text(raw) == raw.decode("latin-1")
    con = sqlite3.connect(f"{NESTED.resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows, ncols = nsys.query(
            con, "SELECT name, value FROM EXPORT_META_DATA WHERE name LIKE 'EXPORT_%'"
        )
    finally:
        con.close()
    assert ncols == 2
    assert dict(rows)["EXPORT_USER"] == raw.decode("latin-1")
    assert dict(rows)["EXPORT_SCHEMA_VERSION"] == "2.9.1"  # UTF-8 text unchanged
    assert runs[NESTED].meta.config["export_schema_version"] == "2.9.1"
    assert nsys.decode_text("aten::mm ✓".encode()) == "aten::mm ✓"


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.name[:30])
def test_launch_correlation_from_the_runtime_table(runs, path):
    assert "CUPTI_ACTIVITY_KIND_RUNTIME" in _tables(path)
    # the launch record of the same process with the same correlation id
    expected = _sql(
        path,
        """SELECT k.start, k.deviceId, r.globalTid & 16777215, r.start, s.value
           FROM CUPTI_ACTIVITY_KIND_KERNEL k
           JOIN CUPTI_ACTIVITY_KIND_RUNTIME r
             ON r.correlationId = k.correlationId AND r.globalTid >> 24 = k.globalPid >> 24
           JOIN StringIds s ON s.id = r.nameId""",
    )
    assert expected
    k = runs[path].kernels
    got = [
        (x["start_ns"], x["device"], x["launch_thread"], x["launch_start_ns"], x["launch_api"])
        for x in k.to_pylist()
        if x["launch_api"] is not None
    ]
    assert sorted(got) == sorted(
        (s, d, t, ls, re.sub(r"_v\d+$", "", api)) for s, d, t, ls, api in expected
    )
    for *_, api in got:
        assert re.fullmatch(
            r"(cuda|cu)(LaunchKernel(ExC)?|LaunchCooperativeKernel|GraphLaunch)", api
        )
    starts = k.filter(pa.compute.is_valid(k.column("launch_start_ns")))
    assert pa.compute.all(
        pa.compute.less_equal(starts.column("launch_start_ns"), starts.column("start_ns"))
    ).as_py()


def test_launches_join_within_the_process():
    # In the 2-GPU export, 11 correlation ids of device 1's kernels also occur among the other
    # process's API calls (cudaEventDestroy, cudaMemsetAsync, ...): a join on the id alone
    # would attach those.
    ((cross,),) = _sql(
        H100X2,
        """SELECT count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL k
           JOIN CUPTI_ACTIVITY_KIND_RUNTIME r ON r.correlationId = k.correlationId
           WHERE r.globalTid >> 24 <> k.globalPid >> 24""",
    )
    assert cross > 0
    run = load_nsys(H100X2)
    threads = {}
    for x in run.kernels.to_pylist():
        if x["launch_thread"] is not None:
            threads.setdefault(x["device"], set()).add(x["launch_thread"])
    assert threads == {0: {111}, 1: {112}}
    assert run.meta.config["kernels_without_launch_record"] == run.kernels.num_rows - sum(
        1 for x in run.kernels.column("launch_api").to_pylist() if x is not None
    )


def test_two_gpu_export_keeps_devices_and_ranks(runs):
    run = runs[H100X2]
    per_device = dict(
        _sql(H100X2, "SELECT deviceId, count(*) FROM CUPTI_ACTIVITY_KIND_KERNEL GROUP BY 1")
    )
    assert per_device == {0: 1721, 1: 1721}
    k = run.kernels
    assert k.column("rank").to_pylist() == k.column("device").to_pylist()
    got = {}
    for d in k.column("device").to_pylist():
        got[d] = got.get(d, 0) + 1
    assert got == per_device
    assert run.meta.tp_world == 2
    # each process drove one GPU: its NVTX ranges carry that GPU as rank
    ranges = run.ranges
    pairs = set(
        zip(ranges.column("thread").to_pylist(), ranges.column("rank").to_pylist(), strict=True)
    )
    assert pairs == {(111, 0), (112, 1)}
    m = run.memops
    assert m.column("rank").to_pylist() == m.column("device").to_pylist()


def test_rank_and_run_id_options():
    run = load_nsys(H100X2, rank=5, run_id="h100-sp2")
    for t in (run.kernels, run.ranges, run.memops, run.overheads):
        assert set(t.column("rank").to_pylist()) <= {5}
        assert set(t.column("run_id").to_pylist()) <= {"h100-sp2"}
    assert run.run_id == "h100-sp2"
    assert set(run.kernels.column("device").to_pylist()) == {0, 1}


def test_demangled_names_option():
    run = load_nsys(H100X2, kernel_names="demangled")
    expected = _sql(
        H100X2,
        "SELECT s.value FROM CUPTI_ACTIVITY_KIND_KERNEL k JOIN StringIds s ON s.id = k.demangledName",
    )
    assert sorted(run.kernels.column("name").to_pylist()) == sorted(v for (v,) in expected)
    with pytest.raises(ValueError):
        load_nsys(H100X2, kernel_names="mangled")


def test_run_metadata_from_the_target_tables(runs):
    ((gpu,),) = _sql(RTX3080, "SELECT name FROM TARGET_INFO_GPU")
    assert runs[RTX3080].meta.gpu == gpu == "NVIDIA GeForce RTX 3080"
    # the laptop lists three adapters; the CUDA device 0 is the GeForce
    ((gtx,),) = _sql(NESTED, "SELECT name FROM TARGET_INFO_GPU WHERE id = 0")
    assert runs[NESTED].meta.gpu == gtx
    assert "TARGET_INFO_GPU" not in _tables(H100X2)
    assert runs[H100X2].meta.gpu is None
    for path in EXPORTS:
        meta = runs[path].meta
        env = dict(_sql(path, "SELECT name, value FROM TARGET_INFO_SYSTEM_ENV", bytes))
        major, rest = divmod(int(env[b"CudaDriverVersion"]), 1000)
        assert meta.cuda == f"{major}.{rest // 10}"
        assert meta.driver is not None
        table = "META_DATA_EXPORT" if "META_DATA_EXPORT" in _tables(path) else "EXPORT_META_DATA"
        export = dict(_sql(path, f"SELECT name, value FROM {table}", bytes))
        config = meta.config
        assert config["nsys_version"] == export[b"EXPORT_PRODUCT_VERSION"].decode()
        assert config["export_schema_version"] == export[b"EXPORT_SCHEMA_VERSION"].decode()
        # none of these captures launched CUDA graphs
        ((graphs,),) = _sql(
            path,
            """SELECT count(*) FROM CUPTI_ACTIVITY_KIND_RUNTIME r JOIN StringIds s
               ON s.id = r.nameId WHERE s.value LIKE 'cudaGraphLaunch%'""",
        )
        assert graphs == 0 and meta.graph_mode == "eager"
        assert meta.created_at is not None
    assert runs[NESTED].meta.driver == "426.00"  # Windows writes 42600
    assert runs[H100X2].meta.driver == "580.95.05"


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.name[:30])
def test_profiler_overheads_are_kept(runs, path):
    tables = _tables(path) & {"CUPTI_ACTIVITY_KIND_OVERHEAD", "PROFILER_OVERHEAD"}
    n = sum(_sql(path, f"SELECT count(*) FROM {t}")[0][0] for t in tables)
    o = runs[path].overheads
    assert o.num_rows == n > 0
    kinds = set(o.column("kind").to_pylist())
    assert None not in kinds
    if path == H100X2:  # 198 CUPTI records of type 8 (ENUM_CUPTI_OVERHEAD_TYPE)
        assert kinds == {"command_buffer_full"}
    if path == NESTED:  # schema 2.9: PROFILER_OVERHEAD has no overheadType column
        assert kinds == {"profiler"}


def test_the_api_version_suffix_is_dropped():
    assert nsys._api_name("cudaLaunchKernel_v7000") == "cudaLaunchKernel"
    assert nsys._api_name("cudaLaunchKernelExC_v11060") == "cudaLaunchKernelExC"
    assert nsys._api_name("cudaMemcpyAsync_ptsz_v7000") == "cudaMemcpyAsync"
    assert nsys._api_name("cuLaunchKernel") == "cuLaunchKernel"


def test_a_run_round_trips_through_the_store(runs, tmp_path):
    run = runs[H100X2]
    back = read_run(write_run(run, tmp_path / "run"))
    assert back.meta == run.meta
    for name in ("kernels", "ranges", "memops", "overheads"):
        assert back.tables()[name].equals(run.tables()[name]), name


def test_load_detects_and_attributes(tmp_path):
    run = load(NESTED)
    assert run.meta.source == "nsys"
    paths = run.kernels.column("range_path").to_pylist()
    # Extra-P names each launch site's range "...->kernelN"
    assert all(p and re.search(r"->kernel\d$", p) for p in paths)


def test_read_only_leaves_no_files(tmp_path):
    copy = tmp_path / "export.sqlite"
    shutil.copy(RTX3080, copy)
    copy.chmod(0o444)
    load_nsys(copy)
    assert [p.name for p in tmp_path.iterdir()] == ["export.sqlite"]


# -- corners no real export here shows: a real export, changed in one place -----------------------


def _modified(src: Path, folder: Path, *statements: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / src.name
    shutil.copy(src, path)
    path.chmod(0o644)
    con = sqlite3.connect(path)
    for sql in statements:
        con.execute(sql)
    con.commit()
    con.close()
    return path


def test_graph_replayed_kernels(tmp_path):
    # Synthetic corner: the 3.24 export's two kernels given graph ids, as graph replay records them.
    path = _modified(
        RTX3080,
        tmp_path,
        "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET graphNodeId = 1000 + rowid, graphId = 7",
    )
    run = load_nsys(path)
    assert run.kernels.column("graph_id").to_pylist() == [7, 7]
    assert sorted(run.kernels.column("graph_node_id").to_pylist()) == sorted(
        v for (v,) in _sql(path, "SELECT graphNodeId FROM CUPTI_ACTIVITY_KIND_KERNEL")
    )
    assert run.meta.graph_mode == "graph"
    one = _modified(
        RTX3080,
        tmp_path / "one",
        "UPDATE CUPTI_ACTIVITY_KIND_KERNEL SET graphNodeId = 5 WHERE rowid = 1",
    )
    assert load_nsys(one).meta.graph_mode == "mixed"


def test_registered_nvtx_strings(tmp_path):
    # Synthetic corner: the 2.9 export's range names moved into StringIds (textId), the way
    # nvtxDomainRegisterString'd names are exported; names and paths must not change.
    path = _modified(
        NESTED,
        tmp_path,
        "INSERT INTO StringIds (id, value) SELECT 900000 + rowid, text FROM NVTX_EVENTS"
        " WHERE eventType = 59",
        "UPDATE NVTX_EVENTS SET textId = 900000 + rowid, text = NULL WHERE eventType = 59",
    )
    assert _sql(path, "SELECT count(*) FROM NVTX_EVENTS WHERE eventType = 59 AND text IS NULL")
    before = load_nsys(NESTED).ranges.select(["start_ns", "name", "path", "depth"])
    after = load_nsys(path).ranges.select(["start_ns", "name", "path", "depth"])
    assert after.equals(before)


def test_an_unclosed_range_is_counted_not_imported(tmp_path):
    # Synthetic corner: one range of the 2.9 export left open (no end), as when capture stops.
    path = _modified(
        NESTED,
        tmp_path,
        "UPDATE NVTX_EVENTS SET end = NULL WHERE rowid ="
        " (SELECT max(rowid) FROM NVTX_EVENTS WHERE eventType = 59)",
    )
    run = load_nsys(path)
    assert run.ranges.num_rows == _range_count(NESTED) - 1
    assert run.meta.config["nvtx_unclosed_ranges"] == 1
    assert run.meta.dropped_records == 1


def _range_count(path: Path) -> int:
    ((n,),) = _sql(
        path,
        f"SELECT count(*) FROM NVTX_EVENTS WHERE eventType IN ({RANGE_TYPES}) AND end IS NOT NULL",
    )
    return n


# -- bad input -----------------------------------------------------------------------------------


def _one_line(e: TraceError, path: Path) -> str:
    msg = str(e)
    assert "\n" not in msg and msg.startswith(str(path))
    return msg


def test_an_export_without_kernel_tables_is_an_error(tmp_path):
    # Synthetic on purpose: a SQLite file with NVTX but no CUDA tables (an nsys capture without
    # --trace=cuda looks like this); no real export of that kind is in tests/data.
    path = tmp_path / "nvtx_only.sqlite"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL)")
    con.execute(
        "CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, text TEXT)"
    )
    con.execute("INSERT INTO NVTX_EVENTS VALUES (1, 2, 59, 'step')")
    con.commit()
    con.close()
    for loader in (load_nsys, load):
        with pytest.raises(TraceError) as e:
            loader(path)
        msg = _one_line(e.value, path)
        assert "no GPU kernel table (CUPTI_ACTIVITY_KIND_KERNEL)" in msg
        assert "NVTX_EVENTS" in msg  # says what it found


def test_an_empty_kernel_table_is_an_empty_run(tmp_path):
    # Synthetic corner: the real 3.24 export with its two kernels deleted.
    path = tmp_path / "no_kernels.sqlite"
    shutil.copy(RTX3080, path)
    con = sqlite3.connect(path)
    con.execute("DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL")
    con.commit()
    con.close()
    run = load_nsys(path)
    assert run.kernels.num_rows == 0
    assert run.memops.num_rows == 1
    assert run.meta.graph_mode == "unknown"


def test_not_a_database(tmp_path):
    path = tmp_path / "random.sqlite"
    path.write_bytes(bytes(range(256)) * 64)
    with pytest.raises(TraceError, match="not a SQLite database"):
        load_nsys(path)
    empty = tmp_path / "empty.sqlite"
    empty.write_bytes(b"")
    with pytest.raises(TraceError, match="empty file"):
        load_nsys(empty)
    with pytest.raises(TraceError, match="no such file"):
        load_nsys(tmp_path / "missing.sqlite")
    with pytest.raises(TraceError, match="not a regular file"):
        load_nsys(tmp_path)


def test_a_damaged_header_is_a_clean_error(tmp_path):
    # the SQLite magic kept, the rest of the first page (the header and the schema) zeroed
    data = bytearray(RTX3080.read_bytes())
    data[16:4096] = bytes(4096 - 16)
    path = tmp_path / "damaged.sqlite"
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError) as e:
        load_nsys(path)
    _one_line(e.value, path)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_a_truncated_export_is_a_clean_error(tmp_path, fraction):
    data = H100X2.read_bytes()
    path = tmp_path / "cut.sqlite"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(TraceError) as e:
        load_nsys(path)
    _one_line(e.value, path)


def test_a_locked_export_is_a_clean_error(tmp_path, monkeypatch):
    monkeypatch.setattr(nsys, "LOCK_TIMEOUT_S", 0.05)
    path = tmp_path / "locked.sqlite"
    shutil.copy(RTX3080, path)
    holder = sqlite3.connect(path)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        with pytest.raises(TraceError, match="locked") as e:
            load_nsys(path)
        _one_line(e.value, path)
    finally:
        holder.rollback()
        holder.close()


def test_config_is_json(runs):
    for run in runs.values():
        assert isinstance(json.loads(run.meta.config_json), dict)
