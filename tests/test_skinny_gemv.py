"""The streaming GEMV for 1..4 tokens (:mod:`.gemv_stream`) and the whole-slice L2 prefetch of
small projections (``GemmPlan.l2_all``), both opt-in through :mod:`.skinny_gemm`.

CPU (CI): the attention projections' GEMV plans compile for sm_90a (KDA in_proj and MLA
qkv_a + g with the residual + RMSNorm prologue, q_b with its strided input and norm, o_proj
with the residual epilogue; kimi-k3 TP8 and TP16, M = 1; in_proj and o_proj at M = 4); the
PTX issues the first ``depth`` load groups before ``griddepcontrol.wait`` and one bulk L2
prefetch per row with ``l2_all``; the row / column map covers every weight element once; the
environment knobs (default unchanged) and plan validation.
GPU (``pytest -m gpu``, H200): GEMV vs the torch reference, fresh random inputs, NaN-poisoned
outputs, M = 1, 2, 4, default and swept knobs; the skinny kernel with the L2 prefetch.
"""

from __future__ import annotations

import glob
import tempfile

import pytest
import torch

from decodescope.kernels.config import get_config
from decodescope.kernels.specialized import gemv_stream as gs
from decodescope.kernels.specialized import norm_qkv_proj as nqp
from decodescope.kernels.specialized import oproj_residual_norm as orn
from decodescope.kernels.specialized import skinny_gemm as sg


def _cases(tp: int) -> dict[str, dict]:
    cfg = get_config("kimi-k3", tp)
    return {
        "kda_in_proj": dict(k=cfg.hidden, segments=(cfg.kda_in_proj_out,), norm=True,
                            add_residual=True, eps=cfg.eps),
        "mla_qkv_a_g": dict(k=cfg.hidden, segments=(cfg.mla_qkv_a_out, cfg.mla_v_dim),
                            norm=True, add_residual=True, eps=cfg.eps),
        "mla_q_b": dict(k=cfg.mla.q_lora_rank, segments=(cfg.mla_q_b_out,), norm=True,
                        x_stride=cfg.mla_qkv_a_out, eps=cfg.eps),
        "o_proj": dict(k=cfg.kda_dim, segments=(cfg.hidden,), residual_epilogue=True),
    }  # fmt: skip


@pytest.mark.parametrize("tp", [8, 16])
def test_gemv_plans_compile(tp):
    for name, kw in _cases(tp).items():
        plan = gs.GemvPlan(m=1, l2_all=name in ("o_proj", "mla_q_b"), **kw)
        assert gs.compile_plan(plan) is not None, name


@pytest.mark.parametrize("name", ["kda_in_proj", "o_proj"])
def test_gemv_compiles_m4(name):
    assert gs.compile_plan(gs.GemvPlan(m=4, **_cases(8)[name])) is not None


def _ptx(op, args) -> str:
    import cutlass.cute as cute

    d = tempfile.mkdtemp()
    cute.compile(op, *args, options=f"--enable-tvm-ffi --keep-ptx --dump-dir={d}")
    (path,) = glob.glob(f"{d}/**/*.ptx", recursive=True)
    with open(path) as f:
        return f.read()


def test_gemv_ptx_order():
    """o_proj TP8 (6 pieces per lane and row, 2 rows per warp, groups of 2, depth 2): the
    first 2 groups (8 weight loads) go out before the PDL wait, the rest (4) after; with
    ``l2_all`` two bulk prefetches (one per row of the warp) precede the wait."""
    plan = gs.GemvPlan(m=1, l2_all=True, **_cases(8)["o_proj"])
    ptx = _ptx(gs.GemvStream(plan), gs._fake_args(plan))
    wait = ptx.index("griddepcontrol.wait")
    v4 = [i for i in range(len(ptx)) if ptx.startswith("ld.global.v4", i)]
    first = plan.depth * plan.grp * plan.rows
    assert sum(i < wait for i in v4) == first
    # after the wait: the remaining weight loads; x (one piece per thread at K 1536) by
    # cp.async after the wait (or by a register load with xload="regs")
    assert len(v4) - first == plan.pieces * plan.rows - first
    assert ptx.count("cp.async.cg.shared.global") == 1
    assert wait < ptx.index("cp.async.cg.shared.global")
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == plan.rows
    assert ptx.index("cp.async.bulk.prefetch.L2") < wait
    rp = gs.GemvPlan(m=1, xload="regs", **_cases(8)["o_proj"])
    rptx = _ptx(gs.GemvStream(rp), gs._fake_args(rp))
    assert rptx.count("ld.global.v4") == plan.pieces * plan.rows + 1
    assert "cp.async" not in rptx


