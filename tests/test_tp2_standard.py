"""Two ranks on the CPU (gloo): the standard layers at tp_world 2 with the TP1 weights sharded
the way vLLM shards them compute what the TP1 layers compute on one process.

The worker half of this file runs as ``python tests/test_tp2_standard.py --worker OUT`` in each
rank's process (started by decodescope.tracer.distributed.launch)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

OPTS = dict(preset="tiny", batch=2, tokens_per_seq=2, layers="kda,mla", seed=5, device="cpu")


def _worker(out: str, allreduce: str = "nccl") -> None:
    import torch

    from decodescope.kernels.workloads import standard

    wl = standard(tp_shape=2, tp_world=2, weights="shard", allreduce=allreduce, **OPTS)
    m = wl.model
    rank = int(os.environ["RANK"])
    torch.save(
        {
            "x": m.x_out,
            "r": m.r_out,
            "states": m.states,
            "meta": dict(wl.meta),
            "ids": {i: t.clone() for i, t in m.selected_experts().items()},
        },
        Path(out) / f"rank{rank}.pt",
    )


def _launch(tmp_path: Path, extra: list[str] | None = None):
    from decodescope.tracer.distributed import free_port, launch, rank_env

    port = free_port()
    argv = [sys.executable, __file__, "--worker", str(tmp_path), *(extra or [])]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    return launch(
        [argv, argv], [{**rank_env(r, 2, port), **env} for r in range(2)], timeout=240,
        logs=logs,
    )  # fmt: skip


def test_tp2_gloo_equals_tp1(tmp_path):
    import torch

    from decodescope.kernels.config import get_config
    from decodescope.kernels.reference import rel_l2
    from decodescope.kernels.standard.model import parse_layers
    from decodescope.kernels.workloads import standard

    res = _launch(tmp_path)
    for r in res:
        assert r.returncode == 0, f"rank {r.rank}: {r.tail}"
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    one = standard(tp_shape=1, **OPTS)
    m1 = one.model
    full, cfg = get_config("tiny", 1), get_config("tiny", 2)
    specs = parse_layers(cfg, OPTS["layers"])
    ids1 = m1.selected_experts()
    for g in got:
        assert g["meta"]["tp_world"] == 2 and g["meta"]["tp_shape"] == 2
        for i, t in ids1.items():  # same routing, else the comparison below means nothing
            assert torch.equal(
                torch.sort(g["ids"][i].long(), 1).values, torch.sort(t.long(), 1).values
            )
        assert rel_l2(g["x"], m1.x_out) < 2e-2
        assert rel_l2(g["r"], m1.r_out) < 1e-2
    # ranks agree with each other exactly after the all-reduce (same sum on both)
    assert torch.equal(got[0]["x"], got[1]["x"])
    from decodescope.kernels.sharding import shard_state

    for li, sp in enumerate(specs):
        for r in range(2):
            want = shard_state(full, cfg, sp, m1.states[li], r)
            for k, v in want.items():
                a, b = got[r]["states"][li][k].float(), v.float()
                if k == "kv_cache":
                    a, b = a.nan_to_num(), b.nan_to_num()
                assert rel_l2(a, b) < 2e-2, (li, r, k)


def test_tp2_oneshot_needs_cuda(tmp_path):
    res = _launch(tmp_path, ["oneshot"])
    assert all(r.returncode != 0 for r in res)
    text = "\n".join(res[0].tail + res[1].tail)
    assert "allreduce=oneshot needs CUDA devices" in text


def test_tp_world_without_launcher_says_so():
    from decodescope.kernels.workloads import standard

    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR") if k in os.environ}
    try:
        with pytest.raises(RuntimeError, match="one process per rank"):
            standard(tp_shape=2, tp_world=2, **OPTS)
    finally:
        os.environ.update(env)


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--worker":
    _worker(sys.argv[2], *(sys.argv[3:4]))
