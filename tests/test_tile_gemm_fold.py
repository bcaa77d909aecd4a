"""The RMSNorm folded into the tile GEMM (``TilePlan.rms_fold``, ``DECODESCOPE_TILE_NORM=fold``),
and the split-K epilogue knobs (``epi_hoist`` / ``epi_batch``, o_proj at 32-64 tokens).

CPU: sm_90a compiles of MLA's q_b with the folded norm at 8 / 32 / 64 tokens, TP8 and TP16
(strided q_a input, split-K and one split); the plan (workspace rows for the sums of squares,
no norm launch); the selection (default unchanged; with ``fold`` q_b goes to the tile kernel
from 8 tokens and the MLA layer keeps its launch count); the folded math against the reference
with vLLM's rounding; the epilogue knobs (environment, compiles of o_proj). GPU (``-m gpu``):
the kernels against the reference, NaN-poisoned outputs.
"""

from __future__ import annotations

import pytest
import torch

# the package first: it sets CUTE_DSL_ARCH=sm_90a before anything imports cutlass
from decodescope.kernels import specialized  # noqa: F401
from decodescope.kernels.config import get_config  # noqa: E402
from decodescope.kernels.specialized import oproj_residual_norm as op  # noqa: E402
from decodescope.kernels.specialized import tile_gemm as tg  # noqa: E402
from decodescope.kernels.specialized.skinny_gemm import skinny_gemm_ref  # noqa: E402

CFG8 = get_config("kimi-k3", 8)
CFG16 = get_config("kimi-k3", 16)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for v in ("DECODESCOPE_TILE_NORM", "DECODESCOPE_ATTN_GEMM", "DECODESCOPE_TILE_LDSM",
              "DECODESCOPE_TILE_EPI_HOIST", "DECODESCOPE_TILE_EPI_BATCH", tg.CLUSTER_ENV):  # fmt: skip
        monkeypatch.delenv(v, raising=False)


def _qb(cfg, m, **force) -> tg.TilePlan:
    kw = dict(tg.attention_cases(cfg)["q_b"])
    kw["norm"] = False
    return tg.TilePlan(m=m, rms_fold=True, **kw, **force)


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [8, 32, 64])
def test_fold_compiles(tp, m):
    p = _qb(CFG8 if tp == 8 else CFG16, m)
    # the splits of a row tile in one cluster by default (at most 8: TP16's 9 row tiles then
    # make 72 CTAs), else enough CTAs for every SM
    assert p.cluster and 1 < p.splits <= tg.CLUSTER_MAX
    q = _qb(CFG8 if tp == 8 else CFG16, m, cluster=False)
    assert q.splits > 1 and q.row_ctas * q.splits >= tg.NUM_SMS
    assert tg.compile_plan(p) is not None and tg.compile_plan(q) is not None


@pytest.mark.parametrize("force", [dict(splits_force=1), dict(ldsm=True, warps=2)])
def test_fold_variants_compile(force):
    assert tg.compile_plan(_qb(CFG8, 33, **force)) is not None


def test_fold_plan():
    c = _qb(CFG8, 64)  # the default: the splits' sums of squares meet in the cluster
    assert c.cluster and c.splits == 8 and c.ssq_rows == 0 and c.ws_rows == 8
    p = _qb(CFG8, 64, cluster=False)  # the workspace path
    assert (p.row_ctas, p.splits, p.chunks, p.x_slots) == (18, 8, 3, 4)
    # sums of squares [row tiles, splits, mp] after the partials, in whole rows
    assert p.ssq_rows * p.acc_rows >= p.row_ctas * p.splits * p.mp
    assert p.ws_rows == p.splits * p.mp + p.ssq_rows
    assert p.gemm_ldx() == CFG8.mla_qkv_a_out  # x read raw (the q_a slice), no norm buffer
    assert _qb(CFG8, 64, splits_force=1).ws_rows == 8  # one split: the sums stay in smem
    assert tg.TilePlan(m=64, **tg.attention_cases(CFG8)["q_b"]).ssq_rows == 0
    with pytest.raises(ValueError, match="rms_fold"):
        tg.TilePlan(m=8, k=1536, segments=(16,), norm=True, rms_fold=True)


