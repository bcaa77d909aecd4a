"""The dense MLP's gate_up + SiTU on the tile GEMM (kernels/specialized/dense_tile.py).

CPU: the kernel compiles for sm_90a at kimi-k3 TP8 / TP16, 8 / 32 / 33 / 64 tokens (split-K
epilogue, the one-split register epilogue, the folded norm); the row map is a permutation
pairing each MMA tile's gate rows 0..7 with their up rows 8..15; a torch model of the kernel's
index math (row map, per-split partials, both epilogues) equals the reference; the knob
``DECODESCOPE_DENSE_TILE`` (default ``fold`` from 8 tokens, ``0`` the skinny GEMM) picks the
launches; ``ldmatrix`` fragments are the tile's default here. GPU (``-m gpu``):
the kernel and the dense MLP with the knob vs the torch references, NaN-poisoned outputs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("decodescope.kernels.specialized.interface")  # CUTE_DSL_ARCH first

from decodescope.kernels.config import get_config  # noqa: E402
from decodescope.kernels.reference import situ_ref  # noqa: E402
from decodescope.kernels.specialized import dense_mlp as dm  # noqa: E402
from decodescope.kernels.specialized import dense_tile as dt  # noqa: E402
from decodescope.kernels.specialized import tile_gemm as tg  # noqa: E402

CFGS = {tp: get_config("kimi-k3", tp) for tp in (8, 16)}


@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [8, 32, 33, 64])
def test_compiles(tp, m):
    cfg = CFGS[tp]
    p = dm.tile_plan(cfg, m)
    assert p.row_ctas == -(-cfg.dense_inter // 64) and p.row_ctas * p.splits >= tg.NUM_SMS
    assert p.smem_bytes <= 114 * 1024  # two CTAs per SM
    assert dt.compile_plan(p, *dm._betas(cfg)) is not None


@pytest.mark.parametrize("tp,m,kw", [(8, 8, {"splits_force": 1}), (16, 33, {"splits_force": 1}),
                                     (8, 64, {"rms_fold": True}), (16, 8, {"rms_fold": True}),
                                     (8, 32, {"rms_fold": True, "splits_force": 1}),
                                     (8, 64, {"ldsm": False}), (8, 8, {"splits_force": 7}),
                                     (8, 64, {"rms_fold": True, "ldsm": False})])  # fmt: skip
def test_compiles_variants(tp, m, kw):
    cfg = CFGS[tp]
    p = dt.plan(m, cfg.hidden, cfg.dense_inter, eps=cfg.eps, **kw)
    assert dt.compile_plan(p, *dm._betas(cfg)) is not None


@pytest.mark.parametrize("tp,stages", [(16, 6), (8, 8), (16, 2)])
def test_stages_knob(tp, stages, monkeypatch):
    """``DECODESCOPE_DENSE_TILE_STAGES``: the cp.async stages forced (more chunks in flight per
    CTA: the plans run one CTA per SM at 64 tokens); the split-K rule unchanged (the workspace
    split-K where the stages cannot hold the cluster's partial tile); a value outside 2..8 is a
    one-line error."""
    cfg = CFGS[tp]
    base = dm.tile_plan(cfg, 64, True)
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE_STAGES", str(stages))
    p = dm.tile_plan(cfg, 64, True)
    assert p.stages == stages and p.splits == base.splits
    assert p.cluster == (stages >= 3)  # 2 stages cannot hold the cluster's partial tile
    assert p.smem_bytes <= 227 * 1024
    assert dt.compile_plan(p, *dm._betas(cfg)) is not None
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE_STAGES", "9")
    with pytest.raises(ValueError, match="DECODESCOPE_DENSE_TILE_STAGES='9'"):
        dm.tile_plan(cfg, 64, True)


@pytest.mark.parametrize("tp,splits", [(16, 8), (8, 4), (16, 7)])
def test_splits_knob(tp, splits, monkeypatch):
    """``DECODESCOPE_DENSE_TILE_SPLITS``: the split-K count forced (2 CTAs per SM at 64 tokens
    with 8 at TP16), the cluster split-K kept up to 8; a bad value is a one-line error."""
    cfg = CFGS[tp]
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE_SPLITS", str(splits))
    p = dm.tile_plan(cfg, 64, True)
    assert p.splits == splits and p.cluster and p.chunks * splits == cfg.hidden // 64
    assert dt.compile_plan(p, *dm._betas(cfg)) is not None
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE_SPLITS", "x")
    with pytest.raises(ValueError, match="DECODESCOPE_DENSE_TILE_SPLITS='x'"):
        dm.tile_plan(cfg, 64, True)


@pytest.mark.parametrize(
    "tp,m,kw", [(16, 64, {"cluster": True, "wgmma": True, "rms_fold": True}),
                (8, 64, {"cluster": True, "wgmma": False}),
                (16, 8, {"cluster": True, "wgmma": False, "rms_fold": True}),
                (8, 33, {"wgmma": True, "cluster": False}), (16, 32, {"wgmma": True, "splits_force": 1})],
)  # fmt: skip
def test_cluster_and_wgmma_compile(tp, m, kw):
    """The warpgroup MMAs and the cluster split-K (the defaults since session 25), each way:
    with the cluster the gate / up quads of the splits are read over distributed shared memory
    between two cluster barriers (no counter atomics); with wgmma the one-split epilogue maps
    the accumulators through ``tile_row``."""
    import re

    from decodescope.kernels.specialized import interface as itf

    cfg = CFGS[tp]
    p = dt.plan(m, cfg.hidden, cfg.dense_inter, eps=cfg.eps, **kw)
    assert (p.cluster, p.wgmma) == (kw.get("cluster", False), kw.get("wgmma", False))
    ptx = itf.ptx_text(dt.DenseTileGemm(p, *dm._betas(cfg)), *dt._fake_args(p))
    assert ptx.count("wgmma.mma_async") == (8 if p.wgmma else 0)
    if p.cluster:
        per = -(-m // p.splits) * (p.cta_rows // 8)  # gate / up pairs of one CTA's tokens
        loads = -(-per // p.threads) * p.splits * 2 + (
            -(-per // p.threads) * p.splits if p.rms_fold else 0
        )
        assert ptx.count("ld.shared::cluster") == loads
        assert len(re.findall(r"barrier\.cluster\.arrive", ptx)) == 2 and "atom." not in ptx
    assert dt.compile_plan(p, *dm._betas(cfg)) is not None


def test_cluster_and_wgmma_defaults(monkeypatch):
    """Warpgroup MMAs at every token count (``DECODESCOPE_DENSE_TILE_WGMMA=0`` turns them off);
    the cluster split-K by the tile GEMM's rule: on wherever a plan has 2..8 splits, off at one
    split (no error: the rule resolves it)."""
    cfg = CFGS[8]
    for v in (dt.WGMMA_ENV, tg.CLUSTER_ENV):
        monkeypatch.delenv(v, raising=False)
    for m in (8, 32, 64):
        p = dt.plan(m, cfg.hidden, cfg.dense_inter)
        assert p.wgmma and p.cluster and not p.uses_ws
    p1 = dt.plan(8, cfg.hidden, cfg.dense_inter, splits_force=1)
    assert p1.splits == 1 and not p1.cluster
    monkeypatch.setenv(tg.CLUSTER_ENV, "0")
    monkeypatch.setenv(dt.WGMMA_ENV, "0")
    p = dt.plan(64, cfg.hidden, cfg.dense_inter)
    assert not p.cluster and not p.wgmma and p.uses_ws
    monkeypatch.setenv(dt.WGMMA_ENV, "yes")
    with pytest.raises(ValueError, match=dt.WGMMA_ENV):
        dt.plan(64, cfg.hidden, cfg.dense_inter)


def test_plan_numbers_and_errors(monkeypatch):
    monkeypatch.delenv("DECODESCOPE_TILE_LDSM", raising=False)
    p8, p16 = dm.tile_plan(CFGS[8], 8), dm.tile_plan(CFGS[16], 64)
    assert p8.ldsm and p16.ldsm and not dt.plan(8, 7168, 4224, ldsm=False).ldsm
    monkeypatch.setenv("DECODESCOPE_TILE_LDSM", "0")
    assert not dm.tile_plan(CFGS[8], 8).ldsm
    monkeypatch.delenv("DECODESCOPE_TILE_LDSM")
    assert (p8.row_ctas, p8.splits, p8.chunks) == (66, 2, 56)
    assert (p16.row_ctas, p16.splits, p16.chunks) == (33, 4, 28)
    with pytest.raises(ValueError, match="dense tile"):
        dt.plan(65, 7168, 4224)
    with pytest.raises(ValueError, match="dense tile"):
        dt.plan(8, 7168, 4220)
    with pytest.raises(ValueError, match="no residual epilogue"):
        dt.plan(8, 7168, 4224, residual_epilogue=True)


@pytest.mark.parametrize("dn", [4224, 2112, 200])
def test_row_map(dn):
    rm = dt.row_map(dn)
    valid = rm[rm >= 0]
    assert sorted(valid.tolist()) == list(range(2 * dn))  # each weight row once
    t = rm.view(-1, 16)  # MMA tiles
    ok = t[:, 0] >= 0
    assert bool((t[ok, 8:] == t[ok, :8] + dn).all())  # rows 8..15: the up rows of rows 0..7
    assert bool((t[ok, :8] < dn).all())
    assert bool((t[ok, 1:8] == t[ok, :1] + torch.arange(1, 8)).all())  # 8 consecutive columns


def _model(x, w13, dn, splits, fold_rstd=None, cta_rows=128, warps=4):
    """The kernel's index math in torch: weights through the row map, per-split FP32 partials
    ``ws[s, m, local row]``, then the one-split register epilogue or the split-K one."""
    rm = dt.row_map(dn, cta_rows)
    L, K = rm.numel(), x.shape[1]
    W = torch.zeros(L, K)
    W[rm >= 0] = w13.float()[rm[rm >= 0]]
    ks = K // splits
    ws = torch.stack([x.float()[:, s * ks:(s + 1) * ks] @ W[:, s * ks:(s + 1) * ks].T
                      for s in range(splits)])  # fmt: skip
    act = torch.full((x.shape[0], dn), float("nan"))
    rs = fold_rstd if fold_rstd is not None else torch.ones(x.shape[0])

    def out(m, d, gv, uv):
        gv = (gv * rs[m]).to(torch.bfloat16).float()
        uv = (uv * rs[m]).to(torch.bfloat16).float()
        act[m, d] = situ_ref(gv, uv, *dm._betas(CFGS[8]))

    M = x.shape[0]
    for b in range(L // cta_rows):
        if splits == 1:  # store_direct: lane (g, c) of warp w, tile q
            for w in range(warps):
                for q in range(tg.RT):
                    for g in range(8):
                        d = b * cta_rows // 2 + (w * tg.RT + q) * dt.COLS + g
                        lr = b * cta_rows + w * tg.WARP_ROWS + q * 16 + g
                        if d < dn:
                            for m in range(M):
                                out(m, d, ws[0, m, lr], ws[0, m, lr + 8])
        else:  # epilogue_partial: item (tile, half) of token m, 4 columns
            tot = ws.sum(0)
            for m in range(M):
                for it in range(cta_rows // 8):
                    lr = b * cta_rows + (it // 2) * 16 + (it % 2) * 4
                    d = b * cta_rows // 2 + (it // 2) * dt.COLS + (it % 2) * 4
                    if d < dn:
                        for e in range(4):
                            out(m, d + e, tot[m, lr + e], tot[m, lr + 8 + e])
    return act.to(torch.bfloat16)


@pytest.mark.parametrize("dn,splits,fold", [(200, 1, False), (200, 2, False), (136, 4, True)])
def test_index_model_equals_ref(dn, splits, fold):
    gen = torch.Generator().manual_seed(dn + splits)
    M, K = 5, 256
    x = torch.randn(M, K, generator=gen).bfloat16()
    w13 = (torch.randn(2 * dn, K, generator=gen) * K**-0.5).bfloat16()
    cfg = CFGS[8]
    rstd = None
    if fold:
        g = (1 + 0.1 * torch.randn(K, generator=gen)).bfloat16()
        rstd = torch.rsqrt(x.float().pow(2).mean(-1) + cfg.eps)
        w = {"dense_w13": tg.fold_norm_weight(w13, g)}
        ref = dm.gate_up_act_ref(cfg, w, (x.float() * rstd[:, None]).bfloat16(), norm=False)
        got = _model(x, w["dense_w13"], dn, splits, rstd)
        tol = 2e-2  # the reference rounds x * rstd to bf16, the kernel scales the FP32 sum
    else:
        ref = dm.gate_up_act_ref(cfg, {"dense_w13": w13}, x, norm=False)
        got = _model(x, w13, dn, splits)
        tol = 1e-2
    assert not got.isnan().any()
    err = (got.float() - ref.float()).abs().max() / ref.float().abs().max()
    assert float(err) < tol


def test_knob(monkeypatch):
    monkeypatch.delenv("DECODESCOPE_DENSE_TILE", raising=False)
    monkeypatch.delenv("DECODESCOPE_DENSE_SPLIT_NORM", raising=False)
    assert [dm.tile_mode(m) for m in (1, 7, 8, 64)] == ["", "", "fold", "fold"]  # the default
    assert dm.ops_for(1) == dm.OPS and dm.ops_for(64) == dm.OPS  # two launches
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE", "0")
    assert dm.tile_mode(64) == "" and dm.ops_for(8) == dm.OPS and dm.ops_for(64) == dm.OPS_SPLIT
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE", "1")
    assert [dm.tile_mode(m) for m in (1, 7, 8, 64)] == ["", "", "launch", "launch"]
    assert dm.ops_for(1) == dm.OPS and dm.ops_for(8) == dm.OPS_SPLIT  # <= 3 launches
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE", "fold")
    assert dm.tile_mode(33) == "fold" and dm.ops_for(64) == dm.OPS  # two launches
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE", "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_DENSE_TILE"):
        dm.tile_mode(8)


def _meta_weights(cfg):
    H, Dn = cfg.hidden, cfg.dense_inter
    e = lambda *s: torch.empty(*s, dtype=torch.bfloat16, device="meta")  # noqa: E731
    return {"dense_w13": e(2 * Dn, H), "dense_w2": e(H, Dn), "mlp_norm": e(H)}


@pytest.mark.parametrize("mode,m", [("0", 8), ("1", 8), ("1", 64), ("", 8), ("", 64)])
def test_mlp_stages(monkeypatch, mode, m):
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE", mode)
    monkeypatch.delenv("DECODESCOPE_DENSE_SPLIT_NORM", raising=False)
    cfg = CFGS[8]
    mlp = dm.SpecializedDenseMLP(cfg, _meta_weights(cfg), m)
    assert mlp.tile == {"0": "", "1": "launch", "": "fold"}[mode]
    assert mlp.launches == (3 if mode == "1" else 2)
    mlp.warmup()  # compiles the plan's kernels (meta tensors: nothing runs)
    r = torch.empty(m, cfg.hidden, dtype=torch.bfloat16, device="meta")
    assert [op for op, _ in mlp.stages(r, r)] == list(mlp.ops)


# -- GPU -------------------------------------------------------------------------------------


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    if not bool(a.isfinite().all()):
        return float("inf")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _gpu_weights(cfg, seed):
    H, Dn = cfg.hidden, cfg.dense_inter
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(shape, generator=g, device="cuda") * std).bfloat16()

    w = {
        "dense_w13": randn(2 * Dn, H, std=H**-0.5),
        "dense_w2": randn(H, Dn, std=Dn**-0.5),
        "mlp_norm": (1 + 0.1 * randn(H).float()).bfloat16(),
    }
    return w, randn


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tp", [8, 16])
@pytest.mark.parametrize("m", [8, 32, 33, 64])
@pytest.mark.parametrize(
    "kw", [{}, {"splits_force": 1}, {"rms_fold": True}, {"cluster": True}, {"wgmma": True},
           {"cluster": True, "wgmma": True, "rms_fold": True}, {"wgmma": True, "splits_force": 1},
           {"rms_fold": True, "sq_mma": True}, {"rms_fold": True, "wgmma": False, "cluster": False},
           {"rms_fold": True, "splits_force": 8}, {"rms_fold": True, "stages": 7}],
)  # fmt: skip
def test_dense_tile_gpu(tp, m, kw):
    """Each variant against the references; the tokens' rows scaled 0.2x..3x, so that a folded
    norm's sum of squares taken from another token's row shows."""
    cfg = CFGS[tp]
    w, randn = _gpu_weights(cfg, 10 * tp + m)
    r = (
        randn(m, cfg.hidden).float() * torch.linspace(0.2, 3.0, m, device="cuda")[:, None]
    ).bfloat16()
    act = torch.full((m, cfg.dense_inter), float("nan"), dtype=torch.bfloat16, device="cuda")
    ref = dm.gate_up_act_ref(cfg, w, r)  # norm + GEMM + SiTU, the skinny kernel's reference
    if kw.get("rms_fold"):  # the raw residual on bf16(w13 * g); one rounding fewer
        xin, w13, tol = r, tg.fold_norm_weight(w["dense_w13"], w["mlp_norm"]), 2e-2
    else:
        from decodescope.kernels.specialized import rmsnorm as rms

        xin, w13, tol = rms.rmsnorm_ref(r, w["mlp_norm"], cfg.eps), w["dense_w13"], 1e-2
    for _ in range(2):  # the second launch: the split-K counters were re-zeroed
        act.fill_(float("nan"))
        dt.dense_gate_up(xin, w13, act, dm._betas(cfg), eps=cfg.eps, **kw)
        torch.cuda.synchronize()
        assert _rel(act, ref) < tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["1", "fold"])
@pytest.mark.parametrize("m", [8, 64])
def test_dense_mlp_knob_gpu(monkeypatch, mode, m):
    monkeypatch.setenv("DECODESCOPE_DENSE_TILE", mode)
    cfg = CFGS[8]
    w, randn = _gpu_weights(cfg, 7 + m)
    r = randn(m, cfg.hidden)
    mlp = dm.SpecializedDenseMLP(cfg, w, m)
    mlp.warmup()
    out = torch.full((m, cfg.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    mlp.forward_norm(r, out)
    torch.cuda.synchronize()
    assert _rel(out, dm.dense_mlp_ref(cfg, w, r)) < (2e-2 if mode == "fold" else 1e-2)


def test_gpu_script_on_cpu(monkeypatch, tmp_path):
    """scripts/gpu_dense_tile.py's own Python on the CPU: the kernel and the launches replaced
    by torch models of their contracts, graph timing by a constant (not the kernels)."""
    import importlib.util
    from pathlib import Path

    from decodescope.kernels import bandwidth, timing
    from decodescope.kernels.specialized import rmsnorm as rms

    def fake_gate_up(x, w13, act, betas, *, rms_fold=False, eps=1e-5, **kw):
        dn = w13.shape[0] // 2
        dt.plan(x.shape[0], x.shape[1], dn, rms_fold=rms_fold, eps=eps, **kw)  # bad flags raise
        s = x.float() @ w13.float().T
        if rms_fold:
            s = s * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        s = s.bfloat16().float()
        act.copy_(situ_ref(s[:, :dn], s[:, dn:], *betas))

    def fake_down(cfg, w, act, x_out):
        x_out.copy_(dm.down_proj_ref(cfg, w, act))

    monkeypatch.setattr(dt, "dense_gate_up", fake_gate_up)
    monkeypatch.setattr(dm, "down_proj", fake_down)
    monkeypatch.setattr(rms, "rmsnorm", lambda x, w, y, eps: y.copy_(rms.rmsnorm_ref(x, w, eps)))
    monkeypatch.setattr(
        dm, "gate_up_act", lambda cfg, w, r, act, norm=True: act.copy_(
            dm.gate_up_act_ref(cfg, w, r, norm=norm))
    )  # fmt: skip
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "graph_time_us", lambda fns, n: (12.5, 12.0, 13.0))
    monkeypatch.setattr(bandwidth, "copy_bandwidth_tbs", lambda: 4.0)
    monkeypatch.setattr(dt, "_WS", {})
    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_dense_tile.py"
    spec = importlib.util.spec_from_file_location("gpu_dense_tile", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "dt"
    argv = ["gpu_dense_tile.py", "--out", str(out), "--tp", "16", "--ms", "8", "--device", "cpu"]
    monkeypatch.setattr("sys.argv", argv)
    assert mod.main() == 0
    import json

    res = json.loads((out / "results.json").read_text())
    assert sum(r["status"] == "PASS" for r in res) == 4 * 6 + 3 * 2  # kernels; MLP modes x M
    assert sum(r["status"] == "time" for r in res) == 8 + len(mod.TIME_VARIANTS)
    assert (out / "table.md").exists()
