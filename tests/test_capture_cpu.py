"""The capture's CPU half: record conversion, ranges, graph-node map, steps, drops, child failures.

Records are namespace objects with the attribute names cupti-python's record classes have
(``ActivityKernel9``, ``ActivityMarker2``, ``ActivityMemcpy5``, ``ActivityMemset4``,
``ActivityOverhead3``), so the converter sees what it sees inside the buffer callback.
"""

from __future__ import annotations

import time
from types import SimpleNamespace as NS

import pytest

from decodescope.analysis.schema import RunMeta
from decodescope.tracer import capture as cap
from decodescope.tracer import cupti_records as cr
from decodescope.tracer.store import read_run

TID = 4242


def kernel_rec(start, end, corr, name="_Z6gemv_kPfS_i", node=0, graph=0, stream=7):
    return NS(
        kind=10, start=start, end=end, name=name, correlation_id=corr, graph_id=graph, graph_node_id=node,
        device_id=0, context_id=1, stream_id=stream, grid_x=4, grid_y=1, grid_z=1, block_x=128, block_y=1,
        block_z=1, registers_per_thread=32, static_shared_memory=0, dynamic_shared_memory=1024,
    )  # fmt: skip


def marker_rec(mid, ts, flags, name=None, domain="decodescope", tid=TID):
    return NS(
        kind=12, id=mid, timestamp=ts, flags_=flags, name=name, domain=domain, object_kind=2,
        object_id=NS(pt=NS(process_id=1, thread_id=tid), dcs=None),
    )  # fmt: skip


def markers_for(spans):
    """[(name, start, end)] -> start/end marker records, ids in order."""
    recs = []
    for i, (name, s, e) in enumerate(spans):
        recs.append(marker_rec(i + 1, s, 2, name))
        recs.append(marker_rec(i + 1, e, 4, None, domain=None))
    return recs


def convert(records):
    conv = cr.RecordConverter()
    rows = conv.convert_all(records)
    return conv, rows


def test_record_conversion_kernel_memops_overhead_and_bad_record():
    recs = [
        kernel_rec(1000, 1500, 11),
        NS(
            kind=1,
            start=10,
            end=20,
            copy_kind=1,
            bytes=4096,
            correlation_id=3,
            device_id=0,
            stream_id=7,
            graph_id=0,
            graph_node_id=0,
        ),
        NS(
            kind=1,
            start=30,
            end=40,
            copy_kind=8,
            bytes=64,
            correlation_id=4,
            device_id=0,
            stream_id=7,
            graph_id=5,
            graph_node_id=9,
        ),
        NS(
            kind=2,
            start=50,
            end=60,
            bytes=128,
            value=0,
            correlation_id=5,
            device_id=0,
            stream_id=7,
            graph_id=0,
            graph_node_id=0,
        ),
        NS(kind=17, start=70, end=90, overhead_kind=65536, object_kind=2, correlation_id=0),
        NS(kind=13, id=1, flags_=0, color=0, category=0),  # MARKER_DATA: not kept
        NS(kind=10, start=None, end=5, name="broken"),  # malformed: counted, not fatal
        kernel_rec(2000, 2600, 12),
    ]
    conv, rows = convert(recs)
    assert [k["correlation_id"] for k in rows["kernel"]] == [11, 12]
    k = rows["kernel"][0]
    assert (k["start_ns"], k["end_ns"], k["stream"], k["grid_x"], k["block_x"], k["registers"]) == (
        1000,
        1500,
        7,
        4,
        128,
        32,
    )
    assert k["graph_node_id"] is None and k["graph_id"] is None  # 0 means "not in a graph"
    assert [m["kind"] for m in rows["memop"]] == ["memcpy_htod", "memcpy_dtod", "memset"]
    assert rows["memop"][1]["graph_node_id"] == 9
    assert rows["overhead"][0]["kind"] == "cupti_overhead:cupti_buffer_flush"
    assert conv.errors == {"kernel": 1}


def test_api_records_become_launch_rows():
    conv = cr.RecordConverter({(5, 211): "cudaLaunchKernel"})
    recs = [
        NS(kind=5, cbid=211, start=100, end=110, correlation_id=9, thread_id=TID, process_id=1),
        NS(kind=4, cbid=307, start=120, end=125, correlation_id=10, thread_id=TID, process_id=1),
    ]
    rows = conv.convert_all(recs)["launch"]
    assert rows[0] == {"correlation_id": 9, "thread": TID, "ts": 100, "api": "cudaLaunchKernel"}
    assert rows[1]["api"] == "driver:307"


def test_iteration_failure_does_not_lose_the_buffer():
    def records():
        yield kernel_rec(1, 2, 1)
        raise RuntimeError("binding failed")

    conv, rows = convert(records())
    assert len(rows["kernel"]) == 1 and conv.errors["iterate"] == 1


def test_short_names():
    assert cr.short_name("_Z6gemv_kPfS_i") == "gemv_k"
    assert cr.short_name("triton_poi_fused_add_0") == "triton_poi_fused_add_0"
    n = cr.short_name(
        "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEESt5arrayIPcLm1EEEEviT0_T1_"
    )
    assert n == "at::native::vectorized_elementwise_kernel"


def test_ranges_from_markers_path_depth_parent():
    spans = [("step", 0, 100), ("layer.0:kda", 5, 50), ("layer.0.attn.qkv_proj", 6, 20), ("layer.0.attn.o_proj", 21, 40),
             ("layer.1:mla", 55, 95)]  # fmt: skip
    _, rows = convert(markers_for(spans) + [marker_rec(99, 7, 1, "instant")])
    ranges, counts = cr.build_ranges(rows["marker"])
    by = {r["name"]: r for r in ranges}
    assert by["layer.0.attn.o_proj"]["path"] == "step/layer.0:kda/layer.0.attn.o_proj"
    assert by["layer.0.attn.o_proj"]["depth"] == 2
    assert by["layer.0.attn.o_proj"]["parent"] == by["layer.0:kda"]["range_id"]
    assert by["step"]["parent"] is None and by["layer.1:mla"]["depth"] == 1
    assert all(r["thread"] == TID and r["timeline"] == "cpu" for r in ranges)
    assert counts["instant_markers"] == 1
    assert cr.innermost_paths(ranges, [(TID, 10), (TID, 52), (TID, 200), (1, 10)]) == [
        "step/layer.0:kda/layer.0.attn.qkv_proj",
        "step",
        None,
        None,
    ]


def _graph_raw(replays=3, drop_clone_of=None):
    """A 2-layer graph: captured inside ranges, instantiated (clones), replayed ``replays`` times."""
    ops = [("layer.0:kda", "layer.0.attn.qkv_proj"), ("layer.0:kda", "layer.0.moe.router"),
           ("layer.1:mla", "layer.1.attn.qkv_proj"), ("layer.1:mla", "layer.1.moe.router")]  # fmt: skip
    spans = [("step", 0, 1000), ("layer.0:kda", 5, 205), ("layer.1:mla", 206, 405)]
    spans += [(op, 10 + 100 * i, 60 + 100 * i) for i, (_, op) in enumerate(ops)]
    gnodes = [
        {
            "event": "created",
            "node_id": 100 + i,
            "thread": TID,
            "ts": 20 + 100 * i,
            "host_path": None,
        }
        for i in range(len(ops))
    ]
    for i in range(len(ops)):
        if drop_clone_of == 100 + i:
            continue
        gnodes.append(
            {
                "event": "cloned",
                "node_id": 200 + i,
                "original_node_id": 100 + i,
                "thread": TID,
                "ts": 2000,
            }
        )
    _, rows = convert(markers_for(spans))
    kernels, launches, t0 = [], [], 10_000
    for r in range(replays):
        corr = 500 + 7 * r
        launches.append(
            {"correlation_id": corr, "thread": TID, "ts": t0 - 5, "api": "cudaGraphLaunch"}
        )
        for i in range(len(ops)):
            kernels.append(kernel_rec(t0 + 10 * i, t0 + 10 * i + 8, corr, node=200 + i, graph=3))
        t0 += 1000
    _, krows = convert(kernels)
    return {
        "marker": cr.raw_table("marker", rows["marker"]),
        "kernel": cr.raw_table("kernel", krows["kernel"]),
        "launch": cr.raw_table("launch", launches),
        "gnode": cr.raw_table("gnode", gnodes),
    }


