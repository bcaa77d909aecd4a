"""Two GPUs (nvidia-h200-x2): the standard decode layers at tp_world 2, checked and timed.

Pieces, each in its own pair of processes (one per GPU, NCCL; a piece that fails or hangs is
stopped and recorded, the next one runs):

1. ``allreduce``: an all-reduce of [batch, 7168] bf16 inside a CUDA graph, batch 1 and 64:
   NCCL (``dist.all_reduce``), the one-shot all-reduce through torch symmetric memory as the
   standard path runs it (``kernels/standard/comm.Comm``: the input already in symmetric memory,
   one kernel) and staged (a copy into symmetric memory first). Correctness against NCCL first,
   then graph-replay medians (20 all-reduces per graph, and 1 per graph).
2. ``tp2_kda`` / ``tp2_mla``: one full-size Kimi K3 layer (KDA or gated MLA, each with LatentMoE)
   at TP1 on GPU 0 (~60 GB of BF16 weights, built on the GPU from the seed), against the same
   layer at TP2 on two GPUs: each rank builds the same TP1 weights on its own GPU (checked by a
   fingerprint across ranks), shards them the way vLLM does (kernels/sharding.py), runs its
   half with the real all-reduces (nccl, then oneshot), eager and as a CUDA-graph replay.
   Outputs poisoned with NaN before each run. Compared: x and r of the layer (rel L2), routing
   agreement, each rank's state against its shard of the TP1 state.
3. ``tp8``: TP8 per-rank shapes on 2 GPUs (the decode step kda + mla): each rank's own weights
   (replicated tensors equal), step with the all-reduces; rank 0 receives rank 1's weights and
   state and computes, on one GPU in float32, the layers with the two ranks' partial results
   summed where the all-reduces sit (kernels/sharding.tp_layer_ref), with the routing the run
   chose.
4. ``bench``: ``decodescope bench --backends standard --tp-world 2 --tp-shape 8 --batch 1,64``
   (captured under CUPTI, one capture child per rank, merged).

Default: ``quick`` (pieces 1 and 3 at batch 1 in one pair of processes) and ``bench`` at batch 1,
about 2-2.5 minutes (budget 170 s); ``--full`` adds the full-size pieces 2 (about 2 min each).
Multicast stays off in every process (set below before torch loads, and by the launcher).
Writes ``results.json`` after every piece and prints a PASS/FAIL table last.

    source .gpu/run/install.sh && python scripts/gpu_tp2.py --out $OUT/tp2          # ~2.5 min
    python scripts/gpu_tp2.py --out $OUT/tp2_full --pieces tp2_kda,tp2_mla --budget 330   # ~5 min
"""

from __future__ import annotations

import os

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

PIECES = ("quick", "allreduce", "tp2_kda", "tp2_mla", "tp8", "bench")
DEFAULT_PIECES = "quick,bench"  # about 2-2.5 min on the H200 pair; --full adds tp2_kda,tp2_mla
CAPS = {"quick": 100, "allreduce": 60, "tp2_kda": 150, "tp2_mla": 150, "tp8": 90, "bench": 90}
TOL_X = 3e-2  # rel L2 of a layer's output, bf16 path vs a reference (measured band: ~1e-2)


def log(*a) -> None:
    print(*a, flush=True)


# =============================================================================================
# worker side (one process per rank)


class Rows:
    """This rank's result rows, written to OUT/rank{r}.json after every row."""

    def __init__(self, out: Path, rank: int) -> None:
        self.path = out / f"rank{rank}.json"
        self.rows: list[dict] = []
        self.rank = rank

    def add(self, **row) -> None:
        row["rank"] = self.rank
        self.rows.append(row)
        log(f"rank {self.rank}: " + json.dumps(row, default=str)[:400])
        self.path.write_text(json.dumps(self.rows, indent=1, default=str))


def graph_us(fn, inner: int, replays: int = 30) -> tuple[float, float, float]:
    """Median/min/max us per call of ``fn``, ``inner`` calls captured in one graph."""
    import torch
    import torch.distributed as dist

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / inner)
    return statistics.median(ts), min(ts), max(ts)


