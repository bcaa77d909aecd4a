"""The Kineto importer on every real Kineto trace in tests/data/traces.

Each check compares the importer's raw columns with an independent scan of the same JSON
(stdlib ``json`` with decimals, no code shared with the importer).
"""

from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict
from decimal import Decimal
from pathlib import Path

import pyarrow.compute as pc
import pytest

from decodescope import tracer
from decodescope.analysis.schema import KERNELS, MEMOPS, RANGES
from decodescope.tracer.kineto import load_kineto, short_name

TRACES = Path(__file__).parent / "data" / "traces"
KINETO = sorted(p.name for p in TRACES.glob("kineto_*.json*"))
A100_GRAPH = "kineto_a100_torchcompile_cudagraph__HTA_negative_queue.json.gz"
B200_VLLM = "kineto_b200_vllm_tp8_rank0_prefill_eager__TraceLens.json.gz"
H100_HF = "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"
V100_DDP = "kineto_v100_ddp_ns_resolution__HTA.pt.trace.json.gz"
V100_LEGACY = "kineto_v100_resnet50_2021_legacy__kineto_tb_plugin.pt.trace.json.gz"

_runs: dict[str, tracer.Run] = {}
_scans: dict[str, dict] = {}


def run_of(name: str) -> tracer.Run:
    if name not in _runs:
        _runs[name] = load_kineto(TRACES / name)
    return _runs[name]


_KEEP = {
    "kernel",
    "Kernel",
    "cuda_runtime",
    "cuda_driver",
    "Runtime",
    "gpu_memcpy",
    "Memcpy",
    "gpu_memset",
    "Memset",
    "user_annotation",
    "gpu_user_annotation",
    "overhead",
}


def scan(name: str) -> dict:
    """The trace as stdlib json reads it, numbers with a fraction kept as exact Decimals; only the
    events of the categories these tests check are kept (host ops and flows would cost GBs)."""
    if name not in _scans:
        with gzip.open(TRACES / name, "rb") as f:
            trace = json.loads(f.read(), parse_float=Decimal)
        trace["traceEvents"] = [
            e
            for e in trace["traceEvents"]
            if e.get("cat") in _KEEP
            or (
                e.get("cat") in ("python_function", "Python")
                and e["name"].startswith("nn.Module: ")
            )
            or (e.get("cat") == "Operator" and e["name"].startswith("ProfilerStep#"))
        ]
        _scans[name] = trace
    return _scans[name]


def events(name: str, *cats: str) -> list[dict]:
    return [e for e in scan(name)["traceEvents"] if e.get("cat") in cats]


def ns(us) -> int:
    return int(Decimal(us) * 1000)


def base(name: str) -> int:
    return int(scan(name).get("baseTimeNanoseconds", 0))


def test_every_kineto_trace_is_in_the_data() -> None:
    assert len(KINETO) == 5, KINETO


@pytest.mark.parametrize("name", KINETO)
def test_imports_with_the_schema(name: str) -> None:
    run = run_of(name)
    assert run.meta.source == "kineto"
    assert run.kernels.schema == KERNELS
    assert run.memops.schema == MEMOPS
    assert run.ranges.schema == RANGES
    assert run.kernels.num_rows > 0
    # a raw run: importers never attribute
    for col in ("range_path", "step", "layer", "layer_kind", "block", "op"):
        assert run.kernels.column(col).null_count == run.kernels.num_rows, col
    # nothing in these real traces fails to convert, and every category is known
    kinds = set(run.overheads.column("kind").to_pylist())
    assert not kinds & {"skipped_events", "unknown_category"}, run.overheads.to_pylist()
    assert run.meta.dropped_records == 0


@pytest.mark.parametrize("name", KINETO)
def test_kernel_count_and_time_match_a_json_scan(name: str) -> None:
    run = run_of(name)
    kernels = events(name, "kernel", "Kernel")
    assert run.kernels.num_rows == len(kernels)
    total_ns = sum(ns(e["dur"]) for e in kernels)
    dur = pc.subtract(run.kernels["end_ns"], run.kernels["start_ns"])
    assert pc.sum(dur).as_py() == total_ns
    # every start exactly as the JSON text says, in ns since the epoch where the trace has a base
    starts = sorted(ns(e["ts"]) + base(name) for e in kernels)
    assert sorted(run.kernels["start_ns"].to_pylist()) == starts
    # names: mangled as the trace gave them, short names derived from them
    assert Counter(run.kernels["mangled"].to_pylist()) == Counter(e["name"] for e in kernels)
    assert run.kernels["name"].null_count == 0


