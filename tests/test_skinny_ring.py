"""The skinny GEMM's cp.async-ring weight stream (``GemmPlan.load == "ring"``).

CPU (CI): the ring plans of the attention projections compile for sm_90a (KDA in_proj with the
residual + RMSNorm prologue, o_proj with the residual epilogue, MLA qkv_a + g_proj as two
segments, q_b with its strided input and norm; M = 1, 2, 8; kimi-k3 TP8 and TP16), the PTX
carries the expected cp.async counts, the ring schedule never reads a slot before its copy or
overwrites it before it is read, and the ``DECODESCOPE_SKINNY_LOAD`` knob / plan validation.
GPU (``pytest -m gpu``, H200): ring vs regs vs the torch reference, fresh random inputs,
NaN-poisoned outputs, M = 1 and 8.
"""

from __future__ import annotations

import dataclasses
import glob
import tempfile

import pytest
import torch

from decodescope.kernels.config import get_config
from decodescope.kernels.specialized import norm_qkv_proj as nqp
from decodescope.kernels.specialized import oproj_residual_norm as orn
from decodescope.kernels.specialized import skinny_gemm as sg


def _plans(tp: int, m: int, load: str) -> dict[str, sg.GemmPlan]:
    """The four attention projections served by the skinny kernel at small M."""
    cfg = get_config("kimi-k3", tp)
    return {
        "kda_in_proj": sg.GemmPlan(m=m, k=cfg.hidden, segments=(cfg.kda_in_proj_out,),
                                   norm=True, add_residual=True, eps=cfg.eps, load=load),
        "kda_o_proj": sg.GemmPlan(m=m, k=cfg.kda_dim, segments=(cfg.hidden,),
                                  residual_epilogue=True, load=load),
        "mla_qkv_a_g": sg.GemmPlan(m=m, k=cfg.hidden, segments=(cfg.mla_qkv_a_out, cfg.mla_v_dim),
                                   norm=True, add_residual=True, eps=cfg.eps, load=load),
        "mla_q_b": sg.GemmPlan(m=m, k=cfg.mla.q_lora_rank, segments=(cfg.mla_q_b_out,),
                               norm=True, x_stride=cfg.mla_qkv_a_out, eps=cfg.eps, load=load),
    }  # fmt: skip


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_ring_plans_compile(tp, m):
    for name, plan in _plans(tp, m, "ring").items():
        assert plan.load == "ring", name
        assert plan.ring_bytes == plan.ks * plan.ring_stages * 2 * plan.rt * 512, name
        assert sg.compile_plan(plan) is not None, name