def piece_allreduce(rows: Rows, args) -> None:
    import torch
    import torch.distributed as dist

    from decodescope.kernels.standard.comm import Comm

    dev = torch.device("cuda", torch.cuda.current_device())
    nccl = Comm("nccl", dev)
    try:
        one = Comm("oneshot", dev)
    except Exception as e:  # NCCL still gets measured
        traceback.print_exc()
        rows.add(piece="allreduce", impl="oneshot", check="setup", ok=False, error=_one(e))
        one = None
    for b in (1, 64):
        x = torch.randn(b, 7168, device=dev).to(torch.bfloat16)
        want = x.float()
        dist.all_reduce(want)  # fp32 reference sum
        cases = [("nccl", nccl, torch.empty_like(x))]
        if one is not None:
            try:
                sym = one.buffer(b, 7168)
                cases += [("oneshot", one, sym), ("oneshot_staged", one, torch.empty_like(x))]
            except Exception as e:
                traceback.print_exc()
                rows.add(piece="allreduce", impl="oneshot", batch=b, ok=False, error=_one(e))
        for name, comm, buf in cases:
            try:
                buf.copy_(x)
                got = comm.all_reduce(buf)
                torch.cuda.synchronize()
                err = float((got.float() - want).norm() / want.norm())

                def call(comm=comm, buf=buf):
                    comm.all_reduce(buf)

                # values grow (sums of sums) in the timed graph: harmless for timing, and the
                # input is reset first
                m20 = graph_us(call, 20)
                buf.copy_(x)
                m1 = graph_us(call, 1)
                rows.add(
                    piece="allreduce", impl=name, batch=b, rel_err=err, ok=err < 1e-2,
                    graph20_us=m20[0], graph20_min_us=m20[1], graph20_max_us=m20[2],
                    graph1_us=m1[0], graph1_min_us=m1[1], graph1_max_us=m1[2],
                )  # fmt: skip
            except Exception as e:
                rows.add(piece="allreduce", impl=name, batch=b, ok=False, error=_one(e))
                traceback.print_exc()


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _dev():
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")  # --preset tiny on a CPU (gloo): a dry run of the checks


def _one(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:400]


def fingerprint(w: dict) -> list[float]:
    return [float(w[k].reshape(-1)[: 1 << 20].float().sum()) for k in sorted(w)]


def _rel(a, b) -> float:
    from decodescope.kernels.reference import rel_l2

    return rel_l2(a.float(), b.float())


def run_with_graph(model):
    """Eager step from the current state, then the same step as a CUDA-graph replay from the
    same state. Returns (eager outputs, graph outputs): (x, r, states)."""
    import torch

    def snap():
        return (
            model.x_out.clone(),
            model.r_out.clone(),
            [{k: v.clone() for k, v in st.items()} for st in model.states],
        )

    def restore(saved):
        for st, sv in zip(model.states, saved, strict=True):
            for k, v in sv.items():
                st[k].copy_(v)

    start = [{k: v.clone() for k, v in st.items()} for st in model.states]
    model.poison()
    model.step()
    sync()
    eager = snap()
    if model.device.type != "cuda":  # CPU dry run: no graphs
        restore(start)
        return eager, eager
    # graph: warm-up on a side stream (changes state), restore, capture, restore, replay
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model.step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    restore(start)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        model.step()
    torch.cuda.synchronize()
    restore(start)
    model.poison()
    g.replay()
    torch.cuda.synchronize()
    graph = snap()
    restore(start)
    del g
    return eager, graph


