"""Snapshot the PTX of every specialized CuTe DSL kernel, for refactors that must not change code.

Compiles each kernel for sm_90a on the CPU (``CUTE_DSL_ARCH=sm_90a``, no GPU) at a fixed set of
kimi-k3 TP8 / TP16 shapes, normalises the PTX (comments, debug sections and ``.loc`` / ``.file``
lines dropped, mangled function symbols renamed to ``F0``, ``F1``, ... in order of appearance)
and writes ``<case>.ptx`` plus ``hashes.json`` (case -> sha256) to ``--out``.

    python scripts/ptx_snapshot.py --out /tmp/ptx_before            # all cases
    python scripts/ptx_snapshot.py --out /tmp/ptx_after -k mma -j 2  # cases whose name has "mma"
    python scripts/ptx_snapshot.py --diff /tmp/ptx_before /tmp/ptx_after

``--diff`` compares two snapshots' hashes (cases present in both) and exits 1 on any difference.

The kernels compile outside a decode step, so the sigmoid's default (``DECODESCOPE_FAST_SIGMOID``
unset: ``auto``) gives them the division, as a one-token step compiles them; run a second
snapshot with ``DECODESCOPE_FAST_SIGMOID=rn`` for the PTX a step of 2 tokens or more compiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _cases() -> dict:
    """name -> thunk that compiles one kernel through ``interface.compile_only``."""
    from decodescope.kernels.config import get_config
    from decodescope.kernels.specialized import back_mma as bm
    from decodescope.kernels.specialized import dense_mlp as dm
    from decodescope.kernels.specialized import front_mma as fm
    from decodescope.kernels.specialized import gemv_stream as gs
    from decodescope.kernels.specialized import kda_decode as kda
    from decodescope.kernels.specialized import mla_decode as mla
    from decodescope.kernels.specialized import mla_decode_split as msp
    from decodescope.kernels.specialized import mla_decode_tc as mtc
    from decodescope.kernels.specialized import moe_allreduce as ma
    from decodescope.kernels.specialized import moe_experts as me
    from decodescope.kernels.specialized import moe_grouped as mg
    from decodescope.kernels.specialized import norm_qkv_proj as nqp
    from decodescope.kernels.specialized import oproj_allreduce as oa
    from decodescope.kernels.specialized import oproj_residual_norm as orn
    from decodescope.kernels.specialized import rmsnorm as rms
    from decodescope.kernels.specialized import router_topk as rt
    from decodescope.kernels.specialized import skinny_gemm as sg
    from decodescope.kernels.specialized import splitk_gemm as sk
    from decodescope.kernels.specialized import tile_gemm as tg
    from decodescope.kernels.specialized import up_proj_shared_add as up

    cases: dict = {}
    for tp in (8, 16):
        cfg = get_config("kimi-k3", tp)
        e = cfg.moe
        E, K, H, L = e.num_experts, e.top_k, cfg.hidden, cfg.expert_dim
        Ie, S = cfg.expert_inter, cfg.shared_inter
        NF = E + L + 2 * S
        p = f"tp{tp}"
        # attention-side GEMMs: skinny below 8 tokens, split-K from 8
        for m in (1, 8):
            pl = nqp.plan_for(cfg, "kda", m)
            if isinstance(pl, tg.TilePlan):  # from 8 tokens: the tile GEMM (its norm launch apart)
                cases[f"{p}_nqp_kda_m{m}"] = (
                    "build", lambda pl=pl: (tg.TileGemm(pl), tg._fake_args(pl)))  # fmt: skip
            else:
                cases[f"{p}_nqp_kda_m{m}"] = (sk.compile_any, pl)
            cases[f"{p}_oproj_kda_m{m}"] = (tg.compile_any, orn.plan_for(cfg, "kda", m))
        cases[f"{p}_nqp_mla_m1"] = (sk.compile_any, nqp.plan_for(cfg, "mla", 1))
        cases[f"{p}_qb_m1"] = (sk.compile_any, orn.q_b_plan(cfg, 1))
        mm = 32 if tp == 8 else 16  # split-K: both MLA segments, the strided q_b input
        cases[f"{p}_splitk_mla_m{mm}"] = (
            sk.compile_plan,
            sk.SplitKPlan(m=mm, k=cfg.hidden, segments=(cfg.mla_qkv_a_out, cfg.mla_v_dim),
                          norm=True, add_residual=True),
        )  # fmt: skip
        if cfg.mla.q_lora_rank % sk.KGRAIN == 0:
            cases[f"{p}_splitk_qb_m{mm}"] = (
                sk.compile_plan,
                sk.SplitKPlan(m=mm, k=cfg.mla.q_lora_rank, segments=(cfg.mla_q_b_out,),
                              norm=True, x_stride=cfg.mla_qkv_a_out),
            )  # fmt: skip
        cases[f"{p}_splitk_partial_m8"] = (
            sk.compile_plan,
            sk.SplitKPlan(m=8, k=cfg.hidden, segments=(cfg.kda_in_proj_out,), norm=True,
                          add_residual=True, reduce="partial"),
        )  # fmt: skip
        cases[f"{p}_dense_up_m1"] = (sg.compile_plan, dm.gate_up_plan(cfg, 1))
        cases[f"{p}_dense_down_m4"] = (sg.compile_plan, dm.down_plan(cfg, 4))  # skinny below 8
        cases[f"{p}_rmsnorm_m1"] = (rms.compile_plan, rms.NormPlan(1, H, cfg.eps))
        cases[f"{p}_kda_b1"] = (kda.compile_plan, kda.plan_for(cfg, 1, 1))
        cases[f"{p}_kda_b64"] = (kda.compile_plan, kda.plan_for(cfg, 64, 1))  # one CTA per item
        cases[f"{p}_kda_b8t8"] = (kda.compile_plan, kda.plan_for(cfg, 8, 8))
        for B, T in ((64, 1), (64, 8)):  # the batched chain, one CTA per item and streamed
            one = dataclasses.replace(kda.plan_for(cfg, B, T), vsplit=1, chain="batched")
            cases[f"{p}_kda_batched_b{B}t{T}"] = (kda.compile_plan, one)
            cases[f"{p}_kda_stream_b{B}t{T}"] = (
                kda.compile_plan,
                dataclasses.replace(one, stream=2, stream_cpsm=1),
            )
        cases[f"{p}_mla_b1"] = (mla.compile_plan, mla.plan_for(cfg, 1, 1))
        cases[f"{p}_mlatc_b1t8"] = (mtc.compile_plan, mtc.plan_for(cfg, 1, 8))
        # MoE (the thunks bind this TP's dims through d, not the loop variables)
        d = (E, K, H, L, Ie, S, NF, cfg)
        cases[f"{p}_router_t1"] = ("build", lambda d=d: rt._build(1, d[2], d[6], d[3], d[0]))
        cases[f"{p}_router_norm_t1"] = (
            "build",
            lambda d=d: rt._build(1, d[2], d[6], d[3], d[0], True, True, d[7].eps, True),
        )
        cases[f"{p}_front_mma_t8"] = (
            "build",
            lambda d=d: fm._build(8, d[2], d[6], 8 * d[3], d[0]),
        )
        cases[f"{p}_back_mma_t8"] = ("build", lambda d=d: bm._build(8, d[3], d[2], d[7].eps))
        cases[f"{p}_up_proj_t1"] = ("build", lambda d=d: up._build(1, d[3], d[2], d[7].eps))
        for T, split in ((8, False), (64, True)):  # the grouped MoE's route kernel
            cases[f"{p}_route_{'split' if split else 'one'}_t{T}"] = (
                "build",
                lambda T=T, split=split, d=d: mg._build_route(
                    T, d[0], d[1], d[3], d[5], 1.0, d[7].model.situ_beta,
                    d[7].model.situ_linear_beta, True, split,
                ),
            )  # fmt: skip
        for T, var in ((1, "pipe"), (64, "pipe"), (1, "old")):
            cases[f"{p}_experts_{var}_t{T}"] = (
                "build",
                lambda T=T, var=var, d=d: me._build(
                    T, d[0], d[1], d[3], d[4], d[2], d[5], 1.0,
                    d[7].model.situ_beta, d[7].model.situ_linear_beta,
                    132, True, var, 0,
                ),
            )  # fmt: skip
        for m in (1, 8, 64):
            cases[f"{p}_oproj_ar_m{m}"] = (oa.compile_plan, oa.plan_for(cfg, "kda", m))
    cfg = get_config("kimi-k3", 8)
    for T in (1, 64):
        cases[f"moe_ar_t{T}"] = (
            ma.compile_plan,
            ma.MoeARPlan(T, cfg.expert_dim, cfg.hidden, cfg.eps, prefetch=True),
        )
    # the LL MoE back end without the local flag hop (DECODESCOPE_TP2_MOE_LL=direct, opt-in)
    for T in (1, 8):
        cases[f"moe_ar_direct_t{T}"] = (
            ma.compile_plan,
            ma.MoeARPlan(T, cfg.expert_dim, cfg.hidden, cfg.eps, prefetch=True, ll="direct"),
        )
    # the flag protocol (the cases above take the default, LL)
    cases["tp8_oproj_ar_flag_m8"] = (oa.compile_plan, oa.plan_for(cfg, "kda", 8, proto="flag"))
    cases["moe_ar_flag_t1"] = (
        ma.compile_plan,
        ma.MoeARPlan(1, cfg.expert_dim, cfg.hidden, cfg.eps, prefetch=True, proto="flag"),
    )
    # the split MLA decode, more MLADecodeTC plans (ldsm off, 8 sequences), the streaming GEMV
    # and the skinny GEMM each forced (norm + residual prologue, residual epilogue)
    for b in (1, 8, 32):
        cases[f"tp8_mlasplit_b{b}t1"] = (msp.compile_plan, msp.plan_for(cfg, b, 1))
    cases["tp16_mlasplit_b8t1"] = (msp.compile_plan, msp.plan_for(get_config("kimi-k3", 16), 8, 1))
    cases["tp8_mlatc_b8t1"] = (mtc.compile_plan, mtc.plan_for(cfg, 8, 1))
    cases["tp8_mlatc_b8t8"] = (mtc.compile_plan, mtc.plan_for(cfg, 8, 8))  # 64 rows: clustered
    cases["tp8_mlatc_b1t8_noldsm"] = (
        mtc.compile_plan,
        dataclasses.replace(mtc.plan_for(cfg, 1, 8), ldsm=False),
    )
    H, A = cfg.hidden, cfg.mla_qkv_a_out
    for kind, gemv in (("gemv", True), ("skinny", False)):
        cases[f"tp8_{kind}_normres_m1"] = (
            sg.compile_plan,
            sg.GemmPlan(m=1, k=H, segments=(A, cfg.mla_v_dim), norm=True, add_residual=True,
                        gemv=gemv),
        )  # fmt: skip
        cases[f"tp8_{kind}_epi_m2"] = (
            sg.compile_plan,
            sg.GemmPlan(m=2, k=cfg.expert_dim, segments=(H,), residual_epilogue=True, gemv=gemv),
        )
    cases["tp8_gemv_direct_m4"] = (
        gs.compile_plan,
        gs.from_gemm_plan(sg.GemmPlan(m=4, k=H, segments=(A,), norm=True, gemv=True)),
    )
    # the dense MLP's one-token GEMMs on the GEMV (s29: SiTU epilogue, K with a tail) and the
    # LatentMoE back on it (opt-in, DECODESCOPE_MOE_BACK=gemv)
    for tp in (8, 16):
        c = get_config("kimi-k3", tp)
        gu = dataclasses.replace(dm.gate_up_plan(c, 1), gemv=True)
        cases[f"tp{tp}_gemv_dense_up_m1"] = (gs.compile_plan, gs.from_gemm_plan(gu))
        dn = dataclasses.replace(dm.down_plan(c, 1), gemv=True)
        cases[f"tp{tp}_gemv_dense_down_m1"] = (gs.compile_plan, gs.from_gemm_plan(dn))
    cases["gemv_back_t1"] = (gs.compile_back_plan, gs.back_plan(1, cfg.expert_dim, H, cfg.eps))
    # o_proj + residual + RMSNorm in one launch (opt-in, DECODESCOPE_OPROJ_NORM=1)
    op1 = gs.from_gemm_plan(sg.GemmPlan(m=1, k=cfg.kda_dim, segments=(H,),
                                        residual_epilogue=True, gemv=True))  # fmt: skip
    cases["tp8_gemv_norm_out_m1"] = (gs.compile_norm_plan, gs.norm_plan(op1))
    # the grouped MoE's w2 launch: GroupedW2 (regs) and GroupedW2Tile (its environment knobs)
    for T, w2 in ((8, "regs"), (8, mg.W2_TILE), (64, mg.W2_TILE)):
        cases[f"tp8_w2_{w2}_t{T}"] = (
            "build",
            lambda T=T, w2=w2, c=cfg: mg._build_w2(
                T, c.moe.num_experts, c.moe.top_k, c.expert_dim, c.expert_inter, c.hidden,
                c.shared_inter, True, mode=w2,
            ),
        )  # fmt: skip
    # the experts at one token: W2T1 (the default) and its persistent variant (opt-in)
    from decodescope.kernels.specialized import experts_t1 as et1
    from decodescope.kernels.specialized import w2_t1_persist as w2p

    dims = (1, cfg.moe.num_experts, cfg.moe.top_k, cfg.expert_dim, cfg.expert_inter, cfg.hidden,
            cfg.shared_inter)  # fmt: skip
    cases["tp8_w2t1_t1"] = ("build", lambda d=dims: et1.build_w2(*d))
    cases["tp8_w2t1_persist_t1"] = ("build", lambda d=dims: w2p.build(*d))
    for tp in (8, 16):  # W13T1 as experts_t1.w13_plan picks it, and the one-warp route
        c = get_config("kimi-k3", tp)
        d = (1, c.moe.num_experts, c.moe.top_k, c.expert_dim, c.expert_inter, c.hidden,
             c.shared_inter)  # fmt: skip

        def w13(d=d):
            t1cfg, kw = et1.w13_plan(1, d[1:], 132, True)
            return et1.build_w13(*d, 4.0, 25.0, True, 132, t1cfg, True, kw)

        cases[f"tp{tp}_w13t1_t1"] = ("build", w13)

        def w13_route(d=d):
            t1cfg, kw = et1.w13_plan(1, d[1:], 132, True, route=True)
            return et1.build_w13_route(*d, 4.0, 25.0, True, 132, t1cfg, kw)

        cases[f"tp{tp}_w13t1route_t1"] = ("build", w13_route)

        def w13_ks(d=d):
            t1cfg, kw = et1.w13_plan(1, d[1:], 132, True, ks=2)
            return et1.build_w13_ks(*d, 4.0, 25.0, True, 132, t1cfg, True, kw, False, 2)

        cases[f"tp{tp}_w13t1ks2_t1"] = ("build", w13_ks)
        cases[f"tp{tp}_routet1_t1"] = (
            "build",
            lambda d=d, c=c: et1.build_route(d[1], d[2], d[3], d[1] + d[3] + 2 * d[6], 1.0),
        )
    for tp in (8, 16):  # the one-token front as it runs (ring), and its early-route form
        c = get_config("kimi-k3", tp)
        E, NF = c.moe.num_experts, c.moe.num_experts + c.expert_dim + 2 * c.shared_inter
        cases[f"tp{tp}_front_mma_ring_t1"] = (
            "build",
            lambda c=c, E=E, NF=NF: fm._build(1, c.hidden, NF, c.expert_dim, E, True, "ring"),
        )
        cases[f"tp{tp}_front_mma_early4_t1"] = (
            "build",
            lambda c=c, E=E, NF=NF: fm._build(
                1, c.hidden, NF, c.expert_dim, E, True, "ring", early=(4, E)
            ),
        )
        cases[f"tp{tp}_routet1early4_t1"] = (
            "build",
            lambda c=c, E=E, NF=NF: et1.build_route_early(
                E, c.moe.top_k, c.expert_dim, NF, 1.0, True, 4
            ),
        )
    cases["tp16_front_mma_t64"] = (
        "build",
        lambda c=get_config("kimi-k3", 16): fm._build(
            64, c.hidden, c.moe.num_experts + c.expert_dim + 2 * c.shared_inter,
            64 * c.expert_dim, c.moe.num_experts,
        ),
    )  # fmt: skip
    return cases


_SYM = re.compile(r"^\s*(?:\.(?:visible|extern|weak)\s+)*\.(?:entry|func)\s+(?:\([^)]*\)\s*)?(\w+)")


def normalise(ptx: str) -> str:
    out: list[str] = []
    skip_debug = False
    for line in ptx.splitlines():
        s = line.strip()
        if skip_debug:
            if s == "}":
                skip_debug = False
            continue
        if s.startswith(".section") and ".debug" in s:
            skip_debug = True
            continue
        if not s or s.startswith("//") or s.startswith(".loc") or s.startswith(".file"):
            continue
        line = re.sub(r"\s*//.*$", "", line)
        out.append(line.rstrip())
    names: list[str] = []
    for line in out:
        m = _SYM.match(line)
        if m and m.group(1) not in names:
            names.append(m.group(1))
    text = "\n".join(out) + "\n"
    for n in sorted(names, key=len, reverse=True):
        text = text.replace(n, f"F{names.index(n)}")  # also renames n_param_0 etc.
    return text


def _run_case(name: str, out: str) -> tuple[str, str, float]:
    import cutlass.cute as cute

    from decodescope.kernels.specialized import interface as itf

    fn, arg = _cases()[name]
    with tempfile.TemporaryDirectory() as d:

        def compile_only(op, *args):
            return cute.compile(op, *args, options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")

        itf.compile_only = compile_only
        itf._CACHE.clear()
        t0 = time.time()
        if fn == "build":
            op, args = arg()
            compile_only(op, *args)
        else:
            fn(arg)
        dt = time.time() - t0
        files = sorted(Path(d).glob("*.ptx"))
        if len(files) != 1:
            raise RuntimeError(f"{name}: expected one PTX file in the dump dir, got {len(files)}")
        text = normalise(files[0].read_text())
    (Path(out) / f"{name}.ptx").write_text(text)
    return name, hashlib.sha256(text.encode()).hexdigest(), dt


def diff(a: Path, b: Path) -> int:
    ha = json.loads((a / "hashes.json").read_text())
    hb = json.loads((b / "hashes.json").read_text())
    common = sorted(set(ha) & set(hb))
    bad = [n for n in common if ha[n] != hb[n]]
    for n in common:
        print(f"{'SAME' if n not in bad else 'DIFF'}  {n}")
    only = sorted(set(ha) ^ set(hb))
    if only:
        print("in one snapshot only: " + ", ".join(only))
    print(f"{len(common) - len(bad)}/{len(common)} identical")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("-k", default="", help="only cases whose name contains one of these (comma)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--diff", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    a = ap.parse_args()
    if a.diff:
        return diff(*a.diff)
    names = list(_cases())
    if a.k:
        keys = a.k.split(",")
        names = [n for n in names if any(k in n for k in keys)]
    if a.list:
        print("\n".join(names))
        return 0
    if a.out is None:
        ap.error("--out is required")
    a.out.mkdir(parents=True, exist_ok=True)
    hpath = a.out / "hashes.json"
    hashes = json.loads(hpath.read_text()) if hpath.exists() else {}
    t0 = time.time()
    with ProcessPoolExecutor(a.jobs) as ex:
        futs = {ex.submit(_run_case, n, str(a.out)): n for n in names}
        for f in as_completed(futs):
            n = futs[f]
            try:
                _, h, dt = f.result()
            except Exception as e:  # noqa: BLE001 - report the case and go on
                print(f"FAIL {n}: {type(e).__name__}: {e}", flush=True)
                continue
            hashes[n] = h
            hpath.write_text(json.dumps(dict(sorted(hashes.items())), indent=1) + "\n")
            print(f"{h[:12]}  {dt:6.1f}s  {n}", flush=True)
    print(f"{len(names)} cases in {time.time() - t0:.0f}s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
