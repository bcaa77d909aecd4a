"""Attribution and naming, checked on real traces against an independent computation made here
straight from the files (a JSON scan, a SQL query), plus one small synthetic table for the
corners no real trace has (stated where it is used)."""

from __future__ import annotations

import collections
import gzip
import json
import sqlite3
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from decodescope import tracer
from decodescope.analysis import attribution, naming, schema
from decodescope.analysis.schema import UNATTRIBUTED

TRACES = Path(__file__).parent / "data" / "traces"
HF_QWEN = TRACES / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"
VLLM_B200 = TRACES / "kineto_b200_vllm_tp8_rank0_prefill_eager__TraceLens.json.gz"
NSYS_H100 = TRACES / "nsys_h100x2_fastvideo_nvtx_aten__nsys-ai_h100_2gpu_1s.sqlite"
NSYS_NESTED = TRACES / "nsys_gtx1060_schema2.9.1_nvtx_nested__extrap_profile16.sqlite"


# -- independent expectations from the Kineto JSON ---------------------------------------------


def _kineto_expected_layers(path: Path, layer_class: str) -> dict[int, int | None]:
    """correlation id -> layer index, computed from the raw JSON: the kernel's launch (the
    cuda_runtime/cuda_driver event with its correlation id) lies inside which
    ``nn.Module: <layer_class>_N`` event on the launching thread (the innermost: latest start)."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    launches = {
        e["args"]["correlation"]: (e["tid"], e["ts"])
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    prefix = f"nn.Module: {layer_class}_"
    layers = collections.defaultdict(list)  # tid -> [(start, end, N)]
    for e in events:
        if e.get("cat") == "python_function" and str(e.get("name", "")).startswith(prefix):
            layers[e["tid"]].append((e["ts"], e["ts"] + e["dur"], int(e["name"][len(prefix) :])))
    out: dict[int, int | None] = {}
    for e in events:
        if e.get("cat") != "kernel":
            continue
        corr = e["args"]["correlation"]
        tid, ts = launches.get(corr, (None, None))
        inside = [x for x in layers.get(tid, []) if x[0] <= ts <= x[1]] if tid is not None else []
        out[corr] = max(inside)[2] if inside else None
    return out


def _by_correlation(run: schema.Run, column: str) -> dict[int, object]:
    k = run.kernels
    return dict(zip(k["correlation_id"].to_pylist(), k[column].to_pylist(), strict=True))


@pytest.fixture(scope="module")
def hf_run() -> schema.Run:
    return tracer.load(HF_QWEN)


@pytest.fixture(scope="module")
def vllm_run() -> schema.Run:
    return tracer.load(VLLM_B200)


@pytest.mark.parametrize(
    ("fixture", "path", "layer_class", "n_layers"),
    [
        ("hf_run", HF_QWEN, "Qwen2DecoderLayer", 24),
        ("vllm_run", VLLM_B200, "TransformerBlock", 36),
    ],
)
def test_layers_match_module_events(request, fixture, path, layer_class, n_layers):
    run = request.getfixturevalue(fixture)
    expected = _kineto_expected_layers(path, layer_class)
    got = _by_correlation(run, "layer")
    assert set(got) == set(expected)  # every kernel is there, none dropped
    assert got == expected
    assert len({v for v in expected.values() if v is not None}) == n_layers


def test_hf_qwen_per_layer_structure(hf_run):
    k = hf_run.kernels
    layers = [x for x in k["layer"].to_pylist() if x is not None]
    counts = collections.Counter(layers)
    assert set(counts) == set(range(24))
    assert set(counts.values()) == {42}  # every Qwen2 decoder layer launched 42 kernels
    # blocks come from the modules below the layer
    blocks = {
        b
        for b, lyr in zip(k["block"].to_pylist(), k["layer"].to_pylist(), strict=True)
        if lyr is not None
    }
    assert {"attn", "mlp", "norm"} <= blocks


def test_steps_from_profiler_step(hf_run):
    """Kernels launched inside ProfilerStep#6 get step 6; the others the default step 0."""
    with gzip.open(HF_QWEN, "rt") as f:
        events = json.load(f)["traceEvents"]
    (ps,) = [
        e for e in events if e.get("cat") == "user_annotation" and e["name"] == "ProfilerStep#6"
    ]
    gpu_ps = [e for e in events if e.get("cat") == "gpu_user_annotation"]
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    expected = {}
    for e in events:
        if e.get("cat") != "kernel":
            continue
        corr = e["args"]["correlation"]
        ts = launches.get(corr)
        if ts is not None:
            inside = ps["ts"] <= ts <= ps["ts"] + ps["dur"]
        else:  # no launch record: the GPU-side annotation on its stream decides
            inside = any(g["ts"] <= e["ts"] <= g["ts"] + g["dur"] for g in gpu_ps)
        expected[corr] = 6 if inside else 0
    assert _by_correlation(hf_run, "step") == expected


