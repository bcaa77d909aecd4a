"""The ``specialized`` workload at tp_world 2 on a CPU: option handling and names (``plan``),
the dense layer's down+allreduce hook and the fused plans (tiny preset, kernels recorded, not
compiled), and scripts/gpu_steps_tp2.py --dry-run (two gloo processes: the factory's tp_world 2
path for real, the specialized step emulated by a standard model on the same weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from decodescope.kernels.specialized import step as S  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(preset="tiny", tp_shape=2, batch=2, layers="dense,kda,mla")


def test_plan_tp_world_2_names_and_meta():
    p = S.plan(**TINY, tp_world=2)
    assert p.meta["tp_world"] == 2
    cfg = json.loads(p.meta["config_json"])
    assert (cfg["allreduce"], cfg["weights"]) == ("fused", "rank")
    r = cfg["ranges"]
    assert "layer.0.mlp.down+allreduce" in r["layer.0:dense"]
    assert "layer.0.attn.o_proj+allreduce+residual" in r["layer.0:dense"]
    back = "layer.1.moe.latent_allreduce+latent_norm+latent_up+shared_allreduce+add"
    assert back in r["layer.1:kda"]
    assert not any(o.endswith(".o_proj") or o.endswith(".down") for v in r.values() for o in v)
    # launch counts do not change: the reductions ride inside existing launches
    one = json.loads(S.plan(**TINY).meta["config_json"])
    assert cfg["launches"] == one["launches"]
    assert set(cfg["op_impl"].values()) == {S.CUTE}
    assert "allreduce" not in one


@pytest.mark.parametrize(
    "opts, words",
    [
        ({"tp_world": 3}, ["tp_world=3", "two-rank"]),
        ({"tp_world": 0}, ["tp_world", ">= 1"]),
        ({"tp_world": 2, "allreduce": "oneshot"}, ["fused", "oneshot"]),
        ({"tp_world": 2, "weights": "all"}, ["weights", "rank, shard"]),
        ({"tp_world": 2, "weights": "shard", "tp_shape": 1}, ["tp_shape 1", "tp_world 2"]),
    ],
)
def test_plan_tp_world_refusals(opts, words):
    with pytest.raises(ValueError) as ei:
        S.plan(**{**TINY, **opts})
    for w in words:
        assert w in str(ei.value), str(ei.value)


def test_factory_without_process_group_says_how_to_start():
    """tp_world 2 outside the launcher: one line naming the missing variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    code = ("from decodescope.kernels.specialized import step as S\n"
            "S.specialized(preset='tiny', tp_shape=2, batch=1, tp_world=2)")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300, cwd=ROOT)  # fmt: skip
    assert p.returncode != 0
    assert "one process per rank" in p.stderr and "RANK" in p.stderr, p.stderr[-2000:]