def _ptx(plan: sg.GemmPlan) -> str:
    import cutlass.cute as cute

    d = tempfile.mkdtemp()
    cute.compile(sg.SkinnyGemm(plan), *sg._fake_args(plan),
                 options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")  # fmt: skip
    (path,) = glob.glob(f"{d}/**/*.ptx", recursive=True)
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize("shape,unroll", [("kda_o_proj", 32), ("kda_in_proj", 32),
                                          ("kda_in_proj", 0)])  # fmt: skip
def test_ring_ptx_counts(shape, unroll):
    """o_proj TP8 (6 chunks per warp, all unrolled): 4 chunks filled + 2 refills, 2 pieces
    each; in_proj (28 chunks) all unrolled, or (``ring_unroll=0``) 6 runtime rounds of 4 and
    one unrolled round: the fill, the traced round's refills and the tail's. The fill precedes
    griddepcontrol.wait; regs mode has no cp.async."""
    plan = dataclasses.replace(_plans(8, 1, "ring")[shape], ring_unroll=unroll)
    assert plan.ring_rounds == (6 if unroll == 0 else 0)
    ptx = _ptx(plan)
    fills = 2 * plan.ring_stages
    ns = plan.ring_stages
    refills = 2 * ((ns if plan.ring_rounds else 0) + sum(sum(r) for _, _, r in plan.ring_tail))
    assert ptx.count("cp.async.cg.shared.global") == fills + refills
    waits = (ns if plan.ring_rounds else 0) + sum(n for _, n, _ in plan.ring_tail)
    assert ptx.count("cp.async.wait_group") == waits
    assert ptx.index("cp.async.cg") < ptx.index("griddepcontrol.wait")
    assert "cp.async" not in _ptx(_plans(8, 1, "regs")[shape])


def _schedule(plan: sg.GemmPlan) -> list[tuple[str, int, int]]:
    """The kernel's ring events in order, from the plan (mirrors ``ring_fill`` /
    ``ring_mainloop``): ("issue" | "wait" | "read", chunk, slot); "commit" closes a group."""
    ns = plan.ring_stages
    ev: list = []
    for v in range(ns):
        ev += [("issue", v, v), ("commit", -1, -1)]
    rounds = [(it * ns, ns, [True] * ns) for it in range(plan.ring_rounds)]
    for v0, n, refill in rounds + plan.ring_tail:
        for s in range(n):
            ev += [("wait", ns - 1, -1), ("read", v0 + s, s)]
            if refill[s]:
                ev.append(("issue", v0 + s + ns, s))
            ev.append(("commit", -1, -1))
    return ev


@pytest.mark.parametrize("k", [32 * 8 * c for c in (1, 2, 3, 4, 5, 6, 7, 16, 17, 20, 28, 29, 64)])
@pytest.mark.parametrize("stages", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("unroll", [0, 32])
def test_ring_schedule(k, stages, unroll):
    """Every chunk issued once and read once, in order; a read's group has landed under
    ``wait_group(stages - 1)``; a slot is refilled only after its chunk was read (runtime
    rounds + unrolled tail, or all unrolled)."""
    plan = sg.GemmPlan(m=1, k=k, segments=(16,), load="ring", stages=stages, ring_unroll=unroll)
    groups: list[list[int]] = [[]]  # chunks per committed group
    slot_of: dict[int, int] = {}  # slot -> chunk in it (unread)
    landed: set[int] = set()
    read: list[int] = []
    for kind, a, b in _schedule(plan):
        if kind == "issue":
            assert b not in slot_of, f"slot {b} refilled before chunk {slot_of.get(b)} was read"
            slot_of[b] = a
            groups[-1].append(a)
        elif kind == "commit":
            groups.append([])
        elif kind == "wait":  # all but the newest a committed groups complete
            done = groups[: max(len(groups) - 1 - a, 0)]
            landed.update(v for grp in done for v in grp)
        else:
            assert a in landed, f"chunk {a} read before its copies landed"
            assert slot_of.pop(b) == a
            read.append(a)
    assert read == list(range(plan.chunks_per_warp))
    assert not slot_of


def test_load_knob(monkeypatch):
    cfg = get_config("kimi-k3", 8)
    monkeypatch.setenv("DECODESCOPE_ATTN_GEMM", "default")  # the skinny / split-K choice
    monkeypatch.setenv("DECODESCOPE_SPLITK_GEMM", "0")
    monkeypatch.delenv(sg.LOAD_ENV, raising=False)
    assert sg.GemmPlan(m=1, k=256, segments=(16,)).load == "regs"  # the default (GPU decides)
    assert nqp.plan_for(cfg, "kda", 1).load == "regs"
    monkeypatch.setenv(sg.LOAD_ENV, "ring")
    for p in (nqp.plan_for(cfg, "kda", 1), nqp.plan_for(cfg, "mla", 2), orn.q_b_plan(cfg, 8),
              sg.GemmPlan(m=16, k=256, segments=(16,))):  # fmt: skip
        assert isinstance(p, sg.GemmPlan) and p.load == "ring"
    assert sg.GemmPlan(m=32, k=256, segments=(16,)).load == "regs"  # M > 16: not the knob's
    assert sg.GemmPlan(m=1, k=256, segments=(16,), load="regs").load == "regs"  # explicit wins
    ring = sg.GemmPlan(m=1, k=256, segments=(16,))
    monkeypatch.setenv(sg.LOAD_ENV, "regs")
    assert ring != sg.GemmPlan(m=1, k=256, segments=(16,))  # the mode is in the compile key
    monkeypatch.setenv(sg.LOAD_ENV, "")
    assert sg.GemmPlan(m=1, k=256, segments=(16,)).load == "regs"
    monkeypatch.setenv(sg.LOAD_ENV, "auto")  # the ring for >= 16 chunks per warp only
    assert nqp.plan_for(cfg, "kda", 1).load == "ring"  # 28 chunks per warp
    assert nqp.plan_for(cfg, "mla", 2).load == "ring"
    assert orn.q_b_plan(cfg, 1).load == "regs"  # 6
    assert sg.GemmPlan(m=1, k=cfg.kda_dim, segments=(cfg.hidden,)).load == "regs"  # o_proj: 6
    monkeypatch.setenv(sg.LOAD_ENV, "smem")
    with pytest.raises(ValueError, match="DECODESCOPE_SKINNY_LOAD='smem'"):
        sg.GemmPlan(m=1, k=256, segments=(16,))
    with pytest.raises(ValueError, match="DECODESCOPE_SKINNY_LOAD"):
        nqp.plan_for(cfg, "kda", 1)


def test_plan_validation():
    with pytest.raises(ValueError, match="GemmPlan.load='tma'"):
        sg.GemmPlan(m=1, k=256, segments=(16,), load="tma")
    with pytest.raises(ValueError, match="GemmPlan.stages=0"):
        sg.GemmPlan(m=1, k=256, segments=(16,), load="ring", stages=0)
    p = sg.GemmPlan(m=1, k=256, segments=(16,), load="ring", stages=8)  # 1 chunk per warp
    assert (p.ks, p.chunks_per_warp, p.ring_stages, p.ring_rounds) == (8, 1, 1, 0)
    assert sg.GemmPlan(m=1, k=256, segments=(16,), load="regs").ring_bytes == 0


def test_ring_rounds_compile():
    """The runtime-round form (``ring_unroll=0``) of the long-K shapes, and 8 stages."""
    for m in (1, 8):
        for name in ("kda_in_proj", "mla_qkv_a_g"):
            p = _plans(8, m, "ring")[name]
            assert sg.compile_plan(dataclasses.replace(p, ring_unroll=0)) is not None
        p = dataclasses.replace(_plans(8, m, "ring")["kda_in_proj"], stages=8)
        assert p.ring_bytes == 8 * 8 * 2 * 512 and sg.compile_plan(p) is not None


def test_ring_dense_situ_compiles():
    """The dense MLP's gate/up launch (SiTU epilogue, two row tiles per CTA: 4 pieces per
    chunk) in ring mode."""
    p = sg.GemmPlan(m=2, k=512, segments=(128,), norm=True, situ=True, load="ring")
    assert p.rt == 2 and p.ring_bytes == p.ks * p.ring_stages * 4 * 512
    assert sg.compile_plan(p) is not None


# -- GPU: ring vs regs vs torch -------------------------------------------------------------


def _inputs(name: str, plan: sg.GemmPlan, gen: torch.Generator):
    dev = torch.device("cuda")
    bf = torch.bfloat16
    M, K = plan.m, plan.k

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(bf).to(dev)

    ws = [rnd(n, K, std=K**-0.5) for n in plan.segments]
    kw: dict = {}
    x = rnd(M, plan.ldx)[:, :K]
    if plan.norm:
        kw["norm_weight"] = (1 + 0.1 * torch.randn(K, generator=gen)).to(bf).to(dev)
    if plan.add_residual:
        kw["residual"] = rnd(M, K)
    if plan.residual_epilogue:
        kw["epilogue_residual"] = rnd(M, plan.segments[0])
    return x, ws, kw


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("name", ["kda_in_proj", "kda_o_proj", "mla_qkv_a_g", "mla_q_b"])
def test_ring_matches_regs_and_torch(monkeypatch, name, m):
    from decodescope.kernels.reference import rel_l2

    plan = _plans(8, m, "ring")[name]
    x, ws, kw = _inputs(name, plan, torch.Generator().manual_seed(1000 * m + len(name)))
    ref, rref = sg.skinny_gemm_ref(x, ws, eps=plan.eps, **kw)
    got = {}
    for load in ("regs", "ring"):
        monkeypatch.setenv(sg.LOAD_ENV, load)
        outs = [torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=x.device)
                for n in plan.segments]  # fmt: skip
        rout = None
        if "residual" in kw:
            rout = torch.full_like(kw["residual"], float("nan"))
        sg.skinny_gemm(x, ws, outs, residual_out=rout, eps=plan.eps, **kw)
        torch.cuda.synchronize()
        for o, r in zip(outs, ref, strict=True):
            assert not o.isnan().any(), f"{name} {load}: NaN left in the output"
            assert rel_l2(o, r) < 1e-2, f"{name} {load}: rel_l2 {rel_l2(o, r):.3g}"
        if rout is not None:
            assert torch.equal(rout, rref), f"{name} {load}: residual_out"
        got[load] = outs
    for a, b in zip(got["regs"], got["ring"], strict=True):  # same MMAs in the same order
        assert torch.equal(a, b), f"{name}: ring differs from regs"