def test_graph_replays_join_node_paths_and_number_steps():
    run = cr.assemble(_graph_raw(replays=3), RunMeta(run_id="g", source="cupti"))
    k = run.kernels.to_pylist()
    assert len(k) == 12
    assert [x["step"] for x in k] == [0] * 4 + [1] * 4 + [2] * 4
    assert [x["range_path"] for x in k[:4]] == [
        "step/layer.0:kda/layer.0.attn.qkv_proj",
        "step/layer.0:kda/layer.0.moe.router",
        "step/layer.1:mla/layer.1.attn.qkv_proj",
        "step/layer.1:mla/layer.1.moe.router",
    ]
    assert [x["range_path"] for x in k[4:8]] == [x["range_path"] for x in k[:4]]
    assert all(x["launch_api"] == "cudaGraphLaunch" for x in k)
    assert run.meta.graph_mode == "graph"
    ov = {r["kind"]: r["count"] for r in run.overheads.to_pylist()}
    assert ov["graph_kernels_unmapped"] == 0


def graph_trace_rec(start, end, corr, graph=9, stream=7):
    """Attribute names of cupti-python's ActivityGraphTrace2."""
    return NS(kind=51, start=start, end=end, correlation_id=corr, graph_id=graph, device_id=0,
              context_id=1, stream_id=stream, end_device_id=0, end_context_id=1)  # fmt: skip


def test_graph_trace_records_become_gpu_ranges_after_the_attributed_replays():
    """Kernel-level replays first (attribution), then one GRAPH_TRACE record per launch."""
    conv, rows = convert([graph_trace_rec(5000, 5400, 900), graph_trace_rec(6000, 6390, 901)])
    assert rows["graph"][0] == {"device": 0, "stream": 7, "start_ns": 5000, "end_ns": 5400,
                                "correlation_id": 900, "graph_id": 9}  # fmt: skip
    raw = dict(_graph_raw(replays=2))
    raw["graph"] = cr.raw_table("graph", rows["graph"])
    run = cr.assemble(raw, RunMeta(run_id="gt", source="cupti"))
    assert run.kernels.num_rows == 8 and {x["step"] for x in run.kernels.to_pylist()} == {0, 1}
    gr = [r for r in run.ranges.to_pylist() if r["timeline"] == "gpu"]
    assert [(r["name"], r["thread"], r["end_ns"] - r["start_ns"]) for r in gr] == [
        (cr.GRAPH_RANGE_NAME, 7, 400), (cr.GRAPH_RANGE_NAME, 7, 390)]  # fmt: skip
    ids = [r["range_id"] for r in run.ranges.to_pylist()]
    assert len(ids) == len(set(ids))
    ov = {r["kind"]: r["count"] for r in run.overheads.to_pylist()}
    assert ov["graph_trace_records"] == 2 and ov["graph_kernels_unmapped"] == 0
    from decodescope.analysis.attribution import attribute

    att = attribute(run)  # GPU-timeline graph ranges leave the kernels' attribution alone
    assert (
        att.kernels.column("range_path").to_pylist() == run.kernels.column("range_path").to_pylist()
    )


def test_graph_trace_conversion_reads_the_real_record_class():
    np = pytest.importorskip("numpy")
    pytest.importorskip("cupti")
    from cupti import cupti as real

    a = np.zeros(1, dtype=real.activity_graph_trace2_dtype)
    a["kind"], a["start"], a["end"], a["correlation_id"] = 51, 100, 250, 77
    a["graph_id"], a["stream_id"], a["device_id"] = 3, 13, 0
    _, rows = convert([real.ActivityGraphTrace2.from_data(a)])
    assert rows["graph"] == [{"device": 0, "stream": 13, "start_ns": 100, "end_ns": 250,
                              "correlation_id": 77, "graph_id": 3}]  # fmt: skip


def test_graph_kernel_without_node_entry_is_counted_not_guessed():
    run = cr.assemble(_graph_raw(replays=2, drop_clone_of=101), RunMeta(run_id="g", source="cupti"))
    k = run.kernels.to_pylist()
    assert sum(x["range_path"] is None for x in k) == 2
    ov = {r["kind"]: r["count"] for r in run.overheads.to_pylist()}
    assert ov["graph_kernels_unmapped"] == 2


def test_host_path_is_the_fallback_without_markers():
    raw = _graph_raw(replays=1)
    raw.pop("marker")
    g = raw["gnode"].to_pylist()
    for row in g:
        if row["event"] == "created":
            row["host_path"] = f"step/node{row['node_id']}"
    raw["gnode"] = cr.raw_table("gnode", g)
    run = cr.assemble(raw, RunMeta(run_id="g", source="cupti"))
    assert run.kernels.column("range_path").to_pylist() == [
        f"step/node{n}" for n in (100, 101, 102, 103)
    ]


def test_eager_steps_and_launch_join():
    spans = [("step", 0, 100), ("layer.0", 1, 99), ("step", 200, 300), ("layer.0", 201, 299)]
    _, rows = convert(markers_for(spans))
    launches = [
        {"correlation_id": 1, "thread": TID, "ts": 10, "api": "cudaLaunchKernel"},
        {"correlation_id": 2, "thread": TID, "ts": 210, "api": "cuLaunchKernelEx"},
        {"correlation_id": 3, "thread": TID, "ts": 150, "api": "cudaLaunchKernel"},  # between steps
    ]
    _, krows = convert(
        [
            kernel_rec(1000, 1100, 1),
            kernel_rec(2000, 2100, 2),
            kernel_rec(3000, 3100, 3),
            kernel_rec(4000, 4100, 4),
        ]
    )
    raw = {
        "marker": cr.raw_table("marker", rows["marker"]),
        "kernel": cr.raw_table("kernel", krows["kernel"]),
        "launch": cr.raw_table("launch", launches),
    }
    run = cr.assemble(raw, RunMeta(run_id="e", source="cupti"))
    k = run.kernels.to_pylist()
    assert [x["step"] for x in k] == [0, 1, None, None]
    assert [x["launch_api"] for x in k] == [
        "cudaLaunchKernel",
        "cuLaunchKernelEx",
        "cudaLaunchKernel",
        None,
    ]
    assert k[0]["launch_thread"] == TID and k[0]["launch_start_ns"] == 10
    assert k[0]["range_path"] is None  # eager kernels are attributed by analysis.attribution
    assert run.meta.graph_mode == "eager"
    ov = {r["kind"]: r["count"] for r in run.overheads.to_pylist()}
    assert ov["kernels_without_launch"] == 1