def test_enable_tp2_dense_down_and_fused_plans(monkeypatch):
    """The dense layer's down launch becomes the o_proj fused kernel on dense_w2 with a zero
    residual (writes the all-reduced MLP output); ``fused_plans`` lists every fused kernel the
    step launches (the keys the launches compile under)."""
    from decodescope.kernels.specialized import comm, tp2
    from decodescope.kernels.specialized import interface as itf
    from decodescope.kernels.specialized import moe_allreduce as ma
    from decodescope.kernels.specialized import oproj_allreduce as oa

    keys, calls = [], []

    def record(key, build):
        keys.append(key)
        return lambda *a, **k: calls.append((key, a))

    monkeypatch.setattr(itf, "compiled", record)
    p = S.plan(**TINY)
    m = S.SpecializedModel(p.cfg, p.specs, p.batch, 1, device="cpu")
    dev = torch.device("cpu")
    i32 = torch.int32
    ws = comm.PeerWorkspace(0, 2, torch.zeros(comm.FLAG_SLOTS, dtype=i32, device=dev),
                            torch.zeros(2, 16, device=dev),
                            torch.zeros(comm.FLAG_SLOTS, dtype=i32, device=dev),
                            torch.zeros(2, 16, device=dev), torch.zeros(4, dtype=i32, device=dev))  # fmt: skip
    S.enable_tp2(m, ws)
    dense = m.dense[0]
    ops = [op for op, _ in dense.stages(m.rs[0], m.xs[0])]
    assert ops[-1] == tp2.OP_DENSE_DOWN and "down" not in ops
    m.step()
    oa_calls = [(k, a) for k, a in calls if k[0] == "oproj_allreduce"]
    assert len(oa_calls) == 4  # 3 o_proj + the dense down
    down = [a for k, a in oa_calls if k[1].k == p.cfg.dense_inter]
    assert len(down) == 1
    o, w, r, r_out = down[0][:4]
    assert o is dense.act and w is dense.w["dense_w2"] and r_out is m.xs[0]
    assert r is dense.zero_residual and not bool(r.any())
    assert down[0][5] > 0  # prefetch: the next layer's first GEMM weights
    plans = tp2.fused_plans(m)
    launched = {k[1] for k, _ in calls if k[0] in ("oproj_allreduce", "moe_allreduce")}
    assert set(plans) == launched
    assert sum(isinstance(x, ma.MoeARPlan) for x in plans) == 1  # kda and mla share it
    assert tp2.precompile(m) == len(plans)
    assert isinstance(plans[0], oa.OProjARPlan)


@pytest.mark.parametrize("spec_allreduce", ["fused", "nccl"])
def test_gpu_steps_tp2_dry_run(tmp_path, spec_allreduce):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_steps_tp2.py"), "--dry-run", "--out",
         str(tmp_path), "--batches", "1,8", "--draws", "1", "--budget", "300",
         "--spec-allreduce", spec_allreduce],
        capture_output=True, text=True, timeout=400, env=env, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    got = {(r["rank"], r["case"], r["check"]) for r in rows if r.get("ok")}
    sfx = "" if spec_allreduce == "fused" else "-nccl"
    for rank in (0, 1):
        for case in ("b1" + sfx, "b8" + sfx):  # b8: the MoE back end unfused (NCCL)
            for check in ("built", "same weights (standard and specialized, this rank)",
                          "fused kernels launched (the factory's first step)", "eager"):  # fmt: skip
                assert (rank, case, check) in got, (rank, case, check)
    assert not [r for r in rows if r.get("ok") is False]
    built = [r for r in rows if r["check"] == "built"]
    assert {r["spec_allreduce"] for r in built} == {spec_allreduce}
    assert "PASS: 0 failing" in p.stdout.splitlines()[-1]


def test_plan_tp_world_2_nccl_fallback():
    """allreduce=nccl: explicit all-reduce launches around the single-GPU kernels, named and
    recorded as torch.distributed (o_proj with a zero residual, all-reduce, residual add)."""
    p = S.plan(**TINY, tp_world=2, allreduce="nccl")
    cfg = json.loads(p.meta["config_json"])
    assert cfg["allreduce"] == "nccl"
    kda = cfg["ranges"]["layer.1:kda"]
    i = kda.index("layer.1.attn.o_proj")
    assert kda[i + 1 : i + 3] == ["layer.1.attn.allreduce", "layer.1.attn.residual_add"]
    # one NCCL all-reduce of the block's adjacent latent sum and shared output (acc_shared)
    assert kda[-2] == "layer.1.moe.latent_allreduce+shared_allreduce"
    assert cfg["ranges"]["layer.0:dense"][-1] == "layer.0.mlp.allreduce"
    one = json.loads(S.plan(**TINY).meta["config_json"])["launches"]
    assert cfg["launches"] == {
        "layer.0:dense": one["layer.0:dense"] + 3,
        "layer.1:kda": one["layer.1:kda"] + 3,
        "layer.2:mla": one["layer.2:mla"] + 3,
    }
    impl = cfg["op_impl"]
    assert impl["attn.allreduce"] == impl["moe.latent_allreduce+shared_allreduce"]
    assert impl["attn.allreduce"] == "torch.distributed:nccl"
    assert impl["attn.residual_add"] == "torch:add" and impl["attn.o_proj"] == S.CUTE