def test_gemv_prologue_async_ptx():
    """KDA in_proj TP8 (norm + residual): x and r of each thread's 4 pieces by cp.async (8),
    one group, waited once; the register form compiles too."""
    kw = _cases(8)["kda_in_proj"]
    plan = gs.GemvPlan(m=1, **kw)
    ptx = _ptx(gs.GemvStream(plan), gs._fake_args(plan))
    assert ptx.count("cp.async.cg.shared.global") == 2 * -(-kw["k"] // 8 // plan.threads)
    assert ptx.count("cp.async.wait_group") == 1
    assert gs.compile_plan(gs.GemvPlan(m=1, xload="regs", **kw)) is not None


def test_gemv_nc_loads_ptx():
    """``ld="nc"`` (knob suffix ``n``): every weight load is ``ld.global.nc`` with the
    no-allocate / 256-byte hints, the same count as the plain form."""
    plan = gs.GemvPlan(m=1, ld="nc", **_cases(8)["o_proj"])
    ptx = _ptx(gs.GemvStream(plan), gs._fake_args(plan))
    assert ptx.count("ld.global.nc.L1::no_allocate.L2::256B.v4.b32") == plan.pieces * plan.rows
    assert gs.parse_ld("w8r2g2d2n") == "nc" and gs.parse_ld("auton") == "nc"
    assert gs.parse_ld("auto") == "plain" and gs.parse_cfg("w8r2g2d2n") == (8, 2, 2, 2)
    assert gs.parse_cfg("autox") is None and gs.parse_xload("autox") == "regs"
    assert gs.parse_xload("w8r2g2d2n") == "async" and gs.parse_ld("w8r2g2d2xn") == "nc"


def test_skinny_l2_prefetch_ptx():
    """The skinny kernel's whole-slice prefetch: one bulk prefetch (the thread's row), before
    the wait; none in the default plan."""
    kw = _cases(8)["o_proj"]
    on = sg.GemmPlan(m=1, load="regs", l2_all=True, gemv=False, **kw)
    off = sg.GemmPlan(m=1, load="regs", l2_all=False, gemv=False, **kw)
    p_on = _ptx(sg.SkinnyGemm(on), sg._fake_args(on))
    assert p_on.count("cp.async.bulk.prefetch.L2.global") == 1
    assert p_on.index("cp.async.bulk.prefetch.L2") < p_on.index("griddepcontrol.wait")
    assert "cp.async.bulk.prefetch" not in _ptx(sg.SkinnyGemm(off), sg._fake_args(off))


@pytest.mark.parametrize("cfg", [(8, 2, 2, 2), (16, 3, 2, 2), (4, 4, 4, 1), (8, 1, 32, 8)])
@pytest.mark.parametrize("tp", [8, 16])
def test_gemv_coverage(cfg, tp):
    """The kernel's index map (row ``cta * warps * rows + warp * rows + r`` of a segment, lane
    ``l`` reading columns ``(32 i + l) * 8 .. + 7``; rows past the segment clamped for loads and
    not stored) covers every weight element of every segment exactly once; the load groups
    (issued ``depth`` ahead) cover every piece once, in order."""
    w, r, g, d = cfg
    for name, kw in _cases(tp).items():
        p = gs.GemvPlan(m=1, warps=w, rows=r, group=g, depth=d, **kw)
        for n in p.segments:
            cta, warp, rr = torch.meshgrid(torch.arange(p.ctas(n)), torch.arange(p.warps),
                                           torch.arange(p.rows), indexing="ij")  # fmt: skip
            rows = (cta * p.cta_rows + warp * p.rows + rr).flatten()
            rows = rows[rows < n]  # the stored rows
            assert torch.equal(rows.sort().values, torch.arange(n)), (name, n)
            i, lane, e = torch.meshgrid(torch.arange(p.pieces), torch.arange(32),
                                        torch.arange(gs.PIECE), indexing="ij")  # fmt: skip
            cols = ((i * 32 + lane) * gs.PIECE + e).flatten()
            assert torch.equal(cols.sort().values, torch.arange(p.k)), (name, n)
        order = [i for gi in range(p.ngroups)
                 for i in range(gi * p.grp, min((gi + 1) * p.grp, p.pieces))]  # fmt: skip
        assert order == list(range(p.pieces)), name


def test_selection_knobs(monkeypatch):
    """The GEMV serves the 1-token attention plans by default (not 2 tokens; not a plan that
    asks for a weight-load mode, by ``load`` or ``DECODESCOPE_SKINNY_LOAD``: the skinny
    kernel's sweeps); ``DECODESCOPE_SKINNY_GEMV=N`` routes the plans with M <= N (0: none);
    ``DECODESCOPE_L2_PREFETCH=1`` turns the prefetch on (off by default) for weights up to
    24 MB (TP8 o_proj 22 MB, q_b 7 MB; not in_proj 90 MB)."""
    cfg = get_config("kimi-k3", 8)
    monkeypatch.setenv("DECODESCOPE_ATTN_GEMM", "default")
    monkeypatch.setenv("DECODESCOPE_SPLITK_GEMM", "0")
    for v in (sg.GEMV_ENV, sg.L2_ENV, sg.L2_MAX_ENV, gs.CFG_ENV, "DECODESCOPE_NO_PDL",
              sg.LOAD_ENV, gs.EXT_ENV):  # fmt: skip
        monkeypatch.delenv(v, raising=False)
    plans = {"in": nqp.plan_for(cfg, "kda", 1), "qkv": nqp.plan_for(cfg, "mla", 1),
             "o": orn.plan_for(cfg, "kda", 1), "qb": orn.q_b_plan(cfg, 1)}  # fmt: skip
    assert all(p.gemv and not p.l2_all for p in plans.values())
    assert not orn.plan_for(cfg, "kda", 2).gemv and not orn.q_b_plan(cfg, 4).gemv
    assert not sg.GemmPlan(m=1, k=256, segments=(16,), load="regs").gemv  # a load mode asked
    monkeypatch.setenv(sg.LOAD_ENV, "regs")
    assert not nqp.plan_for(cfg, "kda", 1).gemv
    monkeypatch.delenv(sg.LOAD_ENV)
    monkeypatch.setenv(sg.GEMV_ENV, "0")
    assert not nqp.plan_for(cfg, "kda", 1).gemv
    monkeypatch.setenv(sg.GEMV_ENV, "2")
    assert nqp.plan_for(cfg, "kda", 1).gemv and orn.q_b_plan(cfg, 2).gemv
    assert not nqp.plan_for(cfg, "kda", 3).gemv  # M above the knob
    # K not a multiple of 256, SiTU: served by default, not with DECODESCOPE_GEMV_EXT=0
    assert sg.GemmPlan(m=1, k=32 * 5, segments=(16,)).gemv
    assert sg.GemmPlan(m=1, k=256, segments=(32,), situ=True).gemv
    monkeypatch.setenv(gs.EXT_ENV, "0")
    assert not sg.GemmPlan(m=1, k=32 * 5, segments=(16,)).gemv
    assert not sg.GemmPlan(m=1, k=256, segments=(32,), situ=True).gemv
    monkeypatch.delenv(gs.EXT_ENV)
    monkeypatch.setenv(sg.L2_ENV, "1")
    assert orn.plan_for(cfg, "kda", 1).l2_all and orn.q_b_plan(cfg, 1).l2_all
    assert not nqp.plan_for(cfg, "kda", 1).l2_all
    assert orn.plan_for(cfg, "kda", 1).weight_bytes <= 24 * 2**20
    monkeypatch.setenv(sg.L2_MAX_ENV, "8")
    assert not orn.plan_for(cfg, "kda", 1).l2_all and orn.q_b_plan(cfg, 1).l2_all
    monkeypatch.setenv("DECODESCOPE_NO_PDL", "1")  # the prefetch rides on the PDL overlap
    assert not orn.q_b_plan(cfg, 1).l2_all
    monkeypatch.delenv("DECODESCOPE_NO_PDL")
    # the GEMV plan follows the GEMM plan (and its knobs from the environment)
    monkeypatch.setenv(gs.CFG_ENV, "w16r3g4d1")
    gp = gs.from_gemm_plan(orn.q_b_plan(cfg, 1))
    assert (gp.warps, gp.rows, gp.group, gp.depth, gp.l2_all) == (16, 3, 4, 1, True)
    assert gp.x_stride == cfg.mla_qkv_a_out and gp.norm and not gp.add_residual
    assert gp.ld == "plain"
    monkeypatch.setenv(gs.CFG_ENV, "auton")
    gp = gs.from_gemm_plan(orn.q_b_plan(cfg, 1))
    assert gp.ld == "nc" and (gp.warps, gp.rows) == (8, 2)
    monkeypatch.setenv(gs.CFG_ENV, "auto")  # the measured sets at TP8, 1 token
    for p, want, grid in ((nqp.plan_for(cfg, "kda", 1), (8, 3, 2, 2), 262),
                          (orn.plan_for(cfg, "kda", 1), (4, 4, 2, 2), 448),
                          (orn.plan_for(cfg, "mla", 1), (4, 4, 2, 2), 448),
                          (orn.q_b_plan(cfg, 1), (8, 2, 2, 4), 144),
                          (nqp.plan_for(cfg, "mla", 1), (16, 1, 4, 2), 228)):  # fmt: skip
        gp = gs.from_gemm_plan(p)
        assert (gp.warps, gp.rows, gp.group, gp.depth) == want and gp.grid == grid
    # elsewhere auto_cfg: rows per warp for at most 2 CTAs per SM
    c16 = get_config("kimi-k3", 16)
    gp = gs.from_gemm_plan(nqp.plan_for(c16, "kda", 1))
    assert (gp.warps, gp.rows, gp.group, gp.depth) == (8, 2, 2, 2) and gp.grid == 201
    gp = gs.from_gemm_plan(nqp.plan_for(c16, "mla", 1))  # measured at TP16 (s26)
    assert (gp.warps, gp.rows, gp.group, gp.depth) == (22, 1, 4, 3) and gp.grid == 131
    assert gs.auto_cfg((6288,)) == (8, 3, 1, 2) and gs.auto_cfg((7168,)) == (8, 4, 1, 2)


def test_tuned_file(monkeypatch, tmp_path):
    """``DECODESCOPE_GEMV_TUNED``: a file of measured knob sets (the sweep's ``--write-tuned``)
    overrides and extends the built-in ``TUNED``; ``0`` drops every measured set (auto_cfg: the
    A/B); unset / ``1`` the built-in table. The file here is a small synthetic one."""
    import json

    c16 = get_config("kimi-k3", 16)
    qkv16 = nqp.plan_for(c16, "kda", 1)  # TP16 in_proj: not in the built-in table
    in8 = nqp.plan_for(get_config("kimi-k3", 8), "kda", 1)
    for v in (gs.CFG_ENV, gs.TUNED_ENV):
        monkeypatch.delenv(v, raising=False)
    want_auto = gs.auto_cfg(qkv16.segments)
    assert gs.tuned_cfg(1, qkv16.k, qkv16.segments) == want_auto
    f = tmp_path / "tuned.json"
    f.write_text(json.dumps([
        {"m": 1, "k": qkv16.k, "segments": list(qkv16.segments), "cfg": "w22r1g4d2", "us": 1.0},
        {"m": 1, "k": in8.k, "segments": list(in8.segments), "cfg": "w12r4g1d2"},
    ]))  # fmt: skip
    monkeypatch.setenv(gs.TUNED_ENV, str(f))
    gp = gs.from_gemm_plan(qkv16)
    assert (gp.warps, gp.rows, gp.group, gp.depth) == (22, 1, 4, 2) and gp.grid == 147
    assert gs.tuned_cfg(1, in8.k, in8.segments) == (12, 4, 1, 2)  # overrides the built-in
    assert gs.tuned_cfg(1, 1536, (2304,)) == gs.TUNED[(1, 1536, (2304,))]  # the rest kept
    monkeypatch.setenv(gs.TUNED_ENV, "0")
    assert gs.tuned_cfg(1, in8.k, in8.segments) == gs.auto_cfg(in8.segments)
    monkeypatch.setenv(gs.TUNED_ENV, "1")
    assert gs.tuned_cfg(1, in8.k, in8.segments) == gs.TUNED[(1, in8.k, in8.segments)]
    # bad files: one line naming the variable and the file
    monkeypatch.setenv(gs.TUNED_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"DECODESCOPE_GEMV_TUNED=.*missing\.json.*cannot read"):
        gs.tuned_cfg(1, 256, (16,))
    for text, msg in (("{", "not a JSON file"), ('{"m": 1}', "expected a JSON list"),
                      ('[{"m": 1, "k": 256}]', "entry 0"),
                      ('[{"m": 1, "k": 256, "segments": [16], "cfg": "w8r2"}]', "entry 0"),
                      ('[{"m": 1, "k": 256, "segments": [16], "cfg": "auton"}]', "wWrRgGdD"),
                      ('[{"m": 1, "k": 256, "segments": [16], "cfg": "w40r1g1d1"}]',
                       "warps=40 outside 1..32")):  # fmt: skip
        bad = tmp_path / f"bad{len(text)}.json"
        bad.write_text(text)
        monkeypatch.setenv(gs.TUNED_ENV, str(bad))
        with pytest.raises(ValueError, match=msg) as e:
            gs.tuned_cfg(1, 256, (16,))
        assert str(bad) in str(e.value) and "\n" not in str(e.value)


def test_sweep_cfgs_per_projection():
    """``scripts/gpu_specialized_attn.py --gemv-cfgs``: ``cfg`` for every projection,
    ``PROJECTION:cfg`` for one; bad entries a one-line error before any GPU work."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_specialized_attn.py"
    spec = importlib.util.spec_from_file_location("gpu_specialized_attn_cfgs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfgs = ["auto", "qkv_a_g:w22r1g4d2", "q_b:w9r1g6d1", "w16r1g4d2"]
    assert mod.shape_cfgs(cfgs, "qkv_a_g") == ["auto", "w22r1g4d2", "w16r1g4d2"]
    assert mod.shape_cfgs(cfgs, "in_proj") == ["auto", "w16r1g4d2"]
    assert mod.shape_cfgs(None, "o_proj") == mod.GEMV_SWEEP
    assert mod.cfg_str((8, 2, 2, 4)) == "w8r2g2d4"
    for bad in ("foo:w8r2g2d2", "q_b:w8r2"):
        with pytest.raises(ValueError, match="--gemv-cfgs"):
            mod.shape_cfgs([bad], "q_b")


def test_bad_knobs(monkeypatch):
    monkeypatch.setenv(sg.GEMV_ENV, "9")
    with pytest.raises(ValueError, match="DECODESCOPE_SKINNY_GEMV"):
        sg.GemmPlan(m=1, k=256, segments=(16,))
    monkeypatch.setenv(sg.GEMV_ENV, "0")
    monkeypatch.setenv(sg.L2_ENV, "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_L2_PREFETCH"):
        sg.GemmPlan(m=1, k=256, segments=(16,))
    monkeypatch.setenv(sg.L2_ENV, "1")
    monkeypatch.setenv(sg.L2_MAX_ENV, "lots")
    with pytest.raises(ValueError, match="DECODESCOPE_L2_PREFETCH_MAX_MB"):
        sg.GemmPlan(m=1, k=256, segments=(16,))
    with pytest.raises(ValueError, match="DECODESCOPE_GEMV_CFG"):
        gs.parse_cfg("8,2,2,2")
    with pytest.raises(ValueError, match="1..4 tokens"):
        gs.GemvPlan(m=5, k=256, segments=(16,))
    with pytest.raises(ValueError, match="multiple of 8"):
        gs.GemvPlan(m=1, k=164, segments=(16,))
    with pytest.raises(ValueError, match="situ needs"):
        gs.GemvPlan(m=1, k=256, segments=(64,), situ=True, rows=3)
    with pytest.raises(ValueError, match="situ needs"):
        gs.GemvPlan(m=1, k=256, segments=(64, 32), situ=True)
    monkeypatch.setenv(gs.EXT_ENV, "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_GEMV_EXT"):
        gs.supports(1, 2112)
    with pytest.raises(ValueError, match="depth=0"):
        gs.GemvPlan(m=1, k=256, segments=(16,), depth=0)


def test_shared_host_glue():
    """skinny_gemm's shape_fields / call / fake_args, shared by both kernels' torch entries."""
    buf = torch.zeros(2, 512, dtype=torch.bfloat16)
    x = buf[:, :256]  # a row slice of a wider buffer
    w = [torch.zeros(32, 256, dtype=torch.bfloat16), torch.zeros(16, 256, dtype=torch.bfloat16)]
    nw = torch.ones(256, dtype=torch.bfloat16)
    f = sg.shape_fields(x, w, None, nw, None, 1e-6)
    assert f == dict(m=2, k=256, segments=(32, 16), norm=True, add_residual=False,
                     residual_epilogue=False, x_stride=512, eps=1e-6)  # fmt: skip
    assert sg.shape_fields(buf, w[:1], None, None, None, 1e-5)["x_stride"] == 0
    outs = [torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(2, 16, dtype=torch.bfloat16)]
    got = []
    sg.call(lambda *a: got.extend(a), x, w, outs, None, None, nw, None)
    ph = got[1]
    assert ph.shape == (16, 16) and got[2] is ph and got[3] is nw and got[0] is x
    assert got[4:8] == [w[0], outs[0], w[1], outs[1]] and got[8] is ph and got[9] is ph
    assert got[10] is ph and len(got) == 11
    # the GEMV's fake arguments: outputs as wide as the segments; the skinny SiTU plan's: half
    gp = gs.GemvPlan(m=2, k=256, segments=(32, 16), norm=True)
    fa = gs._fake_args(gp)
    assert len(fa) == 12 and fa[5].shape == (2, 32) and fa[7].shape == (2, 16)
    sp = sg.GemmPlan(m=1, k=256, segments=(64,), situ=True, gemv=False)
    assert sg._fake_args(sp)[5].shape == (1, 32)


# -- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("cfg,ld", [(None, "plain"), (None, "nc"), ((16, 3, 2, 2), "plain"),
                                    ((4, 4, 4, 1), "plain")])  # fmt: skip
def test_gemv_vs_reference_gpu(m, cfg, ld):
    dev = torch.device("cuda")
    torch.manual_seed(m)
    c = get_config("kimi-k3", 8)
    bf = torch.bfloat16
    for name, kw in _cases(8).items():
        K, segs = kw["k"], kw["segments"]
        ws = [(torch.randn(n, K, device=dev) * K**-0.5).to(bf) for n in segs]
        stride = kw.get("x_stride") or K  # x's row stride (not the load mode `ld`)
        x = torch.randn(m, stride, device=dev).to(bf)[:, :K]
        r = torch.randn(m, K, device=dev).to(bf)
        nw = (1 + 0.1 * torch.randn(K, device=dev)).to(bf)
        e = torch.randn(m, segs[0], device=dev).to(bf)
        outs = [torch.full((m, n), float("nan"), device=dev, dtype=bf) for n in segs]
        rout = torch.full((m, K), float("nan"), device=dev, dtype=bf)
        f = dict(residual=r if kw.get("add_residual") else None,
                 norm_weight=nw if kw.get("norm") else None,
                 epilogue_residual=e if kw.get("residual_epilogue") else None, eps=c.eps)  # fmt: skip
        gs.gemv(x, ws, outs, residual_out=rout if kw.get("add_residual") else None, cfg=cfg,
                ld=ld, l2_all=name == "o_proj", **f)  # fmt: skip
        torch.cuda.synchronize()
        ref, ref_r = sg.skinny_gemm_ref(x, ws, **f)
        for o, ro in zip(outs, ref, strict=True):
            err = ((o.float() - ro.float()).norm() / ro.float().norm()).item()
            assert torch.isfinite(o.float()).all() and err < 2e-2, (name, err)
        if ref_r is not None:
            assert torch.equal(rout, ref_r), name


# -- the dense MLP's two 1-token GEMMs (DECODESCOPE_GEMV_EXT) ----------------------------------


def _dense_cases(tp: int) -> dict[str, dict]:
    """The dense MLP (layer 0) at one rank: gate_up with the RMSNorm prologue and the SiTU
    epilogue (``[2 Dn, H]``), down with K = Dn = 33792 / tp (4224 at TP8, 2112 at TP16: a tail
    of 128 / 64 columns past the last multiple of 256)."""
    from decodescope.kernels.specialized import dense_mlp as dm

    cfg = get_config("kimi-k3", tp)
    return {
        "gate_up": dict(k=cfg.hidden, segments=(2 * cfg.dense_inter,), norm=True, eps=cfg.eps,
                        situ=dm._betas(cfg)),
        "down": dict(k=cfg.dense_inter, segments=(cfg.hidden,)),
    }  # fmt: skip


def _gemv_plan(kw: dict, m: int = 1, **knobs) -> gs.GemvPlan:
    kw = dict(kw)
    s = kw.pop("situ", None)
    sf = dict(situ=True, situ_beta=s[0], situ_lbeta=s[1]) if s else {}
    return gs.GemvPlan(m=m, **kw, **sf, **knobs)


def test_dense_selection(monkeypatch):
    """The dense MLP's 1-token plans (SiTU, K with a tail) go to the GEMV by default
    (``DECODESCOPE_GEMV_EXT=0``: the skinny kernel as before s29), not 2 tokens; a SiTU plan's
    rows per warp are even (gate / up pairs); the measured knob sets (s29) are in force."""
    from decodescope.kernels.specialized import dense_mlp as dm

    for v in (sg.GEMV_ENV, gs.CFG_ENV, gs.EXT_ENV, gs.TUNED_ENV, sg.LOAD_ENV):
        monkeypatch.delenv(v, raising=False)
    for tp in (8, 16):
        cfg = get_config("kimi-k3", tp)
        assert dm.gate_up_plan(cfg, 1).gemv and dm.down_plan(cfg, 1).gemv  # the default
        monkeypatch.setenv(gs.EXT_ENV, "1")
        gu, dn = dm.gate_up_plan(cfg, 1), dm.down_plan(cfg, 1)
        assert gu.gemv and dn.gemv and not dm.gate_up_plan(cfg, 2).gemv
        g = gs.from_gemm_plan(gu)
        assert g.situ and g.rows % 2 == 0 and g.grid == g.ctas(2 * cfg.dense_inter)
        assert g.cta_rows * g.grid >= cfg.dense_inter and not g.tail
        d = gs.from_gemm_plan(dn)
        assert d.tail and d.kp == d.pieces * 256 and d.kp - d.k == 256 - cfg.dense_inter % 256
        want = {8: ((4, 4, 2, 2), (16, 1, 4, 2)), 16: ((8, 2, 2, 4), (4, 4, 2, 2))}[tp]
        assert ((g.warps, g.rows, g.group, g.depth), (d.warps, d.rows, d.group, d.depth)) == want
        monkeypatch.setenv(gs.CFG_ENV, "w8r3g2d2")  # odd rows: rounded up for SiTU
        assert gs.from_gemm_plan(gu).rows == 4 and gs.from_gemm_plan(dn).rows == 3
        monkeypatch.setenv(gs.EXT_ENV, "0")
        assert not dm.gate_up_plan(cfg, 1).gemv and not dm.down_plan(cfg, 1).gemv
        monkeypatch.delenv(gs.CFG_ENV)
        monkeypatch.delenv(gs.EXT_ENV)


@pytest.mark.parametrize("tp", [8, 16])
def test_dense_plans_compile(tp):
    for name, kw in _dense_cases(tp).items():
        for m in (1, 4):
            assert gs.compile_plan(_gemv_plan(kw, m)) is not None, (name, m)


@pytest.mark.parametrize("cfg", [(8, 2, 2, 2), (8, 4, 1, 2), (16, 2, 4, 1), (4, 6, 1, 3)])
@pytest.mark.parametrize("tp", [8, 16])
def test_dense_coverage(cfg, tp):
    """The SiTU map (warp ``w`` of CTA ``c``: output rows ``(c * warps + w) * rows / 2 + j``,
    reading gate row ``d`` and up row ``D + d``, rows past ``D`` clamped and not stored) stores
    every output once and reads every weight row; the tail's clamped pieces read only columns
    below K, and every column below K is read exactly once at a lane whose activation is real
    (the others meet the zeros in the padding)."""
    w, r, g, d = cfg
    for name, kw in _dense_cases(tp).items():
        p = _gemv_plan(kw, warps=w, rows=r, group=g, depth=d)
        n = p.segments[0]
        nout = p.out_width(n)
        cta, warp, j = torch.meshgrid(torch.arange(p.ctas(n)), torch.arange(p.warps),
                                      torch.arange(p.warp_outs), indexing="ij")  # fmt: skip
        outs = (cta * p.cta_rows + warp * p.warp_outs + j).flatten()
        stored = outs[outs < nout]
        assert torch.equal(stored.sort().values, torch.arange(nout)), name
        if p.situ:
            read = torch.cat([outs.clamp(max=nout - 1), outs.clamp(max=nout - 1) + nout])
            assert torch.equal(read.unique(), torch.arange(n)), name
        i, lane = torch.meshgrid(torch.arange(p.pieces), torch.arange(32), indexing="ij")
        v = i * 32 + lane  # the piece each lane multiplies with sX (padded to kp)
        loaded = torch.where(i == p.pieces - 1, v.clamp(max=p.k // gs.PIECE - 1), v)
        assert loaded.max() * gs.PIECE + gs.PIECE <= p.k  # no weight read past the row
        real = v < p.k // gs.PIECE  # activations below K; the rest are the zero padding
        assert torch.equal(loaded[real], v[real])
        assert torch.equal(v[real].sort().values, torch.arange(p.k // gs.PIECE)), name
        assert p.kp >= p.k and p.kp % 256 == 0 and p.smem_bytes >= p.kp * 2


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("cfg", [None, (8, 2, 2, 2), (16, 4, 1, 3)])
def test_dense_gemv_vs_reference_gpu(tp, m, cfg):
    """The dense MLP's gate_up (SiTU) and down (K tail) on the GEMV against the reference:
    fresh random inputs, NaN-poisoned outputs; the chain (gate_up then down) too."""
    dev = torch.device("cuda")
    torch.manual_seed(100 * tp + m)
    c = get_config("kimi-k3", tp)
    bf = torch.bfloat16
    cases = _dense_cases(tp)
    gu, dn = cases["gate_up"], cases["down"]
    w13 = (torch.randn(gu["segments"][0], gu["k"], device=dev) * gu["k"] ** -0.5).to(bf)
    w2 = (torch.randn(dn["segments"][0], dn["k"], device=dev) * dn["k"] ** -0.5).to(bf)
    r = torch.randn(m, c.hidden, device=dev).to(bf)
    nw = (1 + 0.1 * torch.randn(c.hidden, device=dev)).to(bf)
    act = torch.full((m, c.dense_inter), float("nan"), device=dev, dtype=bf)
    out = torch.full((m, c.hidden), float("nan"), device=dev, dtype=bf)
    gs.gemv(r, [w13], [act], norm_weight=nw, eps=c.eps, cfg=cfg, situ=gu["situ"])
    torch.cuda.synchronize()
    (ref_act,), _ = sg.skinny_gemm_ref(r, [w13], norm_weight=nw, eps=c.eps, situ=gu["situ"])
    err = ((act.float() - ref_act.float()).norm() / ref_act.float().norm()).item()
    assert torch.isfinite(act.float()).all() and err < 2e-2, ("gate_up", err)
    gs.gemv(act, [w2], [out], cfg=cfg)
    torch.cuda.synchronize()
    (ref_out,), _ = sg.skinny_gemm_ref(act, [w2])
    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
    assert torch.isfinite(out.float()).all() and err < 2e-2, ("down", err)