def test_dropped_records_reach_meta_and_overheads():
    raw = _graph_raw(replays=1)
    raw["count"] = cr.raw_table(
        "count",
        [
            {"name": "dropped_records", "value": 17},
            {"name": "conversion_errors:kernel", "value": 2},
        ],
    )
    run = cr.assemble(raw, RunMeta(run_id="d", source="cupti"))
    assert run.meta.dropped_records == 17
    ov = {r["kind"]: r["count"] for r in run.overheads.to_pylist()}
    assert ov["dropped_records"] == 17 and ov["conversion_errors:kernel"] == 2


class FakeCupti:
    """Just enough of cupti-python's module for Session's bookkeeping paths."""

    class ActivityFlag:
        FLUSH_FORCED = 1

    def __init__(self):
        self.flushed = 0

    def activity_flush_all(self, flag):
        self.flushed += 1

    def activity_get_num_dropped_records(self, ctx, stream, addr):
        import ctypes

        ctypes.c_size_t.from_address(addr).value = 5


def test_session_buffer_callback_counts_drops_and_survives_bad_records(tmp_path):
    s = cap.Session(tmp_path, cupti_module=FakeCupti())
    s.running = True
    s._completed([kernel_rec(1, 2, 1), NS(kind=10), marker_rec(1, 1, 2, "step")])
    s._completed()  # a binding that passes nothing must not break us either
    s.running = False
    s.write_chunk()
    raw = cap.read_chunks(tmp_path)
    counts = {r["name"]: r["value"] for r in raw["count"].to_pylist()}
    assert raw["kernel"].num_rows == 1 and raw["marker"].num_rows == 1
    assert counts["dropped_records"] == 10 and counts["conversion_errors:kernel"] == 1


def test_launch_cbids_pick_launch_apis_only():
    members = {"cudaLaunchKernel_v7000": 211, "cudaLaunchHostFunc_v10000": 300, "cudaGraphLaunch_v10000": 311,
               "cudaMemcpy_v3020": 31, "cudaLaunchKernelExC_v11060": 430}  # fmt: skip
    got = cap.launch_cbids(members, cap.RUNTIME_LAUNCH_PREFIXES)
    assert got == {211: "cudaLaunchKernel", 311: "cudaGraphLaunch", 430: "cudaLaunchKernelExC"}
    drv = cap.launch_cbids(
        {"cuLaunchKernel": 307, "cuLaunchKernelEx_ptsz": 653, "cuMemAlloc": 1},
        cap.DRIVER_LAUNCH_PREFIXES,
    )
    assert drv == {307: "cuLaunchKernel", 653: "cuLaunchKernelEx_ptsz"}


# --- the child process: failures give a partial run and one clear line, never a hang ----------

_ROWS = {
    "kernel": [
        {
            "device": 0,
            "stream": 7,
            "start_ns": 100,
            "end_ns": 200,
            "mangled": "_Z3fooi",
            "correlation_id": 5,
        }
    ],
    "launch": [{"correlation_id": 5, "thread": 11, "ts": 90, "api": "cudaLaunchKernel"}],
}


@pytest.mark.parametrize(
    "fake, expect",
    [
        ("crash", "killed by signal 11 (SIGSEGV)"),
        ("hang", "did not finish within 8 s"),
        ("exit", "exited with code 7: fake workload: giving up"),
        ("cuda_error", "RuntimeError: CUDA error: an illegal memory access"),
    ],
)
def test_child_failures_give_partial_run_and_one_line(tmp_path, fake, expect):
    t = time.monotonic()
    res = cap.run_capture(
        {"fake": fake, "fake_rows": _ROWS},
        out=tmp_path / "run",
        timeout=8 if fake == "hang" else 60,
        grace_s=2,
        echo=False,
    )
    assert time.monotonic() - t < 30
    assert not res.ok and expect in res.message and "\n" not in res.message
    assert "run marked partial with 1 kernel record flushed" in res.message
    run = read_run(tmp_path / "run")
    assert run.meta.partial is True and run.kernels.num_rows == 1
    assert run.kernels.column("launch_api").to_pylist() == ["cudaLaunchKernel"]


def test_crash_after_the_capture_was_written_keeps_a_complete_run(tmp_path):
    res = cap.run_capture(
        {"fake": "crash_at_exit", "fake_rows": _ROWS}, out=tmp_path / "run", timeout=60, echo=False
    )
    assert res.ok and res.message is None
    run = read_run(tmp_path / "run")
    assert run.meta.partial is False and "signal 11" in run.meta.notes


def test_child_ok(tmp_path):
    res = cap.run_capture(
        {"fake": "ok", "fake_rows": _ROWS}, out=tmp_path / "run", timeout=30, echo=False
    )
    assert res.ok and res.message is None
    run = read_run(tmp_path / "run")
    assert run.meta.partial is False and run.meta.source == "cupti"
    assert run.kernels.column("name").to_pylist() == ["foo"]


