"""The process model of tp_world > 1 (tracer/distributed.py) on a CPU: capture children that
do nothing on the GPU (the child's ``fake`` specs), one per rank. What a user relies on: a rank
that fails ends every rank, quickly, with one line naming it; the merged run is partial and keeps
the rank column; nobody hangs; every child runs without NVLink multicast."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from decodescope.tracer import read_run
from decodescope.tracer.distributed import (
    NO_MULTICAST_ENV,
    free_port,
    launch,
    rank_env,
    run_distributed_capture,
)


def test_failing_rank_stops_the_others(tmp_path):
    t = time.monotonic()
    res = run_distributed_capture(
        {"steps": 1}, 2, out=tmp_path / "run", timeout=120, grace_s=3,
        rank_specs=[{"fake": "hang"}, {"fake": "exit"}], echo=False,
    )  # fmt: skip
    assert time.monotonic() - t < 60  # rank 0 would hang for ever: it was stopped
    assert not res.ok
    assert res.message.startswith("rank 1 of 2 failed: the capture child exited with code 7")
    assert "stopped rank 0" in res.message and "\n" not in res.message
    run = read_run(res.out)
    assert run.meta.partial and run.meta.tp_world == 2
    assert [d.name for d in res.rank_dirs] == ["rank0", "rank1"]
    assert all(d.is_dir() for d in res.rank_dirs)  # each rank wrote its own (partial) run


def test_every_rank_timing_out_ends(tmp_path):
    t = time.monotonic()
    res = run_distributed_capture(
        {"steps": 1}, 2, out=tmp_path / "run", timeout=3, grace_s=2,
        rank_specs=[{"fake": "hang"}, {"fake": "hang"}], echo=False,
    )  # fmt: skip
    assert time.monotonic() - t < 40
    assert not res.ok and "did not finish within 3 s" in res.message


def test_ranks_that_succeed_merge(tmp_path):
    rows = [
        {"name": "k", "start_ns": 1000 * (r + 1), "end_ns": 2000 * (r + 1), "stream": 7}
        for r in range(2)
    ]
    res = run_distributed_capture(
        {"steps": 1}, 2, out=tmp_path / "run", timeout=60,
        rank_specs=[{"fake": "ok", "fake_rows": {"kernel": [rows[r]]}} for r in range(2)],
        echo=False,
    )  # fmt: skip
    assert res.ok, res.message
    run = read_run(res.out)
    assert run.meta.tp_world == 2 and not run.meta.partial
    assert sorted(run.kernels["rank"].to_pylist()) == [0, 1]
    assert len({r["run_id"] for r in run.meta.config["ranks"]}) == 1  # one run id for all ranks


def test_launch_env_and_fail_fast(tmp_path):
    """Plain processes (GPU scripts): rank env, no multicast, first failure stops the rest."""
    # Rank 1 fails only once rank 0 has printed its line: on a loaded machine rank 0 can start
    # more than grace_s after rank 1, and would be stopped before it wrote anything.
    r0_log = tmp_path / "r0.log"
    code = (
        "import os, sys, time\n"
        "print(os.environ['RANK'], os.environ['LOCAL_RANK'], os.environ['WORLD_SIZE'],"
        " os.environ['NCCL_NVLS_ENABLE'], os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST'],"
        " os.environ['NVSHMEM_DISABLE_NVLS'], flush=True)\n"
        "if os.environ['RANK'] == '1':\n"
        "    end = time.monotonic() + 60\n"
        f"    while not open({str(r0_log)!r}).read().strip() and time.monotonic() < end:\n"
        "        time.sleep(0.05)\n"
        "    sys.exit(5)\n"
        "time.sleep(600)\n"
    )
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in NO_MULTICAST_ENV}
    os_env = dict(os.environ)
    try:
        os.environ.clear()
        os.environ.update(env)  # the launcher must set them even where the parent has none
        t = time.monotonic()
        res = launch(
            [[sys.executable, "-c", code]] * 2, [rank_env(r, 2, port) for r in range(2)],
            timeout=120, grace_s=2, logs=[r0_log, tmp_path / "r1.log"],
        )  # fmt: skip
    finally:
        os.environ.clear()
        os.environ.update(os_env)
    assert time.monotonic() - t < 30
    assert res[1].returncode == 5 and not res[1].stopped
    assert res[0].stopped and res[0].returncode != 0
    for r in range(2):
        assert Path(tmp_path / f"r{r}.log").read_text().split() == [
            str(r),
            str(r),
            "2",
            "0",
            "1",
            "1",
        ]
