"""One GPU call for the standard decode layers: correctness, kernels per layer, graph timing.

For Kimi K3 at the TP8 and TP16 per-rank shapes and batch 1, 8, 32, 64 (one KDA + one gated-MLA
layer, each with LatentMoE), this script:

1. checks each layer's eager output and state against the reference in float32 (rel L2 error),
   with poisoned outputs;
2. captures each layer into its own CUDA graph and the 2-layer step into one, and checks the
   step graph's replay against the eager step from the same state;
3. counts the kernels of one layer (torch.profiler over one replay of the layer's graph; graph
   kernel nodes too where cuda-bindings can read them) and lists their names;
4. times each layer's graph: median / min / max of >= 20 replays, rotating among 4 input sets and
   evicting L2 between replays, against the bytes floor (layer_bytes from the real routing over
   the measured copy bandwidth);
5. says how many layers of each shape fit on one GPU.

Every case runs in its own try block: one failure is recorded and the rest go on. Prints a
compact table last; writes ``standard.json`` (and a log) to ``--out``.

    source .gpu/run/install.sh && python scripts/gpu_standard.py --out $OUT/standard
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch


def log(*a) -> None:
    print(*a, flush=True)


def copy_bandwidth_tbs(dev) -> float:
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    a.fill_(1)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * n / statistics.median(ts) / 1e12


def graph_kernel_nodes(g: torch.cuda.CUDAGraph) -> int | None:
    """Kernel nodes of a captured graph (cuda-bindings), or None where that cannot be read."""
    try:
        from cuda.bindings import runtime as cudart

        raw = g.raw_cuda_graph()
        try:
            err, _, n = cudart.cudaGraphGetNodes(raw, 0)
        except TypeError:  # wants the handle type, not an int
            raw = cudart.cudaGraph_t(init_value=int(raw))
            err, _, n = cudart.cudaGraphGetNodes(raw, 0)
        err, nodes, n = cudart.cudaGraphGetNodes(raw, n)
        kinds = [cudart.cudaGraphNodeGetType(nd)[1] for nd in nodes]
        return sum(k == cudart.cudaGraphNodeType.cudaGraphNodeTypeKernel for k in kinds)
    except Exception:
        return None


def profile_kernels(fn) -> list[str] | None:
    """Kernel names of one call of ``fn`` (torch.profiler), or None where profiling fails."""
    try:
        return _profile_kernels(fn)
    except Exception as e:
        log(f"  profiler failed: {type(e).__name__}: {e}")
        return None


def _profile_kernels(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            n = e.name
            if n.startswith(("Memcpy", "Memset", "[memory]")):
                continue
            names.append(n)
    return names


MOE_SWEEP = [
    {"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3},
    {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 4},
    {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 2, "num_stages": 5},
]


def moe_sweep(layer, reps: int = 20) -> list[dict]:
    """Time the two fused-MoE GEMMs of ``layer`` (its last routing) under block configs."""
    from decodescope.kernels.standard import triton_kernels as tk

    w = layer.w
    k = layer.cfg.moe.top_k
    z = layer.z if layer.z is not None else layer.h
    tw = layer.topk_weights
    res = []
    for conf in MOE_SWEEP:
        try:

            def run(conf=conf):
                tk.fused_moe(z, w["w13"], layer.w13_out, tw, layer.sorted_ids, layer.expert_ids,
                             layer.ntp, layer.numel, k, False, layer.m_blocks, conf)  # fmt: skip
                tk.fused_moe(layer.act_out, w["w2"], layer.w2_out, tw, layer.sorted_ids,
                             layer.expert_ids, layer.ntp, layer.numel, 1, True, layer.m_blocks,
                             conf)  # fmt: skip

            run()
            torch.cuda.synchronize()
            ts = []
            for _ in range(reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                run()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3)
            res.append({**conf, "median_us": statistics.median(ts)})
        except Exception as e:
            res.append({**conf, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    return res


def run_case(tp: int, batch: int, T: int, out: dict, weights_cache: dict, args) -> list[dict]:
    from decodescope.kernels import bytes as kbytes
    from decodescope.kernels import reference as R
    from decodescope.kernels.config import get_config
    from decodescope.kernels.standard.model import StandardModel, parse_layers

    dev = torch.device("cuda")
    cfg = get_config("kimi-k3", tp, expert_dtype=args.expert_dtype)
    specs = parse_layers(cfg, "kda,mla")
    key = (tp,)
    if key not in weights_cache:
        weights_cache.clear()
        torch.cuda.empty_cache()
        from decodescope.kernels.weights import make_layer_weights

        weights_cache[key] = [make_layer_weights(cfg, s, args.seed, dev) for s in specs]
    t0 = time.time()
    m = StandardModel(cfg, specs, batch, T, seed=args.seed + batch, device=dev,
                      weights=weights_cache[key])  # fmt: skip
    build_s = time.time() - t0
    rows = []
    # -- 1. eager correctness per layer (float32 reference), poisoned outputs --------------------
    before = [{k: v.clone() for k, v in s.items()} for s in m.states]
    for t in (*m.xs, *m.rs):
        t.fill_(float("nan"))
    for layer in m.layers:
        layer.poison()
    t0 = time.time()
    m.step()
    torch.cuda.synchronize()
    first_step_s = time.time() - t0
    errs = {}
    x, r = m.x_in, m.r_in
    for i, spec in enumerate(specs):
        layer = m.layers[i]
        xr, rr, ns, _ = R.layer_ref(cfg, spec, m.weights[i], before[i], x, r, T,
                                    topk_ids=layer.topk_ids, dtype=torch.float32)  # fmt: skip
        e = {"x": R.rel_l2(m.xs[i % 2], xr), "r": R.rel_l2(m.rs[i % 2], rr)}
        for k, v in ns.items():
            got = m.states[i][k]
            if k == "kv_cache":
                got, v = got[:, cfg.context_len :], v[:, cfg.context_len :]
            e[k] = R.rel_l2(got, v)
        errs[spec.kind] = e
        x, r = m.xs[i % 2], m.rs[i % 2]  # the next layer's input: this layer's output
        del xr, rr, ns
    torch.cuda.empty_cache()
    # -- 2. graphs: per layer and the whole step; step graph replay == eager ---------------------
    bufs_in = [(m.x_in, m.r_in), (m.xs[0], m.rs[0])]
    bufs_out = [(m.xs[0], m.rs[0]), (m.xs[1], m.rs[1])]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            m.step()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    layer_graphs = []
    for i, layer in enumerate(m.layers):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            layer.forward(*bufs_in[i], *bufs_out[i])
        layer_graphs.append(g)
    step_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(step_graph):
        m.step()
    torch.cuda.synchronize()
    saved = [{k: v.clone() for k, v in st.items()} for st in m.states]
    m.step()
    torch.cuda.synchronize()
    eager_out = m.x_out.clone()
    for st, sv in zip(m.states, saved, strict=True):
        for k in st:
            st[k].copy_(sv[k])
    step_graph.replay()
    torch.cuda.synchronize()
    graph_vs_eager = R.rel_l2(m.x_out, eager_out)
    graph_equal = bool(torch.equal(m.x_out, eager_out))
    # -- 3. kernels per layer -------------------------------------------------------------------
    kernels = {}
    for i, spec in enumerate(specs):
        names = profile_kernels(layer_graphs[i].replay)
        kernels[spec.kind] = {"count": None if names is None else len(names), "names": names,
                              "graph_kernel_nodes": graph_kernel_nodes(layer_graphs[i])}  # fmt: skip
    # -- 4. timing: rotate inputs, evict L2, median of replays ----------------------------------
    sets = [(torch.randn_like(m.x_in), torch.randn_like(m.r_in)) for _ in range(4)]
    flush = torch.empty(args.flush_mb << 20, dtype=torch.uint8, device=dev)
    sel = m.selected_experts()
    for i, spec in enumerate(specs):
        xin, rin = bufs_in[i]
        ts = []
        for j in range(args.warmup + args.replays):
            a, b = sets[j % len(sets)]
            xin.copy_(a)
            rin.copy_(b)
            flush.fill_(j & 0xFF)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            layer_graphs[i].replay()
            e1.record()
            e1.synchronize()
            if j >= args.warmup:
                ts.append(e0.elapsed_time(e1) * 1e3)
        ids = m.layers[i].topk_ids
        nbytes = kbytes.layer_bytes(cfg, spec.kind, batch, T, ids)
        floor = kbytes.floor_us(nbytes, args.copy_bw)
        med = statistics.median(ts)
        rows.append(
            {
                "tp": tp, "batch": batch, "tokens_per_seq": T, "kind": spec.kind,
                "kernels": kernels[spec.kind]["count"],
                "graph_kernel_nodes": kernels[spec.kind]["graph_kernel_nodes"],
                "median_us": med, "min_us": min(ts), "max_us": max(ts), "replays": len(ts),
                "layer_bytes": nbytes,
                "distinct_experts": kbytes.distinct_experts(ids) if ids is not None else None,
                "floor_us": floor, "floor_over_span": floor / med,
                "rel_err": errs[spec.kind], "graph_vs_eager": graph_vs_eager,
                "graph_bitwise_equal_eager": graph_equal,
                "kernel_names": kernels[spec.kind]["names"],
                "layer_memory_bytes": kbytes.layer_memory(cfg, spec.kind, batch, T),
            }
        )  # fmt: skip
    # whole step (2 layers) replay time, same rotation
    ts = []
    for j in range(args.warmup + args.replays):
        a, b = sets[j % len(sets)]
        m.x_in.copy_(a)
        m.r_in.copy_(b)
        flush.fill_(j & 0xFF)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        step_graph.replay()
        e1.record()
        e1.synchronize()
        if j >= args.warmup:
            ts.append(e0.elapsed_time(e1) * 1e3)
    sweep = {}
    if args.moe_sweep and m.ops.impl.get("moe.routed_experts", "").startswith("triton"):
        try:
            sweep = {"kda": moe_sweep(m.layers[0])}
            best = min((c for c in sweep["kda"] if "median_us" in c), key=lambda c: c["median_us"])
            log(f"  moe sweep tp{tp} b{batch}: best {best}; default (64,128) "
                f"{sweep['kda'][1].get('median_us')}")  # fmt: skip
        except Exception as e:
            sweep = {"error": repr(e)}
    out.setdefault("steps", []).append(
        {"tp": tp, "batch": batch, "tokens_per_seq": T, "step_median_us": statistics.median(ts),
         "build_s": build_s, "first_step_s": first_step_s,
         "op_impl": dict(m.ops.impl), "op_rejected": dict(m.ops.rejected),
         "moe_sweep": sweep,
         "distinct_experts": {k: int(torch.unique(v).numel()) for k, v in sel.items()}}
    )  # fmt: skip
    del layer_graphs, step_graph, m, flush, sets
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out") + "/standard")
    p.add_argument("--tp", default="8,16")
    p.add_argument("--batch", default="1,8,32,64")
    p.add_argument("--tokens-per-seq", type=int, default=1)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--flush-mb", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-moe-sweep", dest="moe_sweep", action="store_false")
    p.add_argument("--expert-dtype", default="bf16", choices=["bf16", "mxfp4"])
    args = p.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to do")
        return 2
    from decodescope.kernels import bytes as kbytes
    from decodescope.kernels import vllm_ops
    from decodescope.kernels.config import get_config

    dev = torch.device("cuda")
    out: dict = {
        "gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
        "vllm_ops": vllm_ops.load(), "vllm_ops_errors": vllm_ops.errors(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "rows": [], "errors": [],
    }  # fmt: skip
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception as e:
        out["triton"] = f"missing: {e}"
    args.copy_bw = copy_bandwidth_tbs(dev)
    out["copy_bw_tbs"] = args.copy_bw
    log(f"gpu {out['gpu']}  copy {args.copy_bw:.2f} TB/s  vllm ops: {out['vllm_ops']}")
    weights_cache: dict = {}
    for tp in [int(x) for x in args.tp.split(",")]:
        for batch in [int(x) for x in args.batch.split(",")]:
            t0 = time.time()
            try:
                rows = run_case(tp, batch, args.tokens_per_seq, out, weights_cache, args)
                out["rows"].extend(rows)
                for r in rows:
                    log(f"tp{tp} b{batch} {r['kind']}: {r['kernels']} kernels "
                        f"({r['graph_kernel_nodes']} graph kernel nodes), "
                        f"{r['median_us']:.1f} us (floor {r['floor_us']:.1f}), "
                        f"err x {r['rel_err']['x']:.2e} ({time.time() - t0:.0f} s)")  # fmt: skip
            except Exception as e:
                tb = traceback.format_exc()
                log(f"tp{tp} b{batch}: FAILED {type(e).__name__}: {e}\n{tb}")
                out["errors"].append({"tp": tp, "batch": batch, "error": repr(e), "trace": tb})
                torch.cuda.empty_cache()
            (out_dir / "standard.json").write_text(json.dumps(out, indent=1, default=str))
    weights_cache.clear()
    torch.cuda.empty_cache()
    # -- how many layers fit: all experts + state + cache per layer, over the free memory ---------
    free, total = torch.cuda.mem_get_info(dev)
    fits = {}
    for tp in [int(x) for x in args.tp.split(",")]:
        cfg = get_config("kimi-k3", tp, expert_dtype=args.expert_dtype)
        for kind in ("kda", "mla"):
            per = kbytes.layer_memory(cfg, kind, 64, args.tokens_per_seq)
            fits[f"tp{tp}.{kind}"] = {"layer_bytes_resident": per, "fit": int(free // per)}
    out["fits_per_gpu"] = {"free_bytes": free, "total_bytes": total, **fits}
    (out_dir / "standard.json").write_text(json.dumps(out, indent=1, default=str))
    # -- the table -------------------------------------------------------------------------------
    log("")
    log(f"{'tp':>3} {'b':>3} {'kind':<5} {'kern':>4} {'nodes':>5} {'med us':>8} {'min':>7} "
        f"{'max':>7} {'floor':>7} {'fl/sp':>5} {'experts':>7} {'err x':>8} {'err st':>8}")  # fmt: skip
    for r in out["rows"]:
        st = max((v for k, v in r["rel_err"].items() if k not in ("x", "r")), default=0.0)
        log(f"{r['tp']:>3} {r['batch']:>3} {r['kind']:<5} {str(r['kernels']):>4} "
            f"{str(r['graph_kernel_nodes']):>5} {r['median_us']:>8.1f} {r['min_us']:>7.1f} "
            f"{r['max_us']:>7.1f} {r['floor_us']:>7.1f} {r['floor_over_span']:>5.2f} "
            f"{str(r['distinct_experts']):>7} {r['rel_err']['x']:>8.1e} {st:>8.1e}")  # fmt: skip
    for s in out.get("steps", []):
        log(f"step tp{s['tp']} b{s['batch']}: {s['step_median_us']:.1f} us (2 layers)")
    if out.get("steps"):
        log("op_impl: " + json.dumps(out["steps"][-1]["op_impl"]))
        log("rejected: " + json.dumps(out["steps"][-1]["op_rejected"])[:1500])
    log("fits per GPU: " + json.dumps({k: v for k, v in out["fits_per_gpu"].items()}))
    log(f"errors: {len(out['errors'])}" + "".join(
        f"\n  tp{e['tp']} b{e['batch']}: {e['error'][:300]}" for e in out["errors"]))  # fmt: skip
    return 0 if not out["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