@pytest.mark.parametrize("name", KINETO)
def test_kernel_launch_args_match_a_json_scan(name: str) -> None:
    run = run_of(name)
    # graph replays share a correlation id: a kernel is its correlation id and start
    by_key = {
        (e["args"]["correlation"], ns(e["ts"]) + base(name)): e
        for e in events(name, "kernel", "Kernel")
    }
    launches = {
        e["args"]["correlation"]: e
        for e in events(name, "cuda_runtime", "cuda_driver", "Runtime")
        if "correlation" in e.get("args", {})
    }
    rows = run.kernels.to_pylist()
    for row in rows:
        src = by_key[(row["correlation_id"], row["start_ns"])]
        a = src["args"]
        assert (row["grid_x"], row["grid_y"], row["grid_z"]) == tuple(a["grid"])
        assert (row["block_x"], row["block_y"], row["block_z"]) == tuple(a["block"])
        assert row["registers"] == a["registers per thread"]
        assert row["shared_dynamic"] == a["shared memory"]
        assert row["stream"] == a["stream"]
        assert row["device"] == a["device"]
        launch = launches.get(row["correlation_id"])
        if launch is None:
            assert row["launch_api"] is None and row["launch_start_ns"] is None
        else:
            assert row["launch_api"] == launch["name"]
            assert row["launch_thread"] == int(launch["tid"])
            assert row["launch_start_ns"] == ns(launch["ts"]) + base(name)
    with_launch = sum(1 for r in rows if r["launch_api"] is not None)
    assert with_launch == sum(1 for r in rows if r["correlation_id"] in launches)
    assert with_launch > 0.5 * len(rows)  # the rest were launched before the profiling window


@pytest.mark.parametrize("name", KINETO)
def test_memop_counts_and_bytes_match_a_json_scan(name: str) -> None:
    run = run_of(name)
    copies = events(name, "gpu_memcpy", "Memcpy")
    sets = events(name, "gpu_memset", "Memset")
    kinds = Counter(run.memops["kind"].to_pylist())
    assert run.memops.num_rows == len(copies) + len(sets)
    assert kinds["memset"] == len(sets)
    assert sum(v for k, v in kinds.items() if k.startswith("memcpy_")) == len(copies)
    htod = sum(1 for e in copies if "HtoD" in e["name"])
    assert kinds["memcpy_htod"] == htod
    total = sum(e["args"]["bytes"] for e in copies + sets)
    assert pc.sum(run.memops["bytes"]).as_py() == total
    dur = pc.sum(pc.subtract(run.memops["end_ns"], run.memops["start_ns"])).as_py() or 0
    assert dur == sum(ns(e["dur"]) for e in copies + sets)


@pytest.mark.parametrize("name", KINETO)
def test_range_counts_match_a_json_scan(name: str) -> None:
    run = run_of(name)
    # cpu ranges: user annotations, and the nn.Module calls torch.profiler(with_modules=True) writes
    cpu = events(name, "user_annotation") + [
        e for e in events(name, "python_function", "Python") if e["name"].startswith("nn.Module: ")
    ]
    if not cpu:  # Kineto 2021 wrote its ProfilerStep ranges as "Operator" events
        cpu = [e for e in events(name, "Operator") if e["name"].startswith("ProfilerStep#")]
    gpu = events(name, "gpu_user_annotation")
    timeline = Counter(run.ranges["timeline"].to_pylist())
    assert timeline["cpu"] == len(cpu)
    assert timeline["gpu"] == len(gpu)
    assert Counter(run.ranges["name"].to_pylist()) == Counter(e["name"] for e in cpu + gpu)


