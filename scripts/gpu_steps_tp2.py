"""Two GPUs (nvidia-h200-x2): the specialized decode step at tp_world 2 against the standard
decode step at tp_world 2, from the same seed (issue 8, items 3-5).

``python scripts/gpu_steps_tp2.py --out DIR`` starts its own two ranks (one process per GPU,
``decodescope.tracer.distributed.launch``; NCCL; multicast off in every process). Each rank, per
batch (default 1 and 64, kimi-k3 at the TP8 per-rank shapes, layers "dense,kda,mla"):

1. builds the ``standard`` workload (tp_world 2, allreduce nccl, weights rank) and the
   ``specialized`` workload (tp_world 2: fused o_proj / MoE back-end / dense-down reductions
   through peer memory, kernels/specialized/tp2.py) independently from the same seed, and
   checks that this rank's weights are the same tensors on both paths;
2. ``eager``: both steps from the same state (the standard's copied into the specialized
   model) on fresh random inputs (the same on both ranks), every output and the MLA cache rows
   the step writes poisoned with NaN; compared as scripts/gpu_steps.py's ``spec_vs_std`` does:
   ``x_out``, ``r_out`` and each layer's new state (this rank's shard) by rel L2 on the rows
   whose routing agrees, every routing difference a near-tie;
3. ``graph``: the same with the specialized step captured once into a CUDA graph and replayed;
4. the fused kernels' timeout word (a spin that waited over 2 s for the peer) must be clear.

Whether a draw is retried (too few rows compared after near-tie flips) is decided jointly
(all-reduce of the flag): both ranks always run the same sequence of steps. Rows are written
to ``DIR/rank{r}.json`` as they come, then ``DIR/results.json``; a PASS/FAIL table is printed
last. Default about 1.5-2 min on the H200 pair (limit ``--budget``, 150 s).

    source .gpu/run/install.sh && python scripts/gpu_steps_tp2.py --out $OUT/steps_tp2
    python scripts/gpu_steps_tp2.py --out $OUT/steps_tp2 --batches 1,8,32,64 --budget 300

``--dry-run`` (CPU, gloo, preset tiny): the specialized workload's tp_world 2 factory runs for
real with its kernels recorded instead of compiled, and its step is emulated by a standard
model on the same weights and state (CI: tests/test_tp2_spec_steps_script.py): checks the
script's logic, the factory's wiring and the pairing of collectives, not the kernels.
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import gpu_steps as gs  # noqa: E402  (compare_step, capture_graph: the one-GPU comparison)


def log(*a) -> None:
    print(*a, flush=True)


def _one(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:600]


class Rows:
    def __init__(self, out: Path, rank: int) -> None:
        self.path, self.rank, self.rows = out / f"rank{rank}.json", rank, []

    def add(self, **row) -> None:
        row["rank"] = self.rank
        self.rows.append(row)
        log(f"rank {self.rank}: " + json.dumps(row, default=str)[:500])
        self.path.write_text(json.dumps(self.rows, indent=1, default=str))


# -- dry run (CPU): record the kernels, emulate the specialized step --------------------------


def _dry_patches() -> dict:
    """Kernels recorded (not compiled), no GPU check, a CPU stand-in for the peer workspace."""
    import torch

    from decodescope.kernels.specialized import comm
    from decodescope.kernels.specialized import interface as itf
    from decodescope.kernels.specialized import step as S

    calls: dict = {}

    def record(key, build):
        return lambda *a, **k: calls.__setitem__(key[0], calls.get(key[0], 0) + 1)

    def fake_ws(group=None, device=None, **_):
        import torch.distributed as dist

        dev = torch.device("cpu")
        i32 = torch.int32
        return comm.PeerWorkspace(
            dist.get_rank(), 2, torch.zeros(comm.FLAG_SLOTS, dtype=i32, device=dev),
            torch.zeros(2, 16, device=dev), torch.zeros(comm.FLAG_SLOTS, dtype=i32, device=dev),
            torch.zeros(2, 16, device=dev), torch.zeros(4, dtype=i32, device=dev),
        )  # fmt: skip

    itf.compiled = record
    S._require_gpu = lambda dev: None
    comm.PeerWorkspace.create = staticmethod(fake_ws)
    return calls


def _emulate(spec_m, twin) -> None:
    """The specialized step's function computed by a standard model ``twin`` on the same
    weights (dry run): inputs and state in, outputs, state and routing back."""
    twin.x_in.copy_(spec_m.x_in)
    twin.r_in.copy_(spec_m.r_in)
    for a, b in zip(twin.states, spec_m.states, strict=True):
        for k in a:
            a[k].copy_(b[k])
    twin.step()
    spec_m.x_out.copy_(twin.x_out)
    spec_m.r_out.copy_(twin.r_out)
    for a, b in zip(twin.states, spec_m.states, strict=True):
        for k in a:
            b[k].copy_(a[k])
    for lay, moe in zip(twin.layers, spec_m.moe, strict=True):
        if moe is not None:
            moe.topk_ids.copy_(lay.topk_ids)


# -- worker (one process per rank) ---------------------------------------------------------------


def _flag(x: bool, dev) -> bool:
    """True when ``x`` holds on any rank."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if x else 0], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def draws(std_m, spec_m, B: int, run_spec, mode: str, n: int, base: int, a) -> list[dict]:
    """``n`` conclusive draws; retries decided jointly so both ranks step alike."""
    out, got = [], 0
    for attempt in range(3 * n):
        if got >= n:
            break
        r = gs.compare_step(std_m, spec_m, B, 1, run_spec, seed=base + attempt, tie=a.tie,
                            min_rows=a.min_rows)  # fmt: skip
        if _flag(r["inconclusive"], std_m.x_in.device):
            out.append({"mode": f"{mode}-inconclusive", **r})
            continue
        out.append({"mode": mode, **r})
        got += 1
    if got < n:
        out.append({"mode": f"{mode}-too-few", "ok": False, "rows_compared": 0, "rows": B,
                    "checks": [{"check": f"conclusive {mode} draws", "value": got, "tol": n,
                                "ok": False}]})  # fmt: skip
    return out


