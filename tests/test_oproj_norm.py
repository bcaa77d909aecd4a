"""o_proj + residual add + the MoE block's input RMSNorm in one launch
(:class:`.gemv_stream.GemvStreamNorm`, ``DECODESCOPE_OPROJ_NORM=1``, issue #5), and the o_proj
GEMV prefetching the MoE front's weight into L2 (:class:`.gemv_stream.GemvStreamPre`,
``DECODESCOPE_OPROJ_PREFETCH``).

CPU (CI): the kernel compiles for sm_90a at kimi-k3 TP8 / TP16 with the o_proj GEMV's tuned
knobs (1 token) and at 2 / 4 tokens; its PTX adds to the plain o_proj GEMV one counter atomic,
the fence and the last CTA's L2 loads of the whole row (and of the norm weight), with the same
weight loads before ``griddepcontrol.wait``; ptxas registers no more than the plain GEMV's;
the plan rules; the knob's parsing and the layer's wiring (op names, launches: KDA 3 and MLA 4
attention launches at one token, the dense layer and ``front_norm`` unchanged, tp_world 2
never fused).
GPU (``pytest -m gpu``, H200): against the torch reference of o_proj + residual and
:func:`.rmsnorm.rmsnorm_ref` on fresh random inputs with NaN-poisoned outputs, the output
aliasing the residual as the layers run it, repeated launches (the counter back at 0 after
each), inside a CUDA graph replayed several times.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import shutil
import subprocess
import tempfile

import pytest
import torch

from decodescope.kernels.config import get_config
from decodescope.kernels.specialized import gemv_stream as gs
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import oproj_residual_norm as orn

ENV = orn.OPROJ_NORM_ENV


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for v in (ENV, orn.OPROJ_PREFETCH_ENV, "DECODESCOPE_GEMV_CFG", "DECODESCOPE_SKINNY_GEMV",
              "DECODESCOPE_FRONT_NORM", orn.OPROJ_PREFETCH_EVICT_ENV):  # fmt: skip
        monkeypatch.delenv(v, raising=False)


def _plans(tp: int, m: int = 1):
    base = gs.GemvPlan(
        m=m, k=get_config("kimi-k3", tp).kda_dim, segments=(7168,), residual_epilogue=True,
        warps=4, rows=4, group=2, depth=2,
    )  # fmt: skip
    return base, gs.norm_plan(base)


@pytest.mark.parametrize("tp", [8, 16])
def test_knob_gives_plan(tp, monkeypatch):
    cfg = get_config("kimi-k3", tp)
    assert orn.norm_fused_plan(cfg, "kda", 1) is None  # off by default
    monkeypatch.setenv(ENV, "1")
    for kind in ("kda", "mla"):
        p = orn.norm_fused_plan(cfg, kind, 1)
        assert p is not None and p.norm_out and p.residual_epilogue
        assert p == gs.norm_plan(gs.from_gemm_plan(orn.plan_for(cfg, kind, 1)))
        assert orn.norm_fused_plan(cfg, kind, 8) is None  # o_proj not on gemv_stream there
    monkeypatch.setenv(ENV, "2")
    with pytest.raises(ValueError, match="DECODESCOPE_OPROJ_NORM='2': expected one of"):
        orn.norm_fused_plan(cfg, "kda", 1)


def test_plan_rules():
    base, q = _plans(8)
    assert q is not None and q.grid == base.grid == 448
    for bad in (dict(residual_epilogue=False), dict(segments=(7168, 512))):
        assert gs.norm_plan(dataclasses.replace(base, **bad)) is None
    with pytest.raises(ValueError, match="norm_out needs one segment with the residual"):
        dataclasses.replace(base, residual_epilogue=False, norm_out=True)
    with pytest.raises(ValueError, match="needs a norm_out plan"):
        gs.compile_norm_plan(base)


@pytest.mark.parametrize("tp,m", [(8, 1), (16, 1), (8, 2), (8, 4)])
def test_compiles(tp, m):
    _, q = _plans(tp, m)
    assert gs.compile_norm_plan(q) is not None


def _regs(ptx: str) -> int | None:
    if not shutil.which("ptxas"):
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    r = subprocess.run(["ptxas", "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr[-300:]
    assert "0 bytes spill stores" in r.stderr
    return int(re.search(r"Used (\d+) registers", r.stderr).group(1))


def test_ptx():
    base, q = _plans(8)
    ptx0 = itf.ptx_text(gs.GemvStream(base), *gs._fake_args(base))
    ptx1 = itf.ptx_text(gs.GemvStreamNorm(q), *gs._fake_norm_args(q))
    v4 = r"ld\.global[.\w:]*\.v4"
    w0 = ptx0.find("griddepcontrol.wait")
    w1 = ptx1.find("griddepcontrol.wait")
    assert len(re.findall(v4, ptx1[:w1])) == len(re.findall(v4, ptx0[:w0])) > 0
    assert ptx0.count("atom.") == 0 and ptx1.count("atom.global.acq_rel.add") == 1
    assert ptx1.count("fence.acq_rel.gpu") == 2
    per = -(-7168 // 8 // q.threads)  # 16-byte pieces of a row per thread in the last CTA
    assert ptx1.count("ld.global.cg.v4.b32") == 2 * per  # h and the norm weight
    r0, r1 = _regs(ptx0), _regs(ptx1)
    if r0 is not None:
        assert r1 <= max(r0, 128), (r0, r1)


def test_layer_wiring(monkeypatch):
    """The step's op names and launch counts with o_proj + norm fused, without a GPU: every
    launch goes through interface.compiled, recorded with its open range. The tiny preset's
    o_proj (K 128) is not a gemv_stream shape, so the plan choice is stood in for (a synthetic
    plan object where ``norm_fused_plan`` would give one: one token per step)."""
    from types import SimpleNamespace

    from decodescope import tracer
    from decodescope.kernels.specialized import attention_layers as al
    from decodescope.kernels.specialized import step as S

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(itf, "compiled", lambda key, build: lambda *a, **k: calls.append(
        (tracer.current_path(), str(key[0]))))  # fmt: skip

    def run(batch, layers, front_norm=0):
        calls.clear()
        p = S.plan(preset="tiny", tp_shape=1, batch=batch, tokens_per_seq=1, layers=layers,
                   seed=0, front_norm=front_norm)  # fmt: skip
        m = S.SpecializedModel(p.cfg, p.specs, batch, 1, seed=0, device="cpu",
                               front_norm=p.front_norm)  # fmt: skip
        with tracer.range("step"):
            m.step()
        want = [f"step/{lay}/{op}" for lay, ops in p.range_names().items() for op in ops]
        # one or more launches per op range (the routed experts: three at one token), in order
        assert [k for k, _ in itertools.groupby(c[0] for c in calls)] == want
        assert len(calls) == sum(p.launches().values())
        assert m.launches() == p.launches()
        return p.launches(), p.range_names()  # now: the plan asks norm_fused_plan each time

    base, _ = run(1, "kda,mla")
    base_dense, _ = run(1, "dense,mla")
    base_fn, _ = run(1, "kda,mla", front_norm=1)
    fake = SimpleNamespace(norm_out=True)
    monkeypatch.setattr(orn, "norm_fused_plan", lambda cfg, kind, m: fake if m == 1 else None)
    launches, names = run(1, "kda,mla")
    assert {k: base[k] - v for k, v in launches.items()} == {"layer.0:kda": 1, "layer.1:mla": 1}
    assert names["layer.0:kda"][2] == "layer.0.attn.o_proj+residual_norm"
    assert names["layer.1:mla"][3] == "layer.1.attn.o_proj+residual_norm"
    fused = [c for c in calls if c[1] == "gemv_stream_norm"]
    assert [c[0].split(".attn.")[-1] for c in fused] == [al.OP_OPROJ_NORM] * 2
    assert al.attn_ops("kda", True) == (*al.KDA_OPS[:2], al.OP_OPROJ_NORM)
    # the dense layer and front_norm keep o_proj alone (their next kernel normalizes)
    assert run(1, "dense,mla")[0]["layer.0:dense"] == base_dense["layer.0:dense"]
    assert run(1, "kda,mla", front_norm=1)[0] == base_fn
    # more tokens than the GEMV serves: unchanged
    _, names2 = run(2, "kda,mla")
    assert all("o_proj+residual_norm" not in n for ns in names2.values() for n in ns)


def test_prefetch_plan(monkeypatch):
    cfg = get_config("kimi-k3", 8)
    wf = torch.empty(6016, 7168, dtype=torch.bfloat16, device="meta")
    assert orn.prefetch_plan(cfg, "kda", 1, wf) is None  # off by default
    monkeypatch.setenv(orn.OPROJ_PREFETCH_ENV, "512")
    p = orn.prefetch_plan(cfg, "kda", 1, wf)
    assert (p.pre_rows, p.pre_k, p.pre_slices, p.pre_bytes) == (6016, 7168, 8, 512)
    assert orn.prefetch_plan(cfg, "kda", 8, wf) is None  # o_proj not on gemv_stream there
    assert orn.prefetch_plan(cfg, "kda", 1, None) is None
    monkeypatch.setenv(orn.OPROJ_PREFETCH_ENV, "500")
    with pytest.raises(ValueError, match="DECODESCOPE_OPROJ_PREFETCH='500': expected one of"):
        orn.prefetch_plan(cfg, "kda", 1, wf)
    base, _ = _plans(8)
    with pytest.raises(ValueError, match="needs 16-byte multiples within a slice"):
        dataclasses.replace(base, pre_rows=16, pre_k=7168, pre_bytes=2048)
    with pytest.raises(ValueError, match="needs a pre_bytes plan"):
        gs.compile_pre_plan(base)


def test_prefetch_ptx():
    """The prefetch goes out before ``griddepcontrol.wait``, after the first weight loads; the
    GEMV itself is unchanged (the same loads before the wait, registers no more than its own)."""
    base, _ = _plans(8)
    q = gs.pre_plan(base, 6016, 7168, 512)
    ptx0 = itf.ptx_text(gs.GemvStream(base), *gs._fake_args(base))
    ptx1 = itf.ptx_text(gs.GemvStreamPre(q), *gs._fake_pre_args(q))
    w0, w1 = ptx0.find("griddepcontrol.wait"), ptx1.find("griddepcontrol.wait")
    v4 = r"ld\.global[.\w:]*\.v4"
    assert len(re.findall(v4, ptx1[:w1])) == len(re.findall(v4, ptx0[:w0])) > 0
    pf = "cp.async.bulk.prefetch.L2"
    assert ptx0.count(pf) == 0 and ptx1[:w1].count(pf) == ptx1.count(pf) == 1
    assert ptx1.find(pf) > re.search(v4, ptx1).start()  # after the first weight loads
    r0, r1 = _regs(ptx0), _regs(ptx1)
    if r0 is not None:
        assert r1 <= max(r0, 128), (r0, r1)
    assert gs.compile_pre_plan(q) is not None


def test_prefetch_evict_last(monkeypatch):
    """``DECODESCOPE_OPROJ_PREFETCH_EVICT=last``: the same prefetches, each with the one
    ``evict_last`` policy created before them, all before the PDL wait; a bad value is a
    one-line error; ``pre_last`` without prefetches is refused."""
    cfg = get_config("kimi-k3", 8)
    wf = torch.empty(6016, 7168, dtype=torch.bfloat16, device="meta")
    monkeypatch.setenv(orn.OPROJ_PREFETCH_ENV, "512")
    assert not orn.prefetch_plan(cfg, "kda", 1, wf).pre_last
    monkeypatch.setenv(orn.OPROJ_PREFETCH_EVICT_ENV, "last")
    q = orn.prefetch_plan(cfg, "kda", 1, wf)
    assert q.pre_last and q.pre_bytes == 512
    ptx = itf.ptx_text(gs.GemvStreamPre(q), *gs._fake_pre_args(q))
    w = ptx.find("griddepcontrol.wait")
    hint = "cp.async.bulk.prefetch.L2.global.L2::cache_hint"
    assert ptx.count("createpolicy.fractional.L2::evict_last.b64") == 1
    assert ptx.count("cp.async.bulk.prefetch.L2") == ptx[:w].count(hint) >= 1
    monkeypatch.setenv(orn.OPROJ_PREFETCH_EVICT_ENV, "first")
    with pytest.raises(ValueError, match="DECODESCOPE_OPROJ_PREFETCH_EVICT='first'"):
        orn.prefetch_plan(cfg, "kda", 1, wf)
    base, _ = _plans(8)
    with pytest.raises(ValueError, match="pre_last needs a pre_bytes plan"):
        dataclasses.replace(base, pre_last=True)


def test_prefetch_wiring(monkeypatch):
    """The step hands each MoE layer's front weight to its attention half; o_proj then runs as
    GemvStreamPre in the same range (launch counts unchanged). The tiny preset's o_proj is not
    a gemv_stream shape: the plan is stood in for (a synthetic object)."""
    from types import SimpleNamespace

    from decodescope import tracer
    from decodescope.kernels.specialized import step as S

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(itf, "compiled", lambda key, build: lambda *a, **k: calls.append(
        (tracer.current_path(), str(key[0]))))  # fmt: skip
    seen = []

    def fake_plan(cfg, kind, m, w_next):
        seen.append(tuple(w_next.shape))
        return SimpleNamespace(pre_bytes=512, pre_last=False)

    monkeypatch.setattr(orn, "prefetch_plan", fake_plan)
    p = S.plan(preset="tiny", tp_shape=1, batch=1, tokens_per_seq=1, layers="dense,kda,mla",
               seed=0, front_norm=0)  # fmt: skip
    m = S.SpecializedModel(p.cfg, p.specs, 1, 1, seed=0, device="cpu", front_norm=False)
    assert len(seen) == 2 and m.attn[0].pre_plan is None  # dense layer 0: no MoE front
    assert all(a.pre_w is moe.w_front for a, moe in zip(m.attn[1:], m.moe[1:], strict=True))
    with tracer.range("step"):
        m.step()
    pre = [c[0] for c in calls if c[1] == "gemv_stream_pre"]
    assert pre == ["step/layer.1:kda/layer.1.attn.o_proj", "step/layer.2:mla/layer.2.attn.o_proj"]
    assert m.launches() == p.launches()


def _inputs(tp: int, m: int, seed: int):
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(seed)
    bf = torch.bfloat16
    K, N = get_config("kimi-k3", tp).kda_dim, 7168

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(bf)

    x, r = rnd(m, K), rnd(m, N)
    w = rnd(N, K, scale=K**-0.5)
    g = (1 + 0.1 * torch.randn(N, device=dev, generator=gen)).to(bf)
    return x, w, r, g


def _ref(x, w, r, g, eps):
    from decodescope.kernels.specialized.rmsnorm import rmsnorm_ref

    out = ((x.float() @ w.float().T).to(torch.bfloat16).float() + r.float()).to(torch.bfloat16)
    return out, rmsnorm_ref(out, g, eps)


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("tp,m", [(8, 1), (16, 1), (8, 2), (8, 4)])
def test_vs_reference_gpu(tp, m):
    """Eager, the output aliasing the residual (as the layers call it), twice in a row (the
    counter back at 0 each time), against the references; h also against rmsnorm_ref of the
    kernel's own residual output (only the sum order of the squares differs)."""
    _, q = _plans(tp, m)
    eps = get_config("kimi-k3", tp).eps
    for seed in (1, 2):
        x, w, r, g = _inputs(tp, m, seed)
        ref_out, ref_h = _ref(x, w, r, g, eps)
        out = r.clone()
        h = torch.full_like(r, float("nan"))
        gs.gemv_norm(q, x, w, out, out, g, h)
        torch.cuda.synchronize()
        assert torch.isfinite(out.float()).all() and torch.isfinite(h.float()).all()
        from decodescope.kernels.specialized.rmsnorm import rmsnorm_ref

        assert _rel(out, ref_out) < 2e-2 and _rel(h, ref_h) < 2e-2
        assert _rel(h, rmsnorm_ref(out, g, eps)) < 4e-3
        assert int(gs.norm_counters(x.device)[gs.C_ARRIVE]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [8, 16])