def test_selection(monkeypatch):
    # default (auto): folded from 16 tokens, the skinny kernel below
    assert not isinstance(op.q_b_plan(CFG8, 8), tg.TilePlan)
    for m in (16, 32, 64):
        assert op.q_b_plan(CFG8, m).rms_fold
    monkeypatch.setenv("DECODESCOPE_TILE_NORM", "launch")  # the old default
    assert not isinstance(op.q_b_plan(CFG8, 64), tg.TilePlan)
    monkeypatch.setenv("DECODESCOPE_TILE_NORM", "fold")
    assert not isinstance(op.q_b_plan(CFG8, 1), tg.TilePlan)  # AUTO_MIN_M
    for m in (8, 32, 64):
        p = op.q_b_plan(CFG8, m)
        assert isinstance(p, tg.TilePlan) and p.rms_fold and not p.norm
    # the residual-add norms (in_proj, qkv_a + g) keep their norm launch
    from decodescope.kernels.specialized import norm_qkv_proj as nqp

    p = nqp.plan_for(CFG8, "mla", 64)
    assert p.norm and not p.rms_fold
    monkeypatch.setenv("DECODESCOPE_ATTN_GEMM", "default")
    assert not isinstance(op.q_b_plan(CFG8, 64), tg.TilePlan)
    monkeypatch.setenv("DECODESCOPE_ATTN_GEMM", "auto")
    monkeypatch.setenv("DECODESCOPE_TILE_NORM", "bogus")
    with pytest.raises(ValueError, match="DECODESCOPE_TILE_NORM"):
        op.q_b_plan(CFG8, 64)


def test_launch_count(monkeypatch):
    """With the fold, q_b's tile plan adds no launch: the MLA layer stays at its count."""
    from decodescope.kernels.config import LayerSpec
    from decodescope.kernels.specialized import step

    spec = LayerSpec(index=3, attn="mla", mlp="moe")
    base = {m: step.extra_launches(CFG8, spec, m) for m in (8, 32, 64)}
    monkeypatch.setenv("DECODESCOPE_TILE_NORM", "fold")
    assert {m: step.extra_launches(CFG8, spec, m) for m in (8, 32, 64)} == base