def _summary(d: dict) -> dict:
    bad = [c for c in d.get("checks", []) if not c["ok"]]
    vals = {c["check"]: c["value"] for c in d.get("checks", []) if c["check"] in ("x_out", "r_out")}
    worst_state = max((c["value"] for c in d.get("checks", [])
                       if c["check"].startswith("layer") and "written" not in c["check"]),
                      default=None)  # fmt: skip
    return {"rows_compared": d.get("rows_compared"), "rows": d.get("rows"), **vals,
            "worst_state": worst_state, "worst_tie": d.get("routing_worst_tie"),
            "failing": [f"{c['check']}={c['value']:.3g} (tol {c['tol']})" for c in bad]}  # fmt: skip


def run_case(rows: Rows, a, B: int, calls: dict | None, mode: str = "fused") -> None:
    import torch
    import torch.distributed as dist

    import decodescope.kernels.specialized.step as S
    from decodescope.kernels.workloads import WORKLOADS

    t0 = time.time()
    opts = dict(preset=a.preset, tp_shape=a.tp_shape, batch=B, layers=a.layers, seed=a.seed,
                tp_world=2, weights=a.weights)  # fmt: skip
    std = spec = twin = g = None
    case = f"b{B}" + ("" if mode == "fused" else f"-{mode}")
    try:
        std = WORKLOADS["standard"](**opts, allreduce="nccl")
        if calls is not None:
            calls.clear()
        spec = S.specialized(**opts, allreduce=mode)
        sm, pm = std.model, spec.model
        ws = pm.tp2_workspace
        cfgj = json.loads(spec.meta["config_json"])
        rows.add(case=case, check="built", ok=spec.meta.get("tp_world") == 2,
                 build_s=round(time.time() - t0, 1), launches=cfgj.get("launches"),
                 std_allreduce=json.loads(std.meta["config_json"]).get("allreduce"),
                 spec_allreduce=cfgj.get("allreduce"))  # fmt: skip
        if calls is not None:  # dry run: the fused reductions the factory's first step launched
            from decodescope.kernels.specialized import tp2 as _tp2

            fused = mode == "fused"
            # from 8 tokens (one per sequence) the MoE back end runs unfused (two NCCL all-reduces
            # and the single-GPU back end: tp2.moe_back_unfused): no moe_allreduce kernel there
            moe_fused = not _tp2.moe_back_unfused(B, pm.cfg.expert_dim, pm.cfg.hidden)
            want = {"oproj_allreduce": fused * (len(pm.specs) + sum(s.mlp == "dense" for s in pm.specs)),
                    "moe_allreduce": fused * moe_fused * sum(s.mlp == "moe" for s in pm.specs)}  # fmt: skip
            got = {k: calls.get(k, 0) for k in want}
            rows.add(case=case, check="fused kernels launched (the factory's first step)",
                     ok=got == want, got=got, want=want)  # fmt: skip
            twin = WORKLOADS["standard"](**opts, allreduce="nccl")
            run_spec = lambda tm=twin.model: _emulate(pm, tm)  # noqa: E731
        else:
            run_spec = pm.step
        rows.add(case=case, check="same weights (standard and specialized, this rank)",
                 ok=gs.same_weights(sm, pm))  # fmt: skip
        res = draws(sm, pm, B, run_spec, "eager", a.draws, 1000, a)
        if calls is None:
            g = gs.capture_graph(pm.step)
            res += draws(sm, pm, B, g.replay, "graph", a.draws, 2000, a)
        for d in res:
            rows.add(case=case, check=d["mode"], ok=None if "inconclusive" in d["mode"] else
                     bool(d["ok"]), seed=d.get("seed"), **_summary(d))  # fmt: skip
        if calls is None and ws is not None:
            torch.cuda.synchronize()
            try:
                ws.check()
                rows.add(case=case, check="no spin timeout (fused kernels' error word)", ok=True)
            except RuntimeError as e:
                rows.add(case=case, check="no spin timeout (fused kernels' error word)",
                         ok=False, error=_one(e))  # fmt: skip
    except Exception as e:
        traceback.print_exc()
        rows.add(case=case, check="(case)", ok=False, error=_one(e))
    finally:
        rows.add(case=case, check="(seconds)", ok=None, seconds=round(time.time() - t0, 1))
        del std, spec, twin, g
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        dist.barrier()