def test_unattributed_kept(hf_run):
    k = hf_run.kernels
    paths = k["range_path"].to_pylist()
    layers = k["layer"].to_pylist()
    unattributed = [i for i, p in enumerate(paths) if p == UNATTRIBUTED]
    assert unattributed  # this trace launches kernels outside ProfilerStep#6
    assert all(layers[i] is None for i in unattributed)
    assert None not in paths


def test_vllm_steps_and_blocks(vllm_run):
    k = vllm_run.kernels
    in_layer = [i for i, x in enumerate(k["layer"].to_pylist()) if x is not None]
    assert len(in_layer) == 36 * 21
    steps = set(k["step"].to_pylist())
    assert steps == {0}  # one execute_context range: step 0
    ops = {(b, o) for b, o in zip(k["block"].to_pylist(), k["op"].to_pylist(), strict=True) if b}
    assert ("mlp", "FusedMoE") in ops
    assert ("attn", "QKVParallelLinear") in ops


# -- independent expectation from an Nsight Systems export (SQL) ---------------------------------


def _nsys_expected_innermost(path: Path) -> collections.Counter:
    """Multiset of the innermost NVTX range text enclosing each kernel's runtime launch (same
    process and thread), computed with SQL + numpy straight from the SQLite file."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    rows = con.execute(
        """
        SELECT r.globalTid, r.start
        FROM CUPTI_ACTIVITY_KIND_KERNEL k
        LEFT JOIN CUPTI_ACTIVITY_KIND_RUNTIME r
          ON r.correlationId = k.correlationId AND (r.globalTid >> 24) = (k.globalPid >> 24)
        """
    ).fetchall()
    nvtx = con.execute(
        "SELECT globalTid, start, end, text FROM NVTX_EVENTS WHERE end IS NOT NULL AND eventType = 59"
    ).fetchall()
    by_tid = collections.defaultdict(list)
    for tid, s, e, text in nvtx:
        by_tid[tid].append((s, e, text))
    arrays = {
        tid: (
            np.array([x[0] for x in v]),
            np.array([x[1] for x in v]),
            [x[2] for x in v],
        )
        for tid, v in by_tid.items()
    }
    out = collections.Counter()
    for tid, t in rows:
        if tid is None or tid not in arrays:
            out[None] += 1
            continue
        s, e, text = arrays[tid]
        hit = np.flatnonzero((s <= t) & (t <= e))
        if not len(hit):
            out[None] += 1
            continue
        # innermost: latest start, then earliest end
        best = min(hit.tolist(), key=lambda i: (-s[i], e[i]))
        out[text[best]] += 1
    return out


def test_nsys_innermost_range_matches_sql():
    run = tracer.load(NSYS_H100)
    expected = _nsys_expected_innermost(NSYS_H100)
    got = collections.Counter(
        None if p == UNATTRIBUTED else p.rsplit("/", 1)[-1]
        for p in run.kernels["range_path"].to_pylist()
    )
    assert sum(got.values()) == sum(expected.values()) == run.kernels.num_rows
    assert got == expected


def test_nsys_nested_nvtx_has_depth():
    run = tracer.load(NSYS_NESTED)
    paths = [p for p in run.kernels["range_path"].to_pylist() if p != UNATTRIBUTED]
    assert paths and max(p.count("/") for p in paths) >= 1


# -- naming -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("step/layer.3:kda/layer.3.attn.qkv_proj", (3, "kda", "attn", "qkv_proj")),
        ("step/layer.7:mla", (7, "mla", None, None)),
        ("step/layer.2/layer.2.moe.router", (2, None, "moe", "router")),
        (
            "step/layer.5:kda/layer.5.attn.o_proj+allreduce+residual_norm",
            (5, "kda", "attn", "o_proj+allreduce+residual_norm"),
        ),
        ("model.layers.3.self_attn.qkv_proj", (3, None, "attn", "qkv_proj")),
        ("model.layers.11.mlp", (11, None, "mlp", "mlp")),
        ("layers.4.block_sparse_moe.experts", (4, None, "moe", "experts")),
        (
            "{'Module': 'top.model.layers.9.self_attn.o_proj', 'Inputs': [[1, 2]]}",
            (9, None, "attn", "o_proj"),
        ),
        (
            "ProfilerStep#6/nn.Module: Qwen2Model_0/nn.Module: Qwen2DecoderLayer_3/"
            "nn.Module: Qwen2Attention_3/nn.Module: Linear_21",
            (3, None, "attn", "Linear"),
        ),
        ("x/nn.Module: TransformerBlock_2/nn.Module: MLPBlock_2", (2, None, "mlp", "MLPBlock")),
        (
            "x/nn.Module: KimiDecoderLayer_4/nn.Module: KimiDeltaAttention_4",
            (4, "kda", "attn", "KimiDeltaAttention"),
        ),
        ("ProfilerStep#6/nn.Module: Qwen2Model_0/nn.Module: Embedding_0", (None, None, None, None)),
        ("execute_context_1(888_788544)_generation_0(0)", (None, None, None, None)),
    ],
)
def test_default_scheme(path, expected):
    n = naming.default_scheme().name_path(path)
    assert (n.layer, n.layer_kind, n.block, n.op) == expected


def test_step_names():
    s = naming.default_scheme()
    assert s.step_number("ProfilerStep#12") == (True, 12)
    assert s.step_number("step") == (True, None)
    assert s.step_number("execute_context_1(888_788544)_generation_0(0)") == (True, None)
    assert s.step_number("layer.3:kda") == (False, None)


def test_custom_scheme_from_toml():
    scheme = naming.Scheme.from_toml(
        """
        default_kind = "block"
        [[layer]]
        pattern = '^blk(?P<layer>\\d+)$'
        [[block]]
        pattern = '^ffn$'
        block = "mlp"
        """
    )
    n = scheme.name_path("fwd/blk4/ffn/up")
    assert (n.layer, n.block, n.op) == (4, "mlp", "up")
    with pytest.raises(ValueError, match="group 'layer'"):
        naming.Scheme.from_toml("[[layer]]\npattern = 'x'\n")


# -- the corners, on a small synthetic table (stated: not a real trace) ---------------------------


def _synthetic_run() -> schema.Run:
    """SYNTHETIC, for corners no real trace here has: two threads, siblings with a gap, deep
    nesting, decodescope's own names, gpu-timeline ranges, a CUDA-graph-mapped path, memops."""
    # thread 1: step 0 [0, 1000) > layer.0:kda [10, 500) > qkv [20, 100), o_proj [200, 300)
    #           step 1 [1000, 2000) > layer.0:kda [1010, 1500) > qkv [1020, 1100)
    # thread 2: layer.1:mla [0, 5000) (another thread: must not leak into thread 1)
    # gpu (stream 7): step [0, 10000) > layer.9 [100, 900)
    ranges = schema.from_pydict(
        {
            "rank": [0] * 9,
            "range_id": list(range(9)),
            "thread": [1, 1, 1, 1, 1, 1, 1, 2, 7],
            "timeline": ["cpu"] * 8 + ["gpu"],
            "start_ns": [0, 10, 20, 200, 1000, 1010, 1020, 0, 100],
            "end_ns": [1000, 500, 100, 300, 2000, 1500, 1100, 5000, 900],
            "name": [
                "step",
                "layer.0:kda",
                "layer.0.attn.qkv_proj",
                "layer.0.attn.o_proj+allreduce",
                "step",
                "layer.0:kda",
                "layer.0.attn.qkv_proj",
                "layer.1:mla",
                "layer.9",
            ],
            "path": [
                "step",
                "step/layer.0:kda",
                "step/layer.0:kda/layer.0.attn.qkv_proj",
                "step/layer.0:kda/layer.0.attn.o_proj+allreduce",
                "step",
                "step/layer.0:kda",
                "step/layer.0:kda/layer.0.attn.qkv_proj",
                "layer.1:mla",
                "layer.9",
            ],
        },
        "ranges",
    )
    kernels = schema.from_pydict(
        {
            "rank": [0] * 8,
            "stream": [7] * 8,
            "start_ns": [5000, 5100, 5200, 5300, 5400, 5500, 150, 6000],
            "end_ns": [5050, 5150, 5250, 5350, 5450, 5550, 200, 6050],
            "name": ["a", "b", "c", "d", "e", "f", "g", "h"],
            "launch_thread": [1, 1, 1, 1, 2, 1, None, 1],
            "launch_start_ns": [50, 150, 250, 1050, 30, 5000, None, 60],
            "range_path": [
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                "step/layer.4:mla/layer.4.moe.router",
            ],
            "step": [None, None, None, None, None, None, None, 17],
        },
        "kernels",
    )
    memops = schema.from_pydict(
        {"rank": [0, 0], "stream": [7, 8], "start_ns": [500, 500], "end_ns": [510, 510]}, "memops"
    )
    return schema.Run(
        meta=schema.RunMeta(run_id="synthetic", source="cupti"),
        kernels=kernels,
        ranges=ranges,
        memops=memops,
    )