@pytest.mark.parametrize("name", [A100_GRAPH, V100_DDP, B200_VLLM])
def test_ranges_nest_per_thread(name: str) -> None:
    """depth, parent and path agree with a brute-force search for the innermost enclosing range."""
    rows = run_of(name).ranges.to_pylist()
    by_id = {r["range_id"]: r for r in rows}
    assert sorted(by_id) == list(range(len(rows)))
    groups = defaultdict(list)
    for r in rows:
        groups[(r["timeline"], r["thread"])].append(r)
    nested = 0
    for r in rows:
        enclosing = [
            o
            for o in groups[(r["timeline"], r["thread"])]
            if o is not r
            and o["start_ns"] <= r["start_ns"]
            and r["end_ns"] <= o["end_ns"]
            and (o["start_ns"], -o["end_ns"], o["range_id"])
            < (r["start_ns"], -r["end_ns"], r["range_id"])
        ]
        if not enclosing:
            assert r["parent"] is None and r["depth"] == 0 and r["path"] == r["name"]
            continue
        nested += 1
        inner = max(enclosing, key=lambda o: (o["start_ns"], -o["end_ns"], o["range_id"]))
        assert r["parent"] == inner["range_id"]
        parent = by_id[r["parent"]]
        assert r["depth"] == parent["depth"] + 1 == len(enclosing)
        assert r["path"] == parent["path"] + "/" + r["name"]
    assert nested > 0
    assert max(r["depth"] for r in rows) >= 1


def test_v100_ddp_gpu_ranges_are_on_the_stream_timeline() -> None:
    gpu = [r for r in run_of(V100_DDP).ranges.to_pylist() if r["timeline"] == "gpu"]
    assert len(gpu) == 15
    assert {r["thread"] for r in gpu} == {7}


def test_graph_launch_kernels_share_the_cuda_graph_launch() -> None:
    run = run_of(A100_GRAPH)
    graph_launches = {
        e["args"]["correlation"]: e
        for e in events(A100_GRAPH, "cuda_runtime")
        if e["name"] == "cudaGraphLaunch"
    }
    assert len(graph_launches) == 70
    per_launch = Counter()
    for row in run.kernels.to_pylist():
        launch = graph_launches.get(row["correlation_id"])
        if launch is None:
            assert row["launch_api"] != "cudaGraphLaunch"
            continue
        per_launch[row["correlation_id"]] += 1
        assert row["launch_api"] == "cudaGraphLaunch"
        assert row["launch_start_ns"] == ns(launch["ts"])
        assert row["launch_thread"] == launch["tid"]
    expected = Counter(
        e["args"]["correlation"]
        for e in events(A100_GRAPH, "kernel")
        if e["args"]["correlation"] in graph_launches
    )
    assert per_launch == expected
    assert max(per_launch.values()) == 8  # eight kernels replayed under one launch
    assert run.meta.graph_mode == "mixed"  # eager launches beside the graph replays


def test_b200_vllm_nccl_kernels_and_metadata() -> None:
    run = run_of(B200_VLLM)
    nccl = [e for e in events(B200_VLLM, "kernel") if "Collective name" in e["args"]]
    assert nccl
    names = run.kernels["name"].to_pylist()
    nccl_names = {short_name(e["name"]) for e in nccl}
    assert sum(1 for n in names if n in nccl_names) >= len(nccl)
    assert any(n.startswith("ncclDevKernel_") for n in nccl_names)
    meta = run.meta
    assert meta.gpu == "NVIDIA B200"
    assert meta.tp_world == 8
    assert run.kernels["rank"].unique().to_pylist() == [0]
    assert meta.cuda == "12.9" and meta.driver == "13.0"
    assert meta.graph_mode == "eager"
    # Kineto's own overhead events are kept
    kinds = Counter(run.overheads["kind"].to_pylist())
    assert kinds["kineto_overhead"] == len(events(B200_VLLM, "overhead"))


def test_base_time_and_fractional_ns() -> None:
    """ts counts from baseTimeNanoseconds and carries ns fractions: both land exactly."""
    run = run_of(H100_HF)
    assert base(H100_HF) == 1751410836000000000
    first = min(events(H100_HF, "kernel"), key=lambda e: e["ts"])
    assert str(first["ts"]).split(".")[1]  # a fraction in the text
    assert pc.min(run.kernels["start_ns"]).as_py() == base(H100_HF) + ns(first["ts"])
    assert run.meta.created_at.year == 2025