def test_program_mode_bootstrap_and_exit_code(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(
        "import os, sys\nprint(os.environ.get('DECODESCOPE_CAPTURE_OWNER'))\nsys.exit(int(sys.argv[1]))\n"
    )
    # fake=ok: the bootstrap runs without CUPTI on this CPU machine
    res = cap.run_capture(
        {"fake": "ok", "program": True},
        out=tmp_path / "r0",
        timeout=30,
        command=["python", str(prog), "0"],
        echo=False,
    )
    assert res.ok, res.message
    assert read_run(tmp_path / "r0").meta.workload == "prog"
    res = cap.run_capture(
        {"fake": "ok", "program": True},
        out=tmp_path / "r1",
        timeout=30,
        command=["python", str(prog), "5"],
        echo=False,
    )
    assert not res.ok and "exited with code 5" in res.message


def test_program_that_raises(tmp_path):
    prog = tmp_path / "boom.py"
    prog.write_text("raise ValueError('bad shape (3, 4)')\n")
    res = cap.run_capture(
        {"fake": "ok", "program": True},
        out=tmp_path / "r",
        timeout=30,
        command=["python", str(prog)],
        echo=False,
    )
    assert not res.ok and "ValueError: bad shape (3, 4)" in res.message


# --- validation helpers, --modules, CLI ---------------------------------------------------------


def test_check_attribution_and_kineto_comparison_on_graph_run():
    from decodescope.tracer import validate

    run = cr.assemble(_graph_raw(replays=3), RunMeta(run_id="g", source="cupti"))
    ops = [
        "layer.0.attn.qkv_proj",
        "layer.0.moe.router",
        "layer.1.attn.qkv_proj",
        "layer.1.moe.router",
    ]
    chk = validate.check_attribution(run, ops)
    assert chk["ok"] and chk["steps"] == 3 and chk["kernels_per_step"] == 4
    bad = validate.check_attribution(run, ops + ["layer.1.moe.experts"])
    assert not bad["ok"] and "layer.1.moe.experts" in bad["problems"][0]
    summary, table = validate.compare_runs(run, run)
    assert summary["ok"] and summary["kernels_compared"] == 4 and table.num_rows == 4
    assert [r["cupti"] for r in summary["per_layer_counts"]] == [2, 2]


def test_modules_ranges_name_module_paths():
    torch = pytest.importorskip("torch")
    from decodescope.tracer import current_path, modules

    seen = []

    class Attn(torch.nn.Module):
        def forward(self, x):
            seen.append(current_path())
            return x

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()

        def forward(self, x):
            return self.self_attn(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    modules.instrument()
    try:
        Model()(torch.zeros(1))
    finally:
        modules.uninstrument()
    assert seen == [
        "model/model.layers.0/model.layers.0.self_attn",
        "model/model.layers.1/model.layers.1.self_attn",
    ]
    assert current_path() == ""


def test_cli_capture_needs_a_workload_or_a_program(capsys):
    from decodescope.ui.cli import main

    with pytest.raises(SystemExit) as e:
        main(["capture", "--steps", "3"])
    assert e.value.code == 2
    assert "either --workload NAME or a program after --" in capsys.readouterr().err


def test_cli_capture_refuses_an_out_folder_it_would_have_to_replace(tmp_path, capsys):
    """``capture --out`` at a folder of other files (synthetic: one file in a temp folder): one
    line, exit 2, before any child runs (a capture of minutes is not lost at the end), and the
    folder is left as it was."""
    from decodescope.ui.cli import main

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(SystemExit) as e:
        main(["capture", "--workload", "standard", "--out", str(mine)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "is a folder that is not a decodescope run folder" in err and len(err.splitlines()) == 1
    assert (mine / "notes.txt").read_text() == "keep me" and len(list(mine.iterdir())) == 1


class HybridCupti:
    """cupti-python's real enums and struct classes, with the CUPTI calls stubbed (no driver)."""

    def __init__(self):
        from cupti import cupti as real

        self._real = real
        self.subscribed = None
        self.enabled_callbacks = []
        self.enabled_kinds = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def set_thread_id_type(self, t):
        self.tid_type = int(t)

    def get_thread_id_type(self):
        return self.tid_type

    def get_timestamp(self):
        return 123456789

    def activity_register_callbacks(self, req, done):
        self.req, self.done = req, done

    def activity_enable(self, kind):
        self.enabled_kinds.append(int(kind))

    def activity_disable(self, kind):
        pass

    def activity_enable_hw_trace(self, enable):
        self.hw_calls = [*getattr(self, "hw_calls", []), int(enable)]

    def subscribe(self, cb, userdata):
        self.subscribed = cb
        return 77

    def unsubscribe(self, sub):
        pass

    def enable_callback(self, enable, sub, domain, cbid):
        self.enabled_callbacks.append((int(domain), int(cbid)))

    def get_graph_node_id(self, node):
        return node + 1000  # stands in for the driver's id of the node handle

    def activity_flush_all(self, flag):
        pass

    def activity_get_num_dropped_records(self, ctx, stream, addr):
        pass


def test_session_start_and_callbacks_with_real_cupti_structs(tmp_path):
    """Drives Session.start and its callbacks with cupti-python's real struct classes built over
    numpy memory, so every attribute name the session reads is checked against the binding."""
    np = pytest.importorskip("numpy")
    pytest.importorskip("cupti")
    c = HybridCupti()
    s = cap.Session(tmp_path, cupti_module=c).start()
    real = c._real
    assert set(c.enabled_kinds) >= {10, 1, 2, 12, 17}
    rt, drv, res = (
        int(real.CallbackDomain.RUNTIME_API),
        int(real.CallbackDomain.DRIVER_API),
        int(real.CallbackDomain.RESOURCE),
    )
    names = {
        (d, cb): n for d in (rt, drv) for cb, n in s._api[d].items()
    }  # fmt: skip
    assert "cudaLaunchKernel" in names.values() and "cuLaunchKernelEx" in names.values()
    assert "cudaGraphLaunch" in names.values() and "cuGraphLaunch" in names.values()
    assert (res, int(real.CallbackIdResource.GRAPHNODE_CREATED)) in c.enabled_callbacks
    assert (res, int(real.CallbackIdResource.GRAPHNODE_CLONED)) in c.enabled_callbacks
    assert all(d in (rt, drv, res) for d, _ in c.enabled_callbacks)

    # a launch callback: CallbackData over real memory, passed as the object and as a pointer
    cbd = np.zeros(1, dtype=real.callback_data_dtype)
    cbd["callback_site"] = int(real.ApiCallbackSite.API_ENTER)
    cbd["correlation_id"] = 41
    launch = next(cb for (d, cb), n in names.items() if d == rt and n == "cudaLaunchKernel")
    c.subscribed(None, rt, launch, real.CallbackData.from_data(cbd))
    c.subscribed(None, rt, launch, int(cbd.ctypes.data))
    cbd["callback_site"] = int(real.ApiCallbackSite.API_EXIT)
    c.subscribed(None, rt, launch, int(cbd.ctypes.data))  # exit: ignored

    # GRAPHNODE_CREATED / CLONED: ResourceData -> GraphData, as a pointer and as an object
    gd = np.zeros(1, dtype=real.graph_data_dtype)
    gd["node"], gd["original_node"] = 5, 4
    rd = np.zeros(1, dtype=real.resource_data_dtype)
    rd["resource_descriptor"] = int(gd.ctypes.data)
    from decodescope.tracer import range as trange

    with trange("step"), trange("layer.0.attn.qkv_proj"):
        c.subscribed(None, res, int(real.CallbackIdResource.GRAPHNODE_CREATED), int(rd.ctypes.data))
    c.subscribed(
        None, res, int(real.CallbackIdResource.GRAPHNODE_CLONED), real.ResourceData.from_data(rd)
    )
    assert s.counts.get("callback_errors", 0) == 0, s.errors
    s.stop()
    raw = cap.read_chunks(tmp_path)
    assert (
        raw["launch"].to_pylist()
        == [
            {
                "correlation_id": 41,
                "thread": raw["launch"]["thread"][0].as_py(),
                "ts": 123456789,
                "api": "cudaLaunchKernel",
            }
        ]
        * 2
    )
    g = raw["gnode"].to_pylist()
    assert (g[0]["event"], g[0]["node_id"], g[0]["host_path"]) == (
        "created",
        1005,
        "step/layer.0.attn.qkv_proj",
    )
    assert (g[1]["event"], g[1]["node_id"], g[1]["original_node_id"]) == ("cloned", 1005, 1004)


# --- cost structure of the session (overhead work) ----------------------------------------------


def test_records_are_views_tells_copies_from_buffer_views():
    np = pytest.importorskip("numpy")
    pytest.importorskip("cupti")
    from cupti import cupti as real

    dt = real.activity_kernel9_dtype
    buf = np.zeros(8, dtype=dt)
    views = [real.ActivityKernel9.from_ptr(buf.ctypes.data + i * dt.itemsize, owner=buf) for i in range(8)]  # fmt: skip
    copies = [real.ActivityKernel9.from_ptr(buf.ctypes.data + i * dt.itemsize) for i in range(8)]
    assert cap._records_are_views(views)
    assert not cap._records_are_views(copies)
    assert cap._records_are_views(copies[:1])  # one record cannot tell: convert at once
    assert not cap._records_are_views([kernel_rec(1, 2, 1), kernel_rec(3, 4, 2)])


def test_buffer_callback_defers_conversion_until_the_chunk_is_written(tmp_path):
    s = cap.Session(tmp_path, cupti_module=FakeCupti())
    s.running = True
    s._completed(
        [kernel_rec(1, 2, 1), NS(kind=13), kernel_rec(3, 4, 2), marker_rec(1, 1, 2, "step")]
    )
    # kernels kept, not converted, in CUPTI's thread; markers converted (their name strings);
    # MARKER_DATA dropped
    assert [len(p) for p in s._pending] == [2] and list(s._rows) == ["marker"]
    assert s.counts["buffers_completed"] == 1 and s.counts["records_delivered"] == 4
    s.running = False
    s.write_chunk()
    raw = cap.read_chunks(tmp_path)
    assert raw["kernel"].num_rows == 2 and raw["marker"].num_rows == 1 and not s._pending


def test_buffer_callback_converts_views_at_once(tmp_path):
    class View(NS):
        pass

    recs = [View(**vars(kernel_rec(i, i + 1, i)), ptr=1000 + 208 * i) for i in range(3)]
    s = cap.Session(tmp_path, cupti_module=FakeCupti())
    s._completed(recs)
    assert not s._pending and len(s._rows["kernel"]) == 3


def test_discard_drains_and_keeps_markers(tmp_path):
    s = cap.Session(tmp_path, cupti_module=FakeCupti())
    s._completed([kernel_rec(1, 2, 1), kernel_rec(3, 4, 2), marker_rec(1, 1, 2, "warmup")])
    s._launch.append((5, TID, 9, 1, 211))
    s.discard()
    assert not s._pending and not s._launch and not s._rows["kernel"]
    assert len(s._rows["marker"]) == 1


@pytest.mark.parametrize(
    "kw, launch, resource",
    [
        ({}, False, True),  # the default: native launch records, no launch callbacks
        ({"launch_records": "activity"}, False, True),
        ({"launch_records": "none", "graph_nodes": False}, False, False),
        ({"launch_records": "callback", "graph_nodes": False}, True, False),
    ],
)
def test_session_parts_enable_only_what_they_name(tmp_path, kw, launch, resource):
    pytest.importorskip("cupti")

    class Hybrid(HybridCupti):
        def activity_enable_runtime_api(self, cbid, on):
            self.api_records = getattr(self, "api_records", 0) + 1

        activity_enable_driver_api = activity_enable_runtime_api

    c = Hybrid()
    s = cap.Session(tmp_path, cupti_module=c, kinds=("CONCURRENT_KERNEL",), **kw).start()
    real = c._real
    res = int(real.CallbackDomain.RESOURCE)
    assert c.enabled_kinds == [int(real.ActivityKind.CONCURRENT_KERNEL)]
    assert any(d != res for d, _ in c.enabled_callbacks) == launch
    assert any(d == res for d, _ in c.enabled_callbacks) == resource
    assert (c.subscribed is not None) == (launch or resource)
    assert (getattr(c, "api_records", 0) > 0) == (
        kw.get("launch_records", "activity") == "activity"
    )
    s.stop()


def test_launch_rows_get_api_names_when_written(tmp_path):
    pytest.importorskip("cupti")
    c = HybridCupti()
    s = cap.Session(tmp_path, cupti_module=c).start()
    rt = int(c._real.CallbackDomain.RUNTIME_API)
    cbid = next(cb for cb, n in s._api[rt].items() if n == "cudaLaunchKernel")
    s._launch.append((7, TID, 11, rt, cbid))
    s._launch.append((8, TID, 12, rt, 999999))  # unknown cbid: its number
    s.stop()
    rows = cap.read_chunks(tmp_path)["launch"].to_pylist()
    assert [r["api"] for r in rows] == ["cudaLaunchKernel", "999999"]


class ApiCupti(HybridCupti):
    """HybridCupti that also keeps the per-API record switches and the flush period."""

    def __init__(self):
        super().__init__()
        self.api_calls = []
        self.flush_periods = []
        self.disabled_kinds = []

    def activity_enable_runtime_api(self, cbid, on):
        self.api_calls.append(("rt", int(cbid), int(on)))

    def activity_enable_driver_api(self, cbid, on):
        self.api_calls.append(("drv", int(cbid), int(on)))

    def activity_flush_period(self, ms):
        self.flush_periods.append(int(ms))

    def activity_disable(self, kind):
        self.disabled_kinds.append(int(kind))


def test_stop_switches_off_what_start_switched_on(tmp_path):
    """API records, kinds and the flush period: a later session (or none) starts clean."""
    pytest.importorskip("cupti")
    c = ApiCupti()
    s = cap.Session(tmp_path, cupti_module=c, flush_period_ms=20).start()
    on = [x for x in c.api_calls if x[2] == 1]
    assert on and c.flush_periods == [20]
    s.stop()
    off = [x for x in c.api_calls if x[2] == 0]
    assert sorted(x[:2] for x in off) == sorted(x[:2] for x in on)
    assert c.flush_periods == [20, 0] and sorted(c.disabled_kinds) == sorted(c.enabled_kinds)
    assert s.enable_kind("NO_SUCH_KIND") is False and s.counts["enable_failed:NO_SUCH_KIND"] == 1


def test_graph_trace_only_at_start(tmp_path):
    """GRAPH_TRACE switched on mid-session crashed the next graph launch on the H200: the
    session asks for it at start only and refuses it later, with a note."""
    pytest.importorskip("cupti")
    c = ApiCupti()
    s = cap.Session(tmp_path, cupti_module=c, kinds=("CONCURRENT_KERNEL", "GRAPH_TRACE")).start()
    assert c.enabled_kinds[-1] == int(c._real.ActivityKind.GRAPH_TRACE) == cr.KIND_GRAPH_TRACE
    assert int(c._real.ActivityKind.KERNEL) == cr.KIND_KERNEL
    s.stop()
    assert int(c._real.ActivityKind.GRAPH_TRACE) in c.disabled_kinds
    c = ApiCupti()
    s = cap.Session(tmp_path / "b", cupti_module=c, kinds=("CONCURRENT_KERNEL",)).start()
    n = len(c.enabled_kinds)
    assert s.enable_kind("GRAPH_TRACE") is False and len(c.enabled_kinds) == n
    assert s.counts["enable_failed:GRAPH_TRACE"] == 1 and "session starts" in s.errors[-1]
    s.stop()


def _bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_capture_overhead.py"
    spec = importlib.util.spec_from_file_location("bench_capture_overhead", path)
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    return b


def test_overhead_bench_variants_are_session_options(tmp_path):
    pytest.importorskip("cupti")
    b = _bench()
    for name, v in b.VARIANTS.items():
        if v is None:
            continue
        c = ApiCupti()
        s = cap.Session(tmp_path / name, cupti_module=c, **v).start()
        real = c._real
        want = [int(getattr(real.ActivityKind, k)) for k in v.get("kinds", cap.ACTIVITY_KINDS)]
        assert c.enabled_kinds == want, name
        assert not s.errors, (name, s.errors)
        s.stop()
    assert set(b.CORRECT) <= set(b.VARIANTS)
    assert set(b.LABELS) == set(b.VARIANTS)


def test_overhead_bench_plan_one_child_per_case_and_variant_rotated_by_round():
    b = _bench()
    vs = b.parse_variants("default,kernel,graph_trace,off,default")
    assert vs == ["default", "kernel", "graph_trace"]
    plan = b.plan_children(["standard-b1", "specialized-b1"], vs, 2)
    assert len(plan) == 12 and len(set(plan)) == 12
    assert [v for r, c, v in plan if r == 0 and c == "standard-b1"] == vs
    assert [v for r, c, v in plan if r == 1 and c == "standard-b1"] == [
        "kernel", "graph_trace", "default"]  # fmt: skip
    assert [c for r, c, v in plan[:3]] == ["standard-b1"] * 3  # a case's children together
    assert b.plan_children(["x"], ["default"], 1) == [(0, "x", "default")]
    assert b.parse_variants("control,default") == ["control", "default"]
    assert b.VARIANTS["control"] is None and "control" not in b.CORRECT
    with pytest.raises(ValueError, match="unknown variants"):
        b.parse_variants("default,nope")
    with pytest.raises(ValueError, match="besides off"):
        b.parse_variants("off")
    assert b.steps_for(400, 25, 10, 400) == 62 and b.steps_for(7000, 25, 10, 400) == 10
    assert b.steps_for(0, 25, 3, 50) == 3
    assert b.parse_attrs("host_pinned=1,device_buffer_mb=32") == {
        "host_pinned": 1,
        "device_buffer_mb": 32,
    }
    with pytest.raises(ValueError, match="--attrs"):
        b.parse_attrs("pinned=1")
    opts = b.workload_opts("standard", "64", ["layers=kda"])
    assert opts == {"preset": "kimi-k3", "tp_shape": "8", "layers": "kda", "batch": "64"}


def _child(variant, off_gpu, off_eager, on_gpu, on_eager, n=3, records=None):
    def fig(gpu, nat):
        return {"natural_us": nat, "natural_host_us": 5.0, "gpu_us": gpu, "host_us": 5.0,
                "hidden": True, "n": 10, "n_gpu": 5, "buffers_in_loop": 0}  # fmt: skip

    def blocks(phase, v, gpu, nat, recs):
        figs = {"graph": fig(gpu, gpu), "eager": fig(nat * 0.3, nat)}
        return [{"phase": phase, "variant": v, "figures": figs, "records": recs}
                for _ in range(n)]  # fmt: skip

    return {"case": "standard-b1", "variant": variant, "notes": [], "build_s": 2.0,
            "child_s": 20.0, "step_us": {"graph": off_gpu, "eager": off_eager},
            "blocks": blocks("off", "off", off_gpu, off_eager, {})
            + blocks("on", variant, on_gpu, on_eager, records or {})}  # fmt: skip


def test_overhead_bench_summary_against_each_childs_own_off_and_verdicts():
    b = _bench()
    recs = {"graph": {"kernel": 57.0, "launch_api": 1.0}, "eager": {"kernel": 57.0}}
    children = [
        _child("default", 400, 3000, 410, 3600, records=recs),
        _child("default", 420, 3000, 430.5, 3600, records=recs),  # drift: its own baseline
        _child("no_marker_data", 400, 3000, 406, 3100, records=recs),
        _child("graph_trace", 400, 3000, 401, 3200, records={"graph": {"graph": 1.0}}),
        {"case": "standard-b1", "variant": "kernel", "error": "exit -11 in phase: on: 3 blocks"},
    ]
    s = b.summarize_case(children)
    g, e = s["graph"], s["eager"]
    assert g["default"]["children"] == 2 and g["default"]["gpu_overheads"] == pytest.approx(
        [0.025, 0.025])  # fmt: skip
    assert g["default"]["gpu_overhead"] == pytest.approx(0.025)
    assert g["graph_trace"]["gpu_overhead"] == pytest.approx(0.0025)
    assert g["off"]["gpu_overhead"] == 0 and g["off"]["blocks"] == 12
    assert g["default"]["records_per_step"] == {"kernel": 57.0, "launch_api": 1.0}
    assert e["default"]["natural_overhead"] == pytest.approx(0.2)
    assert "kernel" not in g
    v = s["verdicts"]
    assert v["graph"]["ok"] is False and v["graph"]["best"] == "graph_trace"
    assert v["graph"]["best_ok"] and v["eager"]["best"] == "no_marker_data"
    assert s["child_errors"] == ["kernel: exit -11 in phase: on: 3 blocks"]
    results = {"cases": {"standard-b1": children,
                         "specialized-b1": [{"case": "specialized-b1", "variant": "default",
                                             "error": "exit 1 in phase: build"}]},
               "summaries": {"standard-b1": s}}  # fmt: skip
    text = b._report(results)
    for want in ("default (capture)", "default+GRAPH_TRACE", "kernel=57.0", "+2.5%",
                 "verdict standard-b1 graph (gpu): default  +2.5% (over 2%)",
                 "cheapest complete: default+GRAPH_TRACE",
                 "child error: kernel: exit -11 in phase: on: 3 blocks",
                 "specialized-b1/default: error: exit 1 in phase: build"):  # fmt: skip
        assert want in text, want
    assert b.summarize_case([children[-1]])["verdicts"]["graph"] == {
        "figure": "gpu", "target": 0.02}  # fmt: skip


class _FakeCuda:
    """Just enough of torch.cuda for the benchmark's inner loop, on the host clock."""

    def __init__(self):
        self.steps = 0

    class Event:
        def __init__(self, enable_timing=True):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    class Stream:
        def wait_stream(self, other):
            pass

    def current_stream(self):
        return self.Stream()

    @staticmethod
    def synchronize(*a):
        pass

    @staticmethod
    def _sleep(cycles):
        pass

    def stream(self, s):
        import contextlib

        return contextlib.nullcontext()

    class CUDAGraph:
        def replay(self):
            time.sleep(2e-5)

    def graph(self, g):
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def is_available():
        return True


def _run_inner_on_fakes(b, monkeypatch, variant, blocks=3, eager_ab=0, graph_ab=0):
    import json
    import sys
    from types import ModuleType

    from decodescope.kernels import workloads as reg

    torch = ModuleType("torch")
    torch.cuda = _FakeCuda()
    torch.__version__ = "fake"
    monkeypatch.setitem(sys.modules, "torch", torch)
    events = []
    sessions = []

    class FakeSession(cap.Session):
        def __init__(self, out, **kw):
            super().__init__(out, cupti_module=ApiCupti(), **kw)
            sessions.append(self)

        def start(self):
            if self.kinds == ("KERNEL",):
                raise RuntimeError("CUPTI_ERROR_NOT_COMPATIBLE")  # a variant CUPTI refuses
            events.append("session start")
            return super().start()

        def stop(self):
            events.append("session stop")
            return super().stop()

        def flush(self):  # stands in for CUPTI delivering one kernel record per step so far
            if self.running and not self._paused and self._pending is not None:
                self._completed([kernel_rec(1, 2, 1)])

    monkeypatch.setattr(cap, "Session", FakeSession)

    class Graph(_FakeCuda.CUDAGraph):
        n = 0

        def __init__(self):
            Graph.n += 1
            self.id = Graph.n
            events.append(f"capture G{self.id}")

        def replay(self):
            events.append(f"replay G{self.id}")
            time.sleep(2e-5)

    torch.cuda.CUDAGraph = Graph
    calls = []

    def fake(**opts):
        calls.append(opts)
        return reg.Workload(name="fake", step=lambda: time.sleep(1e-5), refresh=lambda: None,
                            meta={"workload": "fake", "batch": int(opts["batch"])})  # fmt: skip

    monkeypatch.setitem(reg.WORKLOADS, "fakebench", fake)
    case = {"name": "fakebench-b1", "workload": "fakebench", "opts": {"batch": "1"},
            "variant": variant, "attrs": {}, "round": 0}  # fmt: skip
    args = b.argparse.Namespace(inner=json.dumps(case), blocks=blocks, block_ms=1.0,
                                eager_ab=eager_ab, graph_ab=graph_ab)  # fmt: skip
    res = b.inner(args)
    assert calls == [{"batch": "1"}]
    return json.loads(json.dumps(res, default=str)), events, sessions


def test_overhead_bench_child_off_first_then_one_session_never_stopped(monkeypatch, capsys):
    """A child: off blocks on G0 (no session), then ONE session, G captured under it, on blocks
    on G; the session is never stopped and nothing is replayed after any stop (the H200 crash)."""
    pytest.importorskip("cupti")
    b = _bench()
    res, events, sessions = _run_inner_on_fakes(b, monkeypatch, "default")
    assert "failed" not in res, res.get("failed")
    assert [x["phase"] for x in res["blocks"]] == ["off"] * 3 + ["on"] * 3
    start = events.index("session start")
    assert "session stop" not in events and len(sessions) == 1 and sessions[0].running
    assert all(e in ("capture G1", "replay G1") for e in events[:start])  # G0 before the session
    assert events[start + 1] == "capture G2" and set(events[start + 2 :]) == {"replay G2"}
    on = res["blocks"][-1]
    assert set(on["figures"]) == {"graph", "eager"} and on["records"]["graph"]["kernel"] > 0
    assert res["blocks"][0]["records"] == {}
    err = capsys.readouterr().err
    names = [ln.split(" phase ", 1)[1] for ln in err.splitlines() if " phase " in ln]
    assert [n.split()[0] for n in names] == [
        "import", "build", "capture", "sizing", "off:", "session", "capture", "refresh", "on:",
        "done"]  # fmt: skip
    assert all(ln.startswith("[fakebench-b1/default] phase ") for ln in err.splitlines()
               if " phase " in ln)  # fmt: skip
    s = b.summarize_case([res])
    assert {"off", "default"} <= set(s["graph"]) and "fakebench-b1" in b.format_case(
        "fakebench-b1", [res], s)  # fmt: skip


def test_overhead_bench_control_child_has_no_session_in_either_phase(monkeypatch):
    pytest.importorskip("cupti")
    b = _bench()
    res, events, sessions = _run_inner_on_fakes(b, monkeypatch, "control", blocks=2)
    assert "failed" not in res and not sessions and "session start" not in events
    assert [(x["phase"], x["variant"]) for x in res["blocks"]] == [("off", "off")] * 2 + [
        ("on", "control")] * 2  # fmt: skip
    assert "capture G2" in events and all(x["records"] == {} for x in res["blocks"])
    assert "control" in b.summarize_case([res])["graph"]


def test_overhead_bench_child_a_refused_variant_fails_alone_after_its_off_blocks(monkeypatch):
    pytest.importorskip("cupti")
    b = _bench()
    res, events, _ = _run_inner_on_fakes(b, monkeypatch, "kernel_serial", blocks=2)
    assert "NOT_COMPATIBLE" in res["failed"] and res["phase"].startswith("session start")
    assert [x["phase"] for x in res["blocks"]] == ["off", "off"]
    assert "session start" not in events


def test_overhead_bench_run_child_names_the_phase_a_crash_happened_in(tmp_path, monkeypatch):
    """A child killed by SIGSEGV (as on the H200) is one error naming its last phase line."""
    b = _bench()
    fake = tmp_path / "crash.py"
    fake.write_text(
        "import json, os, signal, sys\n"
        "c = json.loads(sys.argv[sys.argv.index('--inner') + 1])\n"
        "tag = f\"[{c['name']}/{c['variant']}]\"\n"
        "print(tag, 'phase build (1.0 s)', file=sys.stderr, flush=True)\n"
        "print(tag, 'phase on: 3 blocks, G + eager, session default (2.0 s)', file=sys.stderr,"
        " flush=True)\n"
        "print('[other/x] phase not mine', file=sys.stderr, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    monkeypatch.setattr(b, "__file__", str(fake))
    args = b.argparse.Namespace(no_inject=True, blocks=3, block_ms=25.0, eager_ab=4, graph_ab=0)
    r = b.run_child({"name": "standard-b1", "variant": "default"}, args, 30)
    assert r["error"] == ("exit -11 in phase: on: 3 blocks, G + eager, session default (2.0 s)"), r
    ok = tmp_path / "ok.py"
    ok.write_text('print(\'noise\')\nprint(\'{"case": "x", "variant": "default"}\')\n')
    monkeypatch.setattr(b, "__file__", str(ok))
    assert b.run_child({"name": "x", "variant": "default"}, args, 30)["case"] == "x"
    hang = tmp_path / "hang.py"
    hang.write_text(
        "import sys, time\n"
        "print('[y/lean] phase build (0.1 s)', file=sys.stderr, flush=True)\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(b, "__file__", str(hang))
    r = b.run_child({"name": "y", "variant": "lean"}, args, 2)
    assert r["error"] == "timed out after 2 s in phase: build (0.1 s)", r


def test_overhead_bench_main_writes_as_it_goes_and_skips_what_does_not_fit(tmp_path, monkeypatch):
    import json

    b = _bench()
    seen = []

    def run_child(case, args, timeout):
        seen.append((case["name"], case["variant"], case["round"]))
        time.sleep(0.05)
        return {"case": case["name"], "variant": case["variant"], "error": "exit -11 in phase: x"}

    monkeypatch.setattr(b, "run_child", run_child)
    out = tmp_path / "o"
    assert b.main(["--workload", "standard", "--batch", "1,64", "--variants",
                   "default,launch_none", "--out", str(out)]) == 0  # fmt: skip
    assert seen == [("standard-b1", "default", 0), ("standard-b1", "launch_none", 0),
                    ("standard-b64", "default", 0), ("standard-b64", "launch_none", 0)]  # fmt: skip
    res = json.loads((tmp_path / "o.json").read_text())
    assert len(res["cases"]["standard-b1"]) == 2
    assert "standard-b64/launch_none: error: exit -11" in (tmp_path / "o.txt").read_text()
    seen.clear()
    b.main(["--workload", "standard", "--batch", "1", "--budget-s", "10", "--out", str(out)])
    assert seen == []  # a child is assumed to need ~20 s until one has run
    res = json.loads((tmp_path / "o.json").read_text())
    assert res["cases"]["standard-b1"][0]["error"] == "skipped: time budget"


class HwCupti(HybridCupti):
    """HybridCupti that takes (or refuses) ``activity_enable_hw_trace``."""

    def __init__(self, refuse: bool):
        super().__init__()
        self.refuse, self.hw_calls = refuse, []

    def activity_enable_hw_trace(self, enable):
        if self.refuse:
            raise RuntimeError("CUPTI_ERROR_NOT_SUPPORTED")  # as a GPU without HES answers
        super().activity_enable_hw_trace(enable)


@pytest.mark.parametrize("refuse", [False, True])
def test_session_hw_trace_on_off_and_refused(tmp_path, refuse):
    pytest.importorskip("cupti")
    c = HwCupti(refuse)
    s = cap.Session(tmp_path, cupti_module=c, hw_trace=True).start()
    # the kinds are enabled either way: a refusal leaves a note, not a broken session
    assert set(c.enabled_kinds) >= {10, 1, 2}
    if refuse:
        assert s.counts["hw_trace_refused"] == 1 and "hw_trace" not in s.counts
        assert any("activity_enable_hw_trace" in e for e in s.errors)
    else:
        assert c.hw_calls == [1] and s.counts["hw_trace"] == 1
    s.stop()
    assert c.hw_calls == ([] if refuse else [1, 0])  # switched off again at stop
    # without the option nothing asks for it
    c2 = HwCupti(refuse=False)
    cap.Session(tmp_path / "plain", cupti_module=c2).start().stop()
    assert c2.hw_calls == []


def test_child_spec_passes_hw_trace_to_the_session(tmp_path):
    from decodescope.tracer import child

    s = child._start({"out": str(tmp_path / "a"), "fake": True, "hw_trace": True})
    assert s.hw_trace is True
    s = child._start({"out": str(tmp_path / "b"), "fake": True})
    assert s.hw_trace is False


def test_overhead_bench_child_eager_ab_pauses_and_resumes_the_same_session(monkeypatch):
    """--eager-ab: after the on blocks, eager blocks with the one session paused and recording,
    ABBA; no graph replay while paused; the session is left recording."""
    pytest.importorskip("cupti")
    b = _bench()
    res, events, sessions = _run_inner_on_fakes(b, monkeypatch, "default", blocks=1, eager_ab=2)
    assert "failed" not in res, res.get("failed")
    assert [x["phase"] for x in res["blocks"]] == [
        "off", "on", "ab_off", "ab_on", "ab_on", "ab_off"]  # fmt: skip
    assert all(set(x["figures"]) == {"eager"} for x in res["blocks"][2:])
    (s,) = sessions
    assert s.running and not s._paused and "session stop" not in events
    c = s._cupti
    kinds = len(s._enabled)
    # two pauses: every kind disabled twice, every launch record switched 0 then 1 again
    assert len(c.disabled_kinds) == 2 * kinds
    offs = [x for x in c.api_calls if x[2] == 0]
    assert len(offs) == 2 * len(s._api_enabled) and c.api_calls[-1][2] == 1
    summ = b.summarize_case([res])
    e = summ["eager"]["default"]
    assert e["natural_ab_overhead"] == pytest.approx(e["natural_ab_overheads"][0])
    assert "interleaved" in summ["verdicts"]["eager"]
    assert "gpu_ab_overhead" not in summ["graph"]["default"]  # no --graph-ab: none of it
    assert "interleaved in one process" in b.format_case("fakebench-b1", [res], summ)


def test_overhead_bench_child_graph_ab_replays_g_paused_and_recording(monkeypatch):
    """--graph-ab: after the eager A/B, G replayed with the one session paused and recording,
    ABBA; the paused blocks count no kernel records (the fake flush delivers none while
    paused), and the summary gives recording over paused and paused over the off blocks."""
    pytest.importorskip("cupti")
    b = _bench()
    res, events, sessions = _run_inner_on_fakes(b, monkeypatch, "default", blocks=1, eager_ab=2,
                                                graph_ab=2)  # fmt: skip
    assert "failed" not in res, res.get("failed")
    assert [x["phase"] for x in res["blocks"]] == [
        "off", "on", "ab_off", "ab_on", "ab_on", "ab_off",
        "gab_off", "gab_on", "gab_on", "gab_off"]  # fmt: skip
    gab = res["blocks"][6:]
    assert all(set(x["figures"]) == {"graph"} for x in gab)
    assert all(not x["records"]["graph"] for x in gab if x["phase"] == "gab_off")
    assert all(x["records"]["graph"]["kernel"] > 0 for x in gab if x["phase"] == "gab_on")
    (s,) = sessions
    assert s.running and not s._paused and "session stop" not in events
    start = events.index("session start")
    assert set(events[start + 2 :]) == {"replay G2"}  # G replayed paused, never G0 again
    summ = b.summarize_case([res])
    g = summ["graph"]["default"]
    assert g["gpu_ab_overhead"] == pytest.approx(g["gpu_ab_overheads"][0])
    assert g["paused_records_per_step"] == 0 and g["paused_overhead"] == g["paused_overhead"]
    assert "G replayed with the session paused" in b.format_case("fakebench-b1", [res], summ)


def test_session_pause_resume_noop_when_not_running(tmp_path):
    s = cap.Session(tmp_path, cupti_module=FakeCupti())
    s.pause()  # not started: nothing to do, no CUPTI call
    assert not s._paused
    s.resume()
    assert not s._paused


def test_run_records_kernel_knobs(monkeypatch):
    """The DECODESCOPE_* knobs set for a capture (inherited by the child) land in the run's
    config_json["knobs"] and notes; the tool's own variables and empty values do not."""
    for k in [k for k in __import__("os").environ if k.startswith("DECODESCOPE_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("DECODESCOPE_MOE_T1_W2", "tile")
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE", "0")
    monkeypatch.setenv("DECODESCOPE_L2_PREFETCH", "")  # empty: the default, not a knob
    monkeypatch.setenv("DECODESCOPE_GIT_COMMIT", "abc1234")  # the tool's own
    monkeypatch.setenv(cap.SPEC_ENV, "/tmp/spec.json")
    assert cap.kernel_knobs() == {"DECODESCOPE_DENSE_TILE": "0", "DECODESCOPE_MOE_T1_W2": "tile"}
    m = cap._build_meta({"workload": "w"}, {}, {}, time.time(), partial=False, command=None,
                        message=None)  # fmt: skip
    assert m.config["knobs"] == {"DECODESCOPE_DENSE_TILE": "0", "DECODESCOPE_MOE_T1_W2": "tile"}
    assert "kernel knobs: DECODESCOPE_DENSE_TILE=0, DECODESCOPE_MOE_T1_W2=tile" in m.notes
    monkeypatch.delenv("DECODESCOPE_MOE_T1_W2")
    monkeypatch.delenv("DECODESCOPE_DENSE_TILE")
    m = cap._build_meta({"workload": "w"}, {}, {}, time.time(), partial=False, command=None,
                        message=None)  # fmt: skip
    assert "knobs" not in m.config and not (m.notes or "").count("knobs")
    assert cap.knobs_line({}) is None


def test_knobs_of_and_default_tables():
    """knobs_of reads both records (the capture's config_json["knobs"] and the specialized
    workload's older kernel_env, handshake variables dropped); the bundled tables (demo, README)
    show the newest run of the defaults, never a run captured with knobs (synthetic metas)."""
    import json

    from decodescope.ui.cmd_demo import _pairs
    from decodescope.ui.cmd_report import knobs_of

    def meta(rid, created, cfg):
        return RunMeta(run_id=rid, source="cupti", created_at=created, preset="p", tp_shape=8,
                       batch=1, backend="specialized", config_json=json.dumps(cfg))  # fmt: skip

    old = meta("a", "2026-12-01T10", {"workload": {"kernel_env": {
        "DECODESCOPE_CAPTURE_SPEC": "/x", "DECODESCOPE_MOE_BACK_NORM": "post"}}})  # fmt: skip
    new = meta("b", "2026-12-01T11", {"knobs": {"DECODESCOPE_DENSE_TILE": "0"}})
    plain = meta(
        "c", "2026-12-01T09", {"workload": {"kernel_env": {"DECODESCOPE_CAPTURE_OWNER": "1"}}}
    )
    assert knobs_of(old) == {"DECODESCOPE_MOE_BACK_NORM": "post"}
    assert knobs_of(new) == {"DECODESCOPE_DENSE_TILE": "0"} and knobs_of(plain) == {}
    pairs = _pairs([NS(meta=m) for m in (old, new, plain)])
    assert [r.meta.run_id for by in pairs.values() for r in by.values()] == ["c"]