def piece_tp2(rows: Rows, args, kind: str) -> None:
    import torch
    import torch.distributed as dist

    from decodescope.kernels import sharding
    from decodescope.kernels.config import get_config
    from decodescope.kernels.standard.comm import Comm
    from decodescope.kernels.standard.model import StandardModel, parse_layers
    from decodescope.kernels.weights import make_layer_weights

    rank = dist.get_rank()
    dev = _dev()
    full, cfg = get_config(args.preset, 1), get_config(args.preset, 2)
    spec = parse_layers(full, kind)[0]
    seed = args.seed
    batches = [int(b) for b in args.batch.split(",")]
    t0 = time.time()
    w_full = make_layer_weights(full, spec, seed, dev)
    gb = sum(t.numel() * t.element_size() for t in w_full.values()) / 1e9
    fps = [None, None]
    dist.all_gather_object(fps, fingerprint(w_full))
    same = fps[0] == fps[1]
    rows.add(piece=f"tp2_{kind}", check="same TP1 weights on both GPUs", ok=same,
             weights_gb=gb, build_s=time.time() - t0)  # fmt: skip
    if not same:
        raise RuntimeError("the two GPUs built different TP1 weights from one seed")
    # -- TP1 on GPU 0 ----------------------------------------------------------------------
    ref: dict[int, tuple] = {}
    if rank == 0:
        for b in batches:
            t1 = time.time()
            m1 = StandardModel(full, [spec], b, 1, seed=seed, device=dev, weights=[w_full])
            m1.poison()
            m1.step()
            sync()
            ref[b] = (
                m1.x_out.clone(),
                m1.r_out.clone(),
                {k: v.clone() for k, v in m1.states[0].items()},
                m1.selected_experts()[spec.index].clone(),
            )
            log(f"rank 0: TP1 {kind} batch {b} ran ({time.time() - t1:.0f} s)")
            del m1
            gc.collect()
            torch.cuda.empty_cache()
    dist.barrier()
    # -- shard, free the whole layer ----------------------------------------------------------
    w_rank = sharding.shard_layer_weights(full, cfg, spec, w_full, rank)
    del w_full
    gc.collect()
    torch.cuda.empty_cache()
    for b in batches:
        # TP1 results to every rank
        n = b * 1
        x1 = (
            ref[b][0]
            if rank == 0
            else torch.empty(n, full.hidden, dtype=torch.bfloat16, device=dev)
        )
        r1 = ref[b][1] if rank == 0 else torch.empty_like(x1)
        ids1 = (
            ref[b][3]
            if rank == 0
            else torch.empty(n, full.moe.top_k, dtype=torch.int32, device=dev)
        )
        dist.broadcast(x1, 0)
        dist.broadcast(r1, 0)
        ids1 = ids1.to(torch.int32).contiguous()
        dist.broadcast(ids1, 0)
        st_full = {}
        for k in ("kda_state", "conv_state", "kv_cache"):
            have = rank == 0 and k in ref[b][2]
            flag = torch.tensor([1 if have else 0], device=dev)
            dist.broadcast(flag, 0)
            if not int(flag.item()):
                continue
            meta = (
                [list(ref[b][2][k].shape), str(ref[b][2][k].dtype)] if rank == 0 else [None, None]
            )
            dist.broadcast_object_list(meta, 0)
            t = (
                ref[b][2][k]
                if rank == 0
                else torch.empty(meta[0], dtype=getattr(torch, meta[1].split(".")[1]), device=dev)
            )
            dist.broadcast(t, 0)
            st_full[k] = t
        want_state = sharding.shard_state(full, cfg, spec, st_full, rank)
        for impl in args.allreduce.split(","):
            t1 = time.time()
            try:
                comm = Comm(impl, dev)
                m2 = StandardModel(cfg, [spec], b, 1, seed=seed, device=dev, weights=[w_rank],
                                   tp_world=2, comm=comm)  # fmt: skip
                sharding.shard_model_state_(m2, rank, 2)
                eager, graph = run_with_graph(m2)
                ids2 = m2.selected_experts()[spec.index]
                agree = float(
                    (torch.sort(ids2.long(), 1).values == torch.sort(ids1.long(), 1).values)
                    .all(1).float().mean()
                )  # fmt: skip
                same_rows = (
                    torch.sort(ids2.long(), 1).values == torch.sort(ids1.long(), 1).values
                ).all(1)
                ex = _rel(eager[0][same_rows], x1[same_rows]) if same_rows.any() else float("inf")
                er = _rel(eager[1], r1)
                es = {
                    k: _rel(eager[2][0][k].float().nan_to_num(), v.float().nan_to_num())
                    for k, v in want_state.items()
                }
                eg = max(_rel(graph[0], eager[0]), _rel(graph[1], eager[1]))
                ok = agree >= 0.9 and ex < TOL_X and er < TOL_X and max(es.values()) < TOL_X
                ok = ok and eg < 1e-3
                rows.add(
                    piece=f"tp2_{kind}", check=f"TP2 vs TP1 batch {b} ({impl})", batch=b,
                    allreduce=impl, rel_err_x=ex, rel_err_r=er, rel_err_state=es,
                    routing_agree=agree, graph_vs_eager=eg, ok=ok, s=time.time() - t1,
                    op_impl={k: v for k, v in m2.ops.impl.items() if "allreduce" in k},
                )  # fmt: skip
                del m2, comm
            except Exception as e:
                traceback.print_exc()
                rows.add(piece=f"tp2_{kind}", check=f"TP2 vs TP1 batch {b} ({impl})",
                         batch=b, allreduce=impl, ok=False, error=_one(e))  # fmt: skip
            torch.cuda.empty_cache()
            dist.barrier()