def test_epoch_us_floats_keep_their_decimal_digits() -> None:
    """1712195495519695.8 us has no exact binary float; the importer reads the decimal text."""
    kernels = events(V100_DDP, "kernel")
    fractional = [e for e in kernels if Decimal(e["ts"]) % 1]
    assert fractional
    got = set(run_of(V100_DDP).kernels["start_ns"].to_pylist())
    for e in fractional:
        assert ns(e["ts"]) in got
        assert int(float(e["ts"]) * 1000) not in got or int(float(e["ts"]) * 1000) == ns(e["ts"])


def test_legacy_2021_categories_and_string_tids() -> None:
    run = run_of(V100_LEGACY)
    assert run.kernels.num_rows == 8772
    assert run.kernels["stream"].unique().to_pylist() == [7]  # from "stream 7"
    assert run.kernels["launch_api"].null_count == 0  # Runtime events, string tids
    threads = run.kernels["launch_thread"].unique().to_pylist()
    assert all(isinstance(t, int) for t in threads)
    assert run.meta.gpu == "Tesla V100-DGXS-32GB"
    steps = run.ranges["name"].to_pylist()
    assert steps == [f"ProfilerStep#{i}" for i in range(5, 11)]


def test_run_id_is_stable_and_overridable() -> None:
    a = load_kineto(TRACES / H100_HF)
    assert a.run_id == run_of(H100_HF).run_id
    assert a.run_id.startswith("kineto-")
    assert a.run_id != run_of(B200_VLLM).run_id
    assert load_kineto(TRACES / H100_HF, run_id="mine").kernels["run_id"].unique().to_pylist() == [
        "mine"
    ]


def test_uncompressed_json_reads_the_same(tmp_path: Path) -> None:
    plain = tmp_path / "trace.json"
    with gzip.open(TRACES / H100_HF, "rb") as f:
        plain.write_bytes(f.read())
    a = load_kineto(plain)
    b = run_of(H100_HF)
    assert a.kernels.drop_columns(["run_id"]).equals(b.kernels.drop_columns(["run_id"]))


def test_load_detects_kineto_and_round_trips(tmp_path: Path) -> None:
    run = tracer.load(TRACES / B200_VLLM)
    assert run.meta.source == "kineto"
    assert run.kernels.num_rows == run_of(B200_VLLM).kernels.num_rows
    out = tracer.write_run(run_of(B200_VLLM), tmp_path / "run")
    back = tracer.read_run(out)
    assert back.kernels.equals(run_of(B200_VLLM).kernels)
    assert back.ranges.equals(run_of(B200_VLLM).ranges)


@pytest.mark.parametrize(
    ("full", "short"),
    [
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::Foo<float> >(int, float)",
            "vectorized_elementwise_kernel",
        ),
        (
            "void at::native::(anonymous namespace)::CatArrayBatchedCopy<int>(int*)",
            "CatArrayBatchedCopy",
        ),
        (
            "void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>(Params)",
            "Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>",
        ),
        (
            "std::enable_if<(((8)>(0)))&&vllm::_typeConvert<c10::BFloat16>::exists, void>::type "
            "vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, int)",
            "fused_add_rms_norm_kernel",
        ),
        (
            "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
            "ncclDevKernel_AllGather_RING_LL",
        ),
        ("triton_poi_fused_add_0", "triton_poi_fused_add_0"),
        ("_ZN2at6native18elementwise_kernelILi128ELi2EEEviT1_", "elementwise_kernel"),
    ],
)
def test_short_names(full: str, short: str) -> None:
    # names as they appear in the real traces (the first five) and an Itanium-mangled one
    assert short_name(full) == short


def test_multi_member_gzip_reads_the_same(tmp_path: Path) -> None:
    """gzip allows several members one after another (``cat a.gz b.gz``); the text is their join."""
    with gzip.open(TRACES / H100_HF, "rb") as f:
        text = f.read()
    half = len(text) // 2
    p = tmp_path / "two_members.json.gz"
    p.write_bytes(gzip.compress(text[:half]) + gzip.compress(text[half:]))
    a = load_kineto(p)
    assert a.kernels.drop_columns(["run_id"]).equals(
        run_of(H100_HF).kernels.drop_columns(["run_id"])
    )