def test_synthetic_corners():
    run = attribution.attribute(_synthetic_run())
    k = run.kernels.to_pylist()
    by_name = {r["name"]: r for r in k}
    # innermost on the launching thread
    assert by_name["a"]["range_path"] == "step/layer.0:kda/layer.0.attn.qkv_proj"
    assert (by_name["a"]["layer"], by_name["a"]["layer_kind"], by_name["a"]["op"]) == (
        0,
        "kda",
        "qkv_proj",
    )
    # between two siblings: the enclosing layer, no op
    assert by_name["b"]["range_path"] == "step/layer.0:kda"
    assert (by_name["b"]["layer"], by_name["b"]["op"]) == (0, None)
    assert by_name["c"]["op"] == "o_proj+allreduce"
    # steps numbered by order of the "step" ranges
    assert [by_name[x]["step"] for x in "abcd"] == [0, 0, 0, 1]
    # the other thread's range, not thread 1's
    assert by_name["e"]["range_path"] == "layer.1:mla"
    assert by_name["e"]["layer_kind"] == "mla"
    # launched outside every range: unattributed, never dropped
    assert by_name["f"]["range_path"] == UNATTRIBUTED and by_name["f"]["layer"] is None
    # no launch info: gpu-timeline range on its stream
    assert by_name["g"]["range_path"] == "layer.9" and by_name["g"]["layer"] == 9
    # a path and a step the source gave (graph-node map) are kept
    assert by_name["h"]["range_path"] == "step/layer.4:mla/layer.4.moe.router"
    assert (by_name["h"]["step"], by_name["h"]["layer"], by_name["h"]["block"]) == (17, 4, "moe")
    # memops: gpu ranges of their stream
    m = run.memops.to_pylist()
    assert [x["range_path"] for x in m] == ["layer.9", UNATTRIBUTED]
    assert [x["layer"] for x in m] == [9, None]
    assert run.kernels.num_rows == 8