def test_graph_replays_gpu(tp):
    """Captured once into a CUDA graph (beside the plain o_proj GEMV and the RMSNorm launch of
    the same inputs), replayed with fresh inputs copied in: each replay matches the unfused
    pair."""
    from decodescope.kernels.specialized import rmsnorm as rms

    _, q = _plans(tp, 1)
    base = dataclasses.replace(q, norm_out=False)
    eps = get_config("kimi-k3", tp).eps
    x, w, r, g = _inputs(tp, 1, 7)
    out, h = torch.empty_like(r), torch.empty_like(r)
    out2, h2 = torch.empty_like(r), torch.empty_like(r)

    def both():
        gs.gemv_norm(q, x, w, out, r, g, h)
        gs.launch(base, x, [w], [out2], None, None, None, r)
        rms.rmsnorm(out2, g, h2, eps)

    both()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        both()
    for seed in range(8, 13):
        x2, _, r2, _ = _inputs(tp, 1, seed)
        x.copy_(x2)
        r.copy_(r2)
        h.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, out2)
        assert _rel(h, h2) < 4e-3 and torch.isfinite(h.float()).all()
        assert _rel(h, _ref(x, w, r, g, eps)[1]) < 2e-2
    assert int(gs.norm_counters(x.device)[gs.C_ARRIVE]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [8, 16])
def test_prefetch_gpu(tp):
    """GemvStreamPre's output equals the plain GEMV's bit for bit (the prefetch is a hint)."""
    base, _ = _plans(tp)
    dev = torch.device("cuda")
    wf = torch.randn(6016, 7168, device=dev).to(torch.bfloat16)
    q = gs.pre_plan(base, *wf.shape, 512)
    x, w, r, _ = _inputs(tp, 1, 3)
    out, out2 = torch.full_like(r, float("nan")), torch.full_like(r, float("nan"))
    gs.gemv_pre(q, x, w, out, r, wf)
    gs.launch(base, x, [w], [out2], None, None, None, r)
    torch.cuda.synchronize()
    assert torch.equal(out, out2) and torch.isfinite(out.float()).all()