def fold_ref(x, w, g, eps):
    """The folded kernel's math in FP32: ``bf16(rstd * x @ bf16(W * g)^T)``."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return ((xf @ tg.fold_norm_weight(w, g).float().T) * rstd).to(torch.bfloat16)


def test_fold_math_vs_reference():
    """The fold's one rounding against vLLM's ``bf16(bf16(x * rstd) * g)``: within BF16
    tolerances at q_b's shape."""
    gen = torch.Generator().manual_seed(0)
    K, N = 1536, 256
    x = torch.randn(64, K, generator=gen).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=gen) * K**-0.5).to(torch.bfloat16)
    g = (1 + 0.2 * torch.randn(K, generator=gen)).to(torch.bfloat16)
    ref = skinny_gemm_ref(x, [w], norm_weight=g, eps=1e-5)[0][0].float()
    err = (fold_ref(x, w, g, 1e-5).float() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2
    with pytest.raises(ValueError, match="fold_norm_weight"):
        tg.fold_norm_weight(w, g[:-1])


def test_folded_weight_cache():
    w = torch.randn(32, 64).to(torch.bfloat16)
    g = torch.randn(64).to(torch.bfloat16)
    a = tg.folded_weight(w, g)
    assert tg.folded_weight(w, g) is a  # made once per weight
    assert torch.equal(a, tg.fold_norm_weight(w, g))
    g2 = g.clone()
    assert tg.folded_weight(w, g2) is not a  # another norm weight: remade


def _inproj(cfg, name, m, **force) -> tg.TilePlan:
    kw = dict(tg.attention_cases(cfg)[name])
    kw["norm"] = False
    return tg.TilePlan(m=m, rms_fold=True, **kw, **force)


@pytest.mark.parametrize("name,m,force", [("in_proj", 64, {}), ("qkv_a_g", 32, {}),
                                          ("in_proj", 64, {"res_regs": True})])  # fmt: skip
def test_fold_residual_compiles(name, m, force):
    p = _inproj(CFG8, name, m, **force)
    assert p.add_residual and p.smem_bytes <= tg.SMEM_2CTA  # two CTAs per SM
    assert p.stages == (3 if m == 64 and not force else 4)  # res_regs: no residual stages
    assert tg.compile_plan(p) is not None
    with pytest.raises(ValueError, match="res_regs"):
        tg.TilePlan(m=8, k=1024, segments=(16,), res_regs=True)


def test_fold_all_selection_and_launches(monkeypatch):
    from decodescope.kernels.config import LayerSpec
    from decodescope.kernels.specialized import norm_qkv_proj as nqp
    from decodescope.kernels.specialized import step

    specs = [LayerSpec(index=1, attn="kda", mlp="moe"), LayerSpec(index=3, attn="mla", mlp="moe")]
    base = [step.extra_launches(CFG8, sp, 64) for sp in specs]
    monkeypatch.setenv("DECODESCOPE_TILE_NORM", "fold")
    assert not nqp.plan_for(CFG8, "kda", 64).rms_fold  # fold: q_b only
    monkeypatch.setenv("DECODESCOPE_TILE_NORM", "fold_all")
    for kind in ("kda", "mla"):
        p = nqp.plan_for(CFG8, kind, 64)
        assert p.rms_fold and p.add_residual and not p.norm
    # the input projection's norm launch is gone (q_b never had one on the tile kernel)
    assert [step.extra_launches(CFG8, sp, 64) for sp in specs] == [b - 1 for b in base]


def _oproj(m, **force) -> tg.TilePlan:
    return tg.TilePlan(m=m, **tg.attention_cases(CFG8)["o_proj"], **force)


def test_epilogue_knobs(monkeypatch):
    p = _oproj(64)
    assert (p.epi_hoist, p.epi_batch, p.ldsm) == (True, tg.EPI_BATCH, True)  # s10/r2 defaults
    assert not _oproj(16).ldsm and _oproj(32).ldsm  # ldsm from LDSM_EPI_MIN_M tokens
    assert not tg.TilePlan(m=64, **tg.attention_cases(CFG8)["in_proj"]).ldsm  # o_proj only
    monkeypatch.setenv("DECODESCOPE_TILE_EPI_HOIST", "0")
    monkeypatch.setenv("DECODESCOPE_TILE_EPI_BATCH", "8")
    monkeypatch.setenv("DECODESCOPE_TILE_LDSM", "0")
    q = _oproj(64)
    assert (q.epi_hoist, q.epi_batch, q.ldsm) == (False, 8, False) and q != p  # compile key
    monkeypatch.setenv("DECODESCOPE_TILE_LDSM", "1")
    assert _oproj(8).ldsm
    with pytest.raises(ValueError, match="epi_batch"):
        _oproj(64, epi_batch=0)


@pytest.mark.parametrize("m,force", [(64, dict(epi_hoist=True)),
                                     (32, dict(epi_hoist=True, epi_batch=8))])  # fmt: skip
def test_hoist_compiles(m, force):
    assert tg.compile_plan(_oproj(m, **force)) is not None


# -- GPU -----------------------------------------------------------------------------------


def check_fold(cfg, m, dev="cuda", seed=0, **force) -> float:
    """q_b with the folded norm on fresh inputs into NaN-poisoned outputs; max relative error
    vs the reference with vLLM's rounding (``skinny_gemm_ref``)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    K, N, ldx = cfg.mla.q_lora_rank, cfg.mla_q_b_out, cfg.mla_qkv_a_out
    x = torch.randn(m, ldx, generator=gen, device=dev).to(torch.bfloat16)[:, :K]
    w = (torch.randn(N, K, generator=gen, device=dev) * K**-0.5).to(torch.bfloat16)
    g = (1 + 0.2 * torch.randn(K, generator=gen, device=dev)).to(torch.bfloat16)
    out = torch.full((m, N), float("nan"), dtype=torch.bfloat16, device=dev)
    tg.tile_gemm(x, [tg.fold_norm_weight(w, g)], [out], rms_fold=True, eps=cfg.eps, **force)
    torch.cuda.synchronize()
    ref = skinny_gemm_ref(x, [w], norm_weight=g, eps=cfg.eps)[0][0].float()
    if not torch.isfinite(out.float()).all():
        return float("inf")
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [1, 8, 33, 64])
def test_fold_gpu(tp, m):
    assert check_fold(CFG8 if tp == 8 else CFG16, m, seed=m) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "force", [dict(splits=1), dict(splits=2), dict(warps=2), dict(warps=8, stages=3),
              dict(ldsm=True)],
)  # fmt: skip
def test_fold_gpu_variants(force):
    assert check_fold(CFG8, 64, seed=1, **force) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [8, 33, 64])
@pytest.mark.parametrize(
    "force", [dict(epi_hoist=True), dict(epi_hoist=True, epi_batch=8), dict(epi_hoist=True,
              splits=2), dict(epi_hoist=True, ldsm=True)],
)  # fmt: skip
def test_hoist_gpu(m, force):
    """o_proj + residual with the hoisted epilogue, the output aliasing the residual (as the
    layer may): NaN-free and equal to the reference."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(m)
    K, N = CFG8.kda_dim, CFG8.hidden
    x = torch.randn(m, K, generator=gen, device=dev).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=gen, device=dev) * K**-0.5).to(torch.bfloat16)
    r = torch.randn(m, N, generator=gen, device=dev).to(torch.bfloat16)
    ref = skinny_gemm_ref(x, [w], epilogue_residual=r)[0][0].float()
    out = torch.full((m, N), float("nan"), dtype=torch.bfloat16, device=dev)
    tg.tile_gemm(x, [w], [out], epilogue_residual=r, **force)
    alias = r.clone()
    tg.tile_gemm(x, [w], [alias], epilogue_residual=alias, **force)
    torch.cuda.synchronize()
    for o in (out, alias):
        assert torch.isfinite(o.float()).all()
        assert ((o.float() - ref).abs().max() / ref.abs().max()).item() < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["in_proj", "qkv_a_g"])