@pytest.mark.parametrize("allreduce", ["fused", "nccl"])
def test_step_ranges_match_the_plan(monkeypatch, allreduce):
    """The ranges a tp_world 2 step opens (kernels recorded, all-reduce a no-op on this CPU)
    are the plan's range names, in order: what analysis maps the kernels to."""
    import contextlib

    import torch.distributed as dist

    from decodescope.kernels.specialized import attention_layers, comm, dense_mlp, moe_block, tp2
    from decodescope.kernels.specialized import interface as itf

    opened: list[str] = []

    @contextlib.contextmanager
    def rec(name):
        opened.append(name)
        yield

    for mod in (attention_layers, moe_block, dense_mlp, S):
        monkeypatch.setattr(mod, "_range", rec)
    monkeypatch.setattr(itf, "compiled", lambda key, build: lambda *a, **k: None)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: None)
    p = S.plan(**TINY, tp_world=2, allreduce=allreduce)
    m = S.SpecializedModel(p.cfg, p.specs, p.batch, 1, device="cpu")
    if allreduce == "nccl":
        tp2.install_nccl(m)
    else:
        i32, dev = torch.int32, torch.device("cpu")
        ws = comm.PeerWorkspace(0, 2, torch.zeros(comm.FLAG_SLOTS, dtype=i32, device=dev),
                                torch.zeros(2, 16, device=dev),
                                torch.zeros(comm.FLAG_SLOTS, dtype=i32, device=dev),
                                torch.zeros(2, 16, device=dev),
                                torch.zeros(4, dtype=i32, device=dev))  # fmt: skip
        S.enable_tp2(m, ws)
    m.step()
    want = []
    for lay, ops in p.range_names().items():
        want += [lay, *ops]
    assert opened == want


def test_nccl_moe_one_allreduce_over_adjacent_buffers():
    """The MoE block keeps its routed latent sum and shared output adjacent (``acc_shared``), so
    the NCCL fallback (and the unfused back end from 8 tokens) sums both in one all-reduce; with
    separate buffers it falls back to two."""
    import contextlib

    import torch

    from decodescope.kernels.specialized import tp2

    class FakeDist:
        def __init__(self):
            self.calls = []

        def all_reduce(self, t):
            self.calls.append(t)
            t.mul_(2)  # what a two-rank sum of equal inputs gives

    class FakeMoe:
        def __init__(self, adjacent: bool):
            N, L, H = 3, 8, 16
            if adjacent:
                self.acc_shared = torch.arange(N * (L + H), dtype=torch.float32)
                self.acc = self.acc_shared[: N * L].view(N, L)
                self.shared_out = self.acc_shared[N * L :].view(N, H)
            else:
                self.acc = torch.ones(N, L)
                self.shared_out = torch.ones(N, H)
            self.ranges = []
            self.back = lambda out: out.copy_(self.shared_out)

        def _r(self, op):
            self.ranges.append(op)
            return contextlib.nullcontext()

    for adjacent, n in ((True, 1), (False, 2)):
        moe, dist = FakeMoe(adjacent), FakeDist()
        before = (moe.acc.clone(), moe.shared_out.clone())
        tp2._nccl_moe(moe, dist)
        out = torch.empty_like(moe.shared_out)
        moe.back(out)
        assert len(dist.calls) == n
        assert torch.equal(moe.acc, 2 * before[0]) and torch.equal(out, 2 * before[1])
        if adjacent:
            assert moe.ranges == [tp2.OP_LATENT_SHARED_AR]
        else:
            assert moe.ranges == ["latent_allreduce", "shared_allreduce"]
