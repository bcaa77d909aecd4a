"""The tile GEMM's ``ldmatrix`` fragments (``TilePlan.ldsm``, ``DECODESCOPE_TILE_LDSM=1``; issue #5).

On the CPU: sm_90a compiles of the ldsm plans at the shapes that use the tile GEMM (KDA in_proj,
MLA qkv_a + g_proj, q_b with its strided input, o_proj with the residual epilogue, the MoE front
with FP32 outputs) at 8 / 13 / 32 / 64 tokens; the knob; and an emulation of the shared-memory
layout (``load_w`` / ``load_x`` with the XOR-8 swizzle) read through an emulated ``ldmatrix``
with ``compute_ldsm``'s lane addresses: the m16n8k16 fragments of the natural K order. On the
H200 (``-m gpu``): ldsm against the default fragments on the same inputs.
"""

from __future__ import annotations

import pytest
import torch

# the package first: it sets CUTE_DSL_ARCH=sm_90a before anything imports cutlass
from decodescope.kernels import specialized  # noqa: F401
from decodescope.kernels.config import get_config  # noqa: E402
from decodescope.kernels.specialized import interface as itf  # noqa: E402
from decodescope.kernels.specialized import tile_gemm as tg  # noqa: E402


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("DECODESCOPE_TILE_LDSM", raising=False)


def _cases():
    cfg = get_config("kimi-k3", 8)
    c = tg.attention_cases(cfg)
    e = cfg.moe
    c["front"] = dict(k=cfg.hidden, segments=(e.num_experts + cfg.expert_dim + 2 * cfg.shared_inter,),
                      out_f32=True)  # fmt: skip
    return c


@pytest.mark.parametrize("name,m", [("in_proj", 64), ("qkv_a_g", 32), ("q_b", 8), ("o_proj", 13),
                                    ("front", 64), ("front", 8)])  # fmt: skip
def test_ldsm_plans_compile(name, m):
    kw = dict(_cases()[name])
    kw.pop("norm", None), kw.pop("add_residual", None), kw.pop("eps", None)
    p = tg.TilePlan(m=m, ldsm=True, **kw)
    assert itf.compile_only(tg.TileGemm(p), *tg._fake_args(p)) is not None


def test_ldsm_knob(monkeypatch):
    assert not tg.TilePlan(m=8, k=1024, segments=(16,)).ldsm
    monkeypatch.setenv("DECODESCOPE_TILE_LDSM", "1")
    p = tg.TilePlan(m=8, k=1024, segments=(16,))
    assert p.ldsm and p != tg.TilePlan(m=8, k=1024, segments=(16,), ldsm=False)  # compile key
    assert tg.TileGemm(p).swz(3, 5) == 3 ^ 5
    assert tg.TileGemm(tg.TilePlan(m=8, k=1024, segments=(16,), ldsm=False)).swz(3, 5) == 7