@pytest.mark.parametrize("m", [1, 8, 33, 64])
@pytest.mark.parametrize("res_regs", [False, True])
def test_fold_residual_gpu(name, m, res_regs):
    """The residual add folded in too: ``residual_out == bf16(x + r)`` exactly, outputs vs the
    reference with vLLM's rounding, NaN-poisoned."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(m)
    kw = tg.attention_cases(CFG8)[name]
    K = kw["k"]
    x = torch.randn(m, K, generator=gen, device=dev).to(torch.bfloat16)
    r = torch.randn(m, K, generator=gen, device=dev).to(torch.bfloat16)
    ws = [(torch.randn(n, K, generator=gen, device=dev) * K**-0.5).to(torch.bfloat16)
          for n in kw["segments"]]  # fmt: skip
    g = (1 + 0.2 * torch.randn(K, generator=gen, device=dev)).to(torch.bfloat16)
    outs = [torch.full((m, w.shape[0]), float("nan"), dtype=torch.bfloat16, device=dev)
            for w in ws]  # fmt: skip
    rout = torch.full_like(r, float("nan"))
    tg.tile_gemm(x, [tg.fold_norm_weight(w, g) for w in ws], outs, residual=r,
                 residual_out=rout, rms_fold=True, eps=CFG8.eps, res_regs=res_regs)  # fmt: skip
    torch.cuda.synchronize()
    refs, rref = skinny_gemm_ref(x, ws, residual=r, norm_weight=g, eps=CFG8.eps)
    assert torch.equal(rout, rref)
    for o, ref in zip(outs, refs, strict=True):
        assert torch.isfinite(o.float()).all()
        assert ((o.float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 2e-2


@pytest.mark.parametrize("mode", ["launch", "fold_all"])
def test_dry_run_step_launches(monkeypatch, mode):
    """A whole step of the tiny model at 8 tokens on the CPU, every launch recorded (the kernels
    faked at ``interface.compiled``): with ``fold_all`` the input projections (K 256: short, so
    ``auto`` keeps them off the tile kernel with a norm launch) run as one tile launch each (the
    tiny MLA's q_b has K 96: never on the tile kernel); the plan's launch count per layer
    matches what ran."""
    from decodescope import tracer
    from decodescope.kernels.specialized import interface as itf
    from decodescope.kernels.specialized import step as S

    monkeypatch.setenv("DECODESCOPE_TILE_NORM", mode)
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(itf, "compiled", lambda key, build: (
        lambda *a, **k: calls.append((tracer.current_path(), str(key[0])))))  # fmt: skip
    p = S.plan(preset="tiny", tp_shape=1, batch=4, tokens_per_seq=2, layers="kda,mla")
    m = S.SpecializedModel(p.cfg, p.specs, 4, 2, seed=0, device="cpu", front_norm=p.front_norm)
    with tracer.range("step"):
        m.step()
    per_layer: dict[str, int] = {}
    for path, _ in calls:
        per_layer[path.split("/")[1]] = per_layer.get(path.split("/")[1], 0) + 1
    assert per_layer == p.launches() == m.launches()
    assert not any(c[1] == "tile_gemm_norm" for c in calls)
    inp = [c[1] for c in calls if "input_residual_norm" in c[0]]
    assert len(inp) == 2 and all((k == "tile_gemm") == (mode == "fold_all") for k in inp)