def test_attribute_keeps_schema_and_is_stable(hf_run):
    again = attribution.attribute(hf_run)
    assert again.kernels.schema == schema.KERNELS
    for c in ("range_path", "step", "layer", "layer_kind", "block", "op"):
        assert again.kernels[c].to_pylist() == hf_run.kernels[c].to_pylist()


def test_innermost_many_events_vectorised():
    """The lookup agrees with a brute-force scan on a real trace's ranges and launch times."""
    run = tracer.load(VLLM_B200)
    r = run.ranges
    cpu = [i for i, t in enumerate(r["timeline"].to_pylist()) if t == "cpu"]
    starts = np.array(r["start_ns"].to_pylist())
    ends = np.array(r["end_ns"].to_pylist())
    threads = np.array(r["thread"].to_pylist())
    k = run.kernels
    lt = np.array(k["launch_start_ns"].to_pylist(), dtype=np.int64)
    th = np.array(k["launch_thread"].to_pylist(), dtype=np.int64)
    got = attribution.innermost(
        r,
        np.zeros(len(lt), dtype=np.int64),
        th,
        lt,
        np.full(len(lt), -5),
        np.zeros(len(lt), dtype=np.int64),
    )
    cpu_set = np.array(cpu)
    for i in range(len(lt)):
        c = cpu_set[
            (threads[cpu_set] == th[i]) & (starts[cpu_set] <= lt[i]) & (lt[i] <= ends[cpu_set])
        ]
        if not len(c):
            assert got[i] == -1
            continue
        best = c[np.lexsort((ends[c], -starts[c]))][0]
        assert starts[got[i]] == starts[best] and ends[got[i]] == ends[best]
    assert pa.types.is_int64(pa.array(got).type)


def test_custom_scheme_extends_default_on_a_real_trace(tmp_path):
    f = tmp_path / "scheme.toml"
    f.write_text(
        'extends = "default"\ndefault_kind = "decoder"\n'
        "[[block]]\npattern = '^Qwen2Attention$'\nblock = \"self_attention\"\n"
    )
    run = tracer.load(HF_QWEN, scheme=tracer.read_scheme(f))
    k = run.kernels
    assert set(k["layer_kind"].drop_null().to_pylist()) == {"decoder"}
    blocks = set(k["block"].drop_null().to_pylist())
    assert "self_attention" in blocks and "attn" not in blocks and "mlp" in blocks
    # a run folder is renamed with the scheme too (its paths are kept)
    out = tracer.write_run(tracer.load(HF_QWEN), tmp_path / "run")
    again = tracer.load(out, scheme=tracer.read_scheme(f))
    assert again.kernels["block"].to_pylist() == k["block"].to_pylist()
    bad = tmp_path / "bad.toml"
    bad.write_text("[[layer]]\npattern = 'no group'\n")
    with pytest.raises(tracer.TraceError, match="has no group 'layer'"):
        tracer.read_scheme(bad)
