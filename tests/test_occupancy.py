""":mod:`analysis.occupancy` (CTAs per SM, waves) and its columns in ``decodescope timeline``:
hand-computed cases at the allocation rules, the figures of committed H200 runs whose plans
state their CTAs per SM, and real traces of known and unknown GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import cli

from decodescope import tracer
from decodescope.analysis import occupancy as occ
from decodescope.analysis import timeline as tl

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
# TP8 32x8 (verify step) and TP16 batch 1, specialized, H200 (ae03bef / a494371)
VERIFY = f"{RESULTS}@specialized-20261204T182256-713b13"
BATCH1 = f"{RESULTS}@specialized-20261204T031629-ed57e6"
TRACES = ROOT / "tests" / "data" / "traces"
H200 = occ.limits_for("NVIDIA H200")


@pytest.mark.parametrize(
    "threads,regs,smem,want",
    [
        (128, 80, 99072, 2),  # W13T1 at TP16: shared memory (2 x 100,096 of 233,472 bytes)
        (256, 154, 185904, 1),  # the MLA split kernel at TP8 32x8: shared memory
        (128, 32, 32, 16),  # threads: 2048 / 128
        (128, 99, 32, 4),  # registers: 99 -> 3328 a warp, 19 -> 16 warps a SM, 4 per block
        (1024, 32, 0, 2),  # threads and registers both: 2 x 32 warps
        (1024, 64, 0, 1),  # registers: 2,048 a warp, the SM's 65,536 for one block
        (256, 255, 0, 1),  # registers: 8,192 a warp, 8 warps a SM
        (256, 0, 240000, 0),  # more shared memory than an SM has: none fits
        (32, 16, 0, 32),  # block slots
    ],
)
def test_ctas_per_sm(threads, regs, smem, want):
    assert occ.ctas_per_sm(threads, regs, smem, H200) == want


def test_unknowns_and_waves():
    assert occ.ctas_per_sm(128, None, 0, H200) is None
    assert occ.ctas_per_sm(0, 32, 0, H200) is None
    assert occ.waves(384, 1, H200) == pytest.approx(384 / 132)
    assert occ.waves(384, 0, H200) is None and occ.waves(384, None, H200) is None
    assert occ.limits_for("GeForce GTX 1060 with Max-Q Design") is None
    assert occ.limits_for(None) is None
    a100 = occ.limits_for("NVIDIA A100-SXM4-80GB")
    assert (a100.sms, a100.smem) == (108, 167936)
    assert occ.ctas_per_sm(256, 154, 185904, a100) == 0  # the H200's 182 KB plan fits no A100 SM


def test_timeline_columns_on_h200_runs():
    """The plans' own CTAs per SM come back from the records: the MLA split kernel of the TP8
    32x8 verify step at one CTA per SM and 384 CTAs, 2.91 waves (the second wave part 51
    targets); W13T1 at TP16 batch 1 at two per SM (``experts_t1.WIDE_PER_SM``), 192 CTAs in
    one wave. Every kernel of both layers has both figures."""
    v = tracer.load(VERIFY)
    t = tl.layer_timeline(v.kernels, 2, tl.median_step(v.kernels, 2), limits=H200)
    assert t["waves"].null_count == 0 and t["ctas_sm"].null_count == 0
    row = t["kernel"].to_pylist().index("mla_decode_splitMLADecodeSplit")
    assert t["ctas_sm"][row].as_py() == 1
    assert t["waves"][row].as_py() == pytest.approx(384 / 132)
    b = tracer.load(BATCH1)
    t = tl.layer_timeline(b.kernels, 1, tl.median_step(b.kernels, 1), limits=H200)
    row = t["kernel"].to_pylist().index("experts_t1W13T1")
    assert (t["ctas_sm"][row].as_py(), t["grid"][row].as_py()) == (2, "192,1,1")
    assert t["waves"][row].as_py() == pytest.approx(192 / 264)


def test_cli_timeline_waves_and_unknown_gpus():
    """The CLI's table and JSON carry the columns; a trace whose GPU's limits are not known (an
    Nsight Systems export without TARGET_INFO_GPU) says so in one line and shows none; a known
    one (an H100 Kineto trace) shows them for every kernel."""
    p = cli("timeline", VERIFY, "--layer", "2")
    assert p.returncode == 0, p.stderr
    assert "CTAs/SM" in p.stdout and "waves" in p.stdout
    js = json.loads(cli("timeline", VERIFY, "--layer", "2", "--json").stdout)
    assert js[0]["gpu"] == "NVIDIA H200"
    assert all(r["waves"] is not None for r in js[0]["kernels"])
    nsys = TRACES / "nsys_h100x2_fastvideo_nvtx_aten__nsys-ai_h100_2gpu_1s.sqlite"
    p = cli("timeline", nsys, "--limit", "3")  # its export names no GPU and no SM figures
    assert p.returncode == 0, p.stderr
    note = [x for x in p.stdout.splitlines() if x.startswith("CTAs/SM, waves:")]
    assert len(note) == 1 and "the GPU (the trace names none) are not known" in note[0]
    assert "no device properties in the trace" in note[0]
    h100 = TRACES / "kineto_h100_qwen1.5-0.5b_hf_eager__TraceLens.json.gz"
    js = json.loads(cli("timeline", h100, "--json").stdout)
    assert all(r["waves"] is not None and r["ctas_sm"] > 0 for r in js[0]["kernels"])


def test_limits_from_device_properties():
    """A Kineto trace's ``deviceProperties`` give the limits (kept by the import in the run's
    ``config_json["device"]``): the H100 trace's equal the table's H100; a property missing or
    a compute capability not tabled gives none; a run's recorded properties win over its name;
    traces of GPUs not in the table (V100, cc 7.0: no reserved shared memory) get figures for
    every kernel from them."""
    h100 = {"numSms": 132, "maxThreadsPerMultiprocessor": 2048, "regsPerMultiprocessor": 65536,
            "sharedMemPerMultiprocessor": 233472, "computeMajor": 9, "computeMinor": 0}  # fmt: skip
    assert occ.limits_from_props(h100) == occ.limits_for("NVIDIA H100 80GB HBM3")
    assert occ.limits_from_props({**h100, "numSms": None}) is None
    assert occ.limits_from_props({**h100, "computeMajor": 5}) is None
    assert occ.limits_from_props(None) is None
    dev = json.dumps({"device": {**h100, "numSms": 100}})
    assert occ.run_limits("NVIDIA H200", dev).sms == 100
    assert occ.run_limits("NVIDIA H200", "{not json") == H200
    assert occ.run_limits("NVIDIA H200", None) == H200
    v100 = tracer.load(TRACES / "kineto_v100_ddp_ns_resolution__HTA.pt.trace.json.gz")
    cfg = json.loads(v100.meta.config_json)["device"]
    assert (cfg["numSms"], cfg["computeMajor"], cfg["computeMinor"]) == (80, 7, 0)
    lim = occ.run_limits(v100.meta.gpu, v100.meta.config_json)
    assert (lim.sms, lim.smem_reserved, lim.blocks) == (80, 0, 32)
    js = json.loads(cli("timeline", TRACES / "kineto_a100_torchcompile_cudagraph__HTA_negative_queue"
                        ".json.gz", "--json").stdout)  # fmt: skip
    assert js[0]["sms"] == 108 and all(r["waves"] is not None for r in js[0]["kernels"])


def test_limits_from_nsys_exports():
    """An Nsight Systems export's TARGET_INFO_GPU gives the limits (its ``maxBlocksPerSm`` where
    recorded: 16 on the RTX 3080, cc 8.6; the capability's where not: the GTX 1060, cc 6.1,
    records 0)."""
    rtx = tracer.load(TRACES / "nsys_rtx3080_tiny_full_schema3.24__nsys-ai_mock.sqlite")
    lim = occ.run_limits(rtx.meta.gpu, rtx.meta.config_json)
    assert (lim.sms, lim.blocks, lim.smem, lim.threads) == (68, 16, 102400, 1536)
    gtx = tracer.load(TRACES / "nsys_gtx1060_schema2.9.1_nvtx_nested__extrap_profile16.sqlite")
    lim = occ.run_limits(gtx.meta.gpu, gtx.meta.config_json)
    assert (lim.sms, lim.blocks, lim.smem_reserved) == (10, 32, 0)
    js = json.loads(cli("timeline", TRACES / "nsys_gtx1060_schema2.9.1_nvtx_nested__extrap_"
                        "profile16.sqlite", "--json").stdout)  # fmt: skip
    assert js[0]["sms"] == 10 and all(r["ctas_sm"] is not None for r in js[0]["kernels"])