def piece_tp8(rows: Rows, args) -> None:
    import torch
    import torch.distributed as dist

    from decodescope.kernels import sharding
    from decodescope.kernels.config import get_config
    from decodescope.kernels.standard.comm import Comm
    from decodescope.kernels.standard.model import StandardModel, parse_layers

    rank = dist.get_rank()
    dev = _dev()
    cfg = get_config(args.preset, args.tp_shape)
    specs = parse_layers(cfg, "kda,mla")
    seed = args.seed
    ws = [sharding.rank_layer_weights(cfg, sp, seed, rank, dev) for sp in specs]
    for b in [int(x) for x in args.batch.split(",")]:
        for impl in args.allreduce.split(","):
            t1 = time.time()
            try:
                comm = Comm(impl, dev)
                m = StandardModel(cfg, specs, b, 1, seed=seed, device=dev, weights=ws,
                                  tp_world=2, comm=comm)  # fmt: skip
                start = [{k: v.clone() for k, v in st.items()} for st in m.states]
                eager, graph = run_with_graph(m)
                ids = m.selected_experts()
                x_in, r_in = m.x_in.clone(), m.r_in.clone()

                # rank 1's weights and starting state to rank 0
                def to_rank0(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
                    got = {}
                    for name in sorted(tensors):
                        t = tensors[name]
                        if rank == 1:
                            dist.send(t.contiguous(), 0)
                        else:
                            got[name] = torch.empty_like(t)
                            dist.recv(got[name], 1)
                    return got

                other_w = [to_rank0(ws[li]) for li in range(len(specs))]
                other_st = [to_rank0(start[li]) for li in range(len(specs))]
                if rank == 0:
                    x, r = x_in, r_in
                    for li, sp in enumerate(specs):
                        x, r, _, _ = sharding.tp_layer_ref(
                            cfg,
                            sp,
                            [ws[li], other_w[li]],
                            [start[li], other_st[li]],
                            x,
                            r,
                            1,
                            topk_ids=ids.get(sp.index),
                            dtype=torch.float32,
                        )
                    ex, er = _rel(eager[0], x), _rel(eager[1], r)
                    eg = max(_rel(graph[0], eager[0]), _rel(graph[1], eager[1]))
                    rows.add(
                        piece="tp8", check=f"TP8 shapes x2 GPUs vs sum of partials, batch {b} ({impl})",
                        batch=b, allreduce=impl, rel_err_x=ex, rel_err_r=er, graph_vs_eager=eg,
                        ok=ex < TOL_X and er < TOL_X and eg < 1e-3, s=time.time() - t1,
                    )  # fmt: skip
                del other_w, other_st, m, comm
            except Exception as e:
                traceback.print_exc()
                rows.add(piece="tp8", check=f"TP8 shapes batch {b} ({impl})", batch=b,
                         allreduce=impl, ok=False, error=_one(e))  # fmt: skip
            torch.cuda.empty_cache()
            dist.barrier()


def worker(piece: str, out: Path, args) -> int:

    from decodescope.kernels.standard.comm import init_from_env

    rank, dev = init_from_env(2)
    rows = Rows(out, rank)
    try:
        if piece == "quick":  # one pair of processes for both (each process start costs ~15 s)
            try:
                piece_allreduce(rows, args)
            finally:
                piece_tp8(rows, args)
        elif piece == "allreduce":
            piece_allreduce(rows, args)
        elif piece in ("tp2_kda", "tp2_mla"):
            piece_tp2(rows, args, piece.split("_")[1])
        elif piece == "tp8":
            piece_tp8(rows, args)
        else:
            raise ValueError(f"unknown piece {piece!r}")
    except Exception as e:
        traceback.print_exc()
        rows.add(piece=piece, check="(piece)", ok=False, error=_one(e))
        return 1
    finally:
        sync()  # the worker leaves with os._exit (no teardown that could wait on the peer)
    return 0


# =============================================================================================
# parent


def run_piece(piece: str, out: Path, args, limit: float) -> list[dict]:
    from decodescope.tracer.distributed import collect_rank_rows, free_port, launch, rank_env

    d = out / piece
    d.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, __file__, "--worker", piece, "--out", str(d), "--batch", args.batch,
            "--allreduce", args.allreduce, "--seed", str(args.seed), "--preset", args.preset,
            "--tp-shape", str(args.tp_shape)]  # fmt: skip
    if piece.startswith("tp2"):
        argv[argv.index("--batch") + 1] = args.tp2_batch
    envs = [{**rank_env(r, 2, port), "DECODESCOPE_DIST_TIMEOUT": "600"} for r in range(2)]
    res = launch([argv, argv], envs, timeout=limit, logs=[d / "rank0.log", d / "rank1.log"])
    rows = collect_rank_rows(res, d, piece=piece)
    return rows