def _ldsm(sm_rows: torch.Tensor, addrs: list[tuple[int, int]], nmat: int) -> list[list]:
    """``ldmatrix`` on an emulated buffer (``sm_rows[row]`` = 128 bytes): matrix m's rows from
    the (row, byte offset) of lanes 8m .. 8m + 7; lane t gets row t // 4, BF16 elements
    2 (t % 4) .. + 1 of each matrix."""
    mats = []
    for m in range(nmat):
        mats.append(
            [sm_rows[r, o : o + 16].view(torch.bfloat16) for r, o in addrs[8 * m : 8 * m + 8]]
        )
    return [[mats[m][t // 4][2 * (t % 4) : 2 * (t % 4) + 2] for m in range(nmat)]
            for t in range(32)]  # fmt: skip


@pytest.mark.parametrize("m,warps", [(64, 4), (13, 4), (8, 8), (32, 2)])
def test_ldsm_fragments(m, warps):
    """One chunk as ``load_w`` / ``load_x`` place it with ``ldsm`` (unit ``u`` of row ``r`` at
    ``u ^ (r % 8)``), read with ``compute_ldsm``'s lane addresses: every lane's A fragment is
    (row g, k 2c..), (g + 8, 2c..), (g, 2c + 8..), (g + 8, 2c + 8..) and B (token g, k 2c..),
    (g, 2c + 8..) of each 16-wide K step."""
    p = tg.TilePlan(m=m, k=1024, segments=(4096,), warps=warps, ldsm=True)
    op = tg.TileGemm(p)
    g = torch.Generator().manual_seed(m)
    W = torch.randn(p.cta_rows, 64, generator=g).to(torch.bfloat16)
    X = torch.randn(p.mp, 64, generator=g).to(torch.bfloat16)
    sw = torch.zeros(p.cta_rows, 128, dtype=torch.uint8)
    sx = torch.zeros(p.mp, 128, dtype=torch.uint8)
    nt = p.threads
    for tid in range(nt):  # load_w, load_x (their index formulas)
        u = tid % 8
        for i in range(p.cta_rows * 8 // nt):
            r = tid // 8 + i * (nt // 8)
            o = 16 * op.swz(u, r)
            sw[r, o : o + 16] = W[r, 8 * u : 8 * u + 8].view(torch.uint8)
        for i in range(-(-(p.mp * 8) // nt)):
            idx = tid + i * nt
            r, uu = idx // 8, idx % 8
            if idx < p.mp * 8 and r < p.m:
                o = 16 * op.swz(uu, r)
                sx[r, o : o + 16] = X[r, 8 * uu : 8 * uu + 8].view(torch.uint8)
    for warp in range(warps):
        for ks in range(4):
            for q in range(tg.RT):
                addrs = [(warp * tg.WARP_ROWS + lane % 16 + 16 * q,
                          16 * ((2 * ks + lane // 16) ^ (lane % 8))) for lane in range(32)]  # fmt: skip
                got = _ldsm(sw, addrs, 4)
                for t in range(32):
                    r0 = warp * tg.WARP_ROWS + 16 * q + t // 4
                    k0 = 16 * ks + 2 * (t % 4)
                    want = [W[r0, k0 : k0 + 2], W[r0 + 8, k0 : k0 + 2], W[r0, k0 + 8 : k0 + 10],
                            W[r0 + 8, k0 + 8 : k0 + 10]]  # fmt: skip
                    for mm in range(4):
                        assert torch.equal(got[t][mm], want[mm]), (warp, ks, q, t, mm)
            groups = [(4, [(8 * (2 * jj + lane // 16) + lane % 8,
                            16 * ((2 * ks + (lane // 8) % 2) ^ (lane % 8))) for lane in range(32)],
                       [2 * jj, 2 * jj + 1]) for jj in range(p.ntiles // 2)]  # fmt: skip
            if p.ntiles % 2:
                jl = p.ntiles - 1
                groups.append((2, [(8 * jl + lane % 8, 16 * ((2 * ks + (lane // 8) % 2) ^ (lane % 8)))
                                   for lane in range(32)], [jl]))  # fmt: skip
            for nmat, addrs, tiles in groups:
                got = _ldsm(sx, addrs, nmat)
                for t in range(32):
                    k0 = 16 * ks + 2 * (t % 4)
                    for n_, j in enumerate(tiles):
                        tok = 8 * j + t // 4
                        if tok < p.m:
                            assert torch.equal(got[t][2 * n_], X[tok, k0 : k0 + 2])
                            assert torch.equal(got[t][2 * n_ + 1], X[tok, k0 + 8 : k0 + 10])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["in_proj", "o_proj", "front", "q_b"])
@pytest.mark.parametrize("m", [8, 13, 32, 64])
def test_ldsm_matches_default_gpu(name, m, monkeypatch):
    """H200 (``pytest -m gpu``): the ldsm plan against the default one on the same inputs
    (outputs poisoned), FP32 sums in another order only: max |diff| / max |ref| < 1e-2."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kw = dict(_cases()[name])
    norm = kw.pop("norm", False)
    kw.pop("add_residual", None), kw.pop("eps", None)
    K, N = kw["k"], kw["segments"][0]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(m)
    ldx = kw.get("x_stride", 0) or K
    xfull = torch.randn(m, ldx, device=dev, generator=g).to(torch.bfloat16)
    x = xfull[:, :K]
    ws = [torch.randn(n, K, device=dev, generator=g).to(torch.bfloat16) / K**0.5
          for n in kw["segments"]]  # fmt: skip
    f32 = kw.get("out_f32", False)
    odt = torch.float32 if f32 else torch.bfloat16
    res = torch.randn(m, N, device=dev, generator=g).to(torch.bfloat16) if kw.get(
        "residual_epilogue") else None  # fmt: skip
    outs = {}
    for ldsm in ("0", "1"):
        monkeypatch.setenv("DECODESCOPE_TILE_LDSM", ldsm)
        o = [torch.full((m, w.shape[0]), float("nan"), dtype=odt, device=dev) for w in ws]
        tg.tile_gemm(x, ws, o, epilogue_residual=res)
        torch.cuda.synchronize()
        outs[ldsm] = o
    del norm
    for a, b in zip(outs["0"], outs["1"], strict=True):
        assert torch.isfinite(b).all()
        err = (a.float() - b.float()).abs().max() / a.float().abs().max()
        assert err < 1e-2, err