def worker(out: Path, a) -> int:
    from decodescope.kernels.standard.comm import init_from_env

    calls = _dry_patches() if a.dry_run else None
    rank, _ = init_from_env(2)
    rows = Rows(out, rank)
    t0 = time.time()
    modes = [x for x in a.spec_allreduce.split(",") if x]
    cases = [(m, int(x)) for m in modes for x in a.batches.split(",") if x]
    for i, (mode, B) in enumerate(cases):
        late = i > 0 and time.time() - t0 > a.budget * 0.6
        if _flag(late, _dev()):  # decided jointly: both ranks skip or both run
            rows.add(case=f"b{B}-{mode}", check="(skipped: budget)", ok=None)
            continue
        run_case(rows, a, B, calls, mode)
    return 0


def _dev():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- parent ---------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out") + "/steps_tp2")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--layers", default="dense,kda,mla")
    p.add_argument("--preset", default="kimi-k3")
    p.add_argument("--tp-shape", type=int, default=8)
    p.add_argument("--weights", default="rank", help="rank | shard (kernels/sharding.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spec-allreduce", default="fused",
                   help="the specialized path's reductions, a list of: fused (peer-memory "
                        "kernels) | nccl (explicit NCCL launches); each with every batch")  # fmt: skip
    p.add_argument("--draws", type=int, default=2, help="conclusive draws per mode")
    p.add_argument("--tie", type=float, default=gs.TIE)
    p.add_argument("--min-rows", type=float, default=gs.MIN_ROWS)
    p.add_argument("--budget", type=float, default=150.0, help="seconds for everything")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny preset (CI)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.dry_run and a.preset == "kimi-k3":
        a.preset, a.tp_shape = "tiny", 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.worker:
        return worker(out, a)

    from decodescope.tracer.distributed import collect_rank_rows, free_port, launch, rank_env

    t0 = time.time()
    for f in out.glob("rank*.json"):
        f.unlink()
    argv = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    if a.dry_run and "--preset" not in sys.argv:
        argv += ["--preset", a.preset, "--tp-shape", str(a.tp_shape)]
    port = free_port()
    envs = [{**rank_env(r, 2, port), "DECODESCOPE_DIST_TIMEOUT": str(int(a.budget) + 60)}
            for r in range(2)]  # fmt: skip
    if a.dry_run:
        for e in envs:
            e["CUDA_VISIBLE_DEVICES"] = ""
    log(f"gpu_steps_tp2: 2 ranks, batches {a.batches}, layers {a.layers}, {a.preset} "
        f"tp_shape {a.tp_shape}, budget {a.budget:.0f} s")  # fmt: skip
    res = launch([argv, argv], envs, timeout=a.budget, logs=[out / "rank0.log", out / "rank1.log"])
    rows = collect_rank_rows(res, out, case="-")
    results = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
               "total_s": round(time.time() - t0, 1), "dry_run": a.dry_run, "rows": rows}  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    for r in range(2):
        log(f"-- rank {r} log tail --")
        lf = out / f"rank{r}.log"
        if lf.exists():
            log("\n".join(lf.read_text(errors="replace").splitlines()[-15:]))
    log("")
    log(f"{'case':<8} {'rank':>4} {'result':<6} check / figures")
    bad = 0
    for r in rows:
        res_ = {True: "PASS", False: "FAIL", None: "----"}[r.get("ok")]
        bad += r.get("ok") is False
        figs = {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in r.items()
                if k not in ("case", "check", "ok", "rank")}  # fmt: skip
        log(f"{r.get('case', ''):<8} {str(r.get('rank', '')):>4} {res_:<6} {r.get('check', '')}"
            f"  {json.dumps(figs, default=str)[:300]}")  # fmt: skip
    n = sum(r.get("ok") is not None for r in rows)
    log(f"total {time.time() - t0:.0f} s; " + (f"FAIL: {bad} of {n} rows" if bad else
                                              f"PASS: 0 failing of {n} rows"))  # fmt: skip
    return 1 if bad or not n else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