def run_bench(out: Path, args, limit: float) -> list[dict]:
    d = out / "bench"
    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "decodescope.ui.cli", "bench", "--backends", "standard",
           "--tp-world", "2", "--tp-shape", "8", "--batch", args.bench_batch,
           "--replays", "20", "--warmup", "3", "--runs-dir", str(d / "runs"),
           "--out", str(d / "dataset"), "--json", str(d / "bench.json"),
           "--timeout", str(max(60, int(limit) - 20))]  # fmt: skip
    log("bench: " + " ".join(cmd))
    t = time.time()
    try:
        with open(d / "bench.log", "wb") as f:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=limit)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        rc = None
    text = (d / "bench.log").read_text(errors="replace")
    log(text[-6000:])
    rows = []
    data = json.loads((d / "bench.json").read_text()) if (d / "bench.json").exists() else {}
    for r in data.get("layers", []):
        rows.append({"piece": "bench", "check": f"{r['backend']} {r['layer_kind']} b{r['batch']}",
                     "ok": True, **{k: r.get(k) for k in ("span_us", "kernels", "skew_us",
                                                         "floor_us", "efficiency")}})  # fmt: skip
    for f in data.get("failures", []):
        rows.append({"piece": "bench", "check": "run", "ok": False, "error": f[:300]})
    if rc != 0:
        rows.append({"piece": "bench", "check": "command", "ok": False,
                     "error": f"exit {rc} after {time.time() - t:.0f} s"})  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out") + "/tp2")
    p.add_argument("--pieces", default=DEFAULT_PIECES, help=f"any of {', '.join(PIECES)}")
    p.add_argument("--full", action="store_true", help="add the full-size tp2_kda, tp2_mla")
    p.add_argument("--batch", default="1", help="batches of the tp8 check (e.g. 1,64)")
    p.add_argument("--tp2-batch", default="1", help="batches of the tp2_* pieces (e.g. 1,8)")
    p.add_argument("--bench-batch", default="1")
    p.add_argument("--allreduce", default="nccl,oneshot")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="kimi-k3", help="tiny: a CPU dry run of the checks")
    p.add_argument("--tp-shape", type=int, default=8, help="per-rank shapes of the tp8 piece")
    p.add_argument("--budget", type=float, default=170.0, help="seconds for everything")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args.worker, out, args)
    t0 = time.time()
    results: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": []}
    pieces = [x for x in args.pieces.split(",") if x]
    if args.full:
        pieces += [x for x in ("tp2_kda", "tp2_mla") if x not in pieces]
    for piece in pieces:
        left = args.budget - (time.time() - t0)
        cap = min(CAPS.get(piece, 120), left)
        if cap < 30:
            results["rows"].append({"piece": piece, "check": "(skipped)", "ok": None,
                                    "error": f"budget: {left:.0f} s left"})  # fmt: skip
            continue
        log(f"== {piece} (limit {cap:.0f} s, {left:.0f} s left)")
        t1 = time.time()
        try:
            rows = (
                run_bench(out, args, cap) if piece == "bench" else run_piece(piece, out, args, cap)
            )
        except Exception as e:
            traceback.print_exc()
            rows = [{"piece": piece, "check": "(piece)", "ok": False, "error": _one(e)}]
        for r in rows:
            r.setdefault("piece_s", round(time.time() - t1, 1))
        results["rows"].extend(rows)
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    results["total_s"] = time.time() - t0
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    # -- the table ------------------------------------------------------------------------------
    log("")
    log(f"{'piece':<10} {'rank':>4} {'result':<6} check / figures")
    bad = 0
    for r in results["rows"]:
        if r.get("piece") != "bench" and r.get("rank") not in (0, None) and r.get("ok"):
            continue  # rank 1's passing rows repeat rank 0's
        res = {True: "PASS", False: "FAIL", None: "SKIP"}[r.get("ok")]
        bad += r.get("ok") is False
        figs = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items()
                if k not in ("piece", "check", "ok", "rank", "piece_s")}  # fmt: skip
        log(f"{r.get('piece', ''):<10} {str(r.get('rank', '')):>4} {res:<6} {r.get('check', '')}"
            f"  {json.dumps(figs, default=str)[:300]}")  # fmt: skip
    log(f"total {time.time() - t0:.0f} s; {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
