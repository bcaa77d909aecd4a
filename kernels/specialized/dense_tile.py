"""The dense MLP's gate_up + SiTU on the tensor-core tile GEMM (8..64 tokens, issue #5).

``act[m, d] = bf16(situ(bf16(g[m, d]), bf16(u[m, d])))`` with ``g = h @ w13[d]^T`` and ``u = h @
w13[Dn + d]^T``, ``w13 = dense_w13 [2*Dn, H]`` as the standard path keeps it (gate rows first,
then up rows; no re-layout). :class:`DenseTileGemm` is :class:`.tile_gemm.TileGemm` (same plan,
same ``cp.async`` pipeline, same MMAs and split-K) with three methods replaced:

- **Row map** (:meth:`DenseTileGemm.load_w`): a CTA's 128 weight rows (``warps * 32``) cover 64
  output columns ``d0 = cta * 64 ..``: local row ``L`` (16-row MMA tile ``t = L // 16``, ``w =
  L % 16``) holds weight row ``d0 + 8t + w % 8``, plus ``Dn`` where ``w >= 8``. Rows 0..7 of each
  MMA tile are 8 gate rows, rows 8..15 the matching up rows (:func:`row_map`). The grid is the
  plain plan's (``ceil(2 Dn / 128)`` row CTAs: 66 at TP8, 33 at TP16, times the splits).
- **Epilogue at one split** (:meth:`DenseTileGemm.store_direct`): in the ``m16n8k16``
  accumulator a lane (g, c) holds rows ``g`` and ``g + 8`` of its tile for the same tokens
  ``2c, 2c + 1``: the gate and the up value of one (column, token). SiTU in registers, no
  shared-memory exchange; the ``[M, 2 Dn]`` product never reaches memory.
- **Split-K epilogue** (:meth:`DenseTileGemm.epilogue_partial`; the default plans have 2 splits
  at TP8, 4 at TP16): the last CTA of a row tile sums the FP32 partials (the workspace keeps the
  local row order) and a thread takes 4 gate rows ``16t + 4h ..`` and their 4 up rows ``16t + 8
  + 4h ..`` of one token (two 16-byte loads per split), writing 4 ``act`` columns (8 bytes).

Warpgroup MMAs and the cluster split-K (the defaults since session 25): the tile GEMM's
``wgmma`` at every token count (``DECODESCOPE_DENSE_TILE_WGMMA=0``: ``mma.sync``; the one-split
epilogue takes the tile of its rows from ``tile_row``: ``4 q + warp`` there) and its cluster
split-K wherever a plan has 2..8 splits (``DECODESCOPE_TILE_CLUSTER``, as every tile plan;
:meth:`DenseTileGemm.cl_gather`: the gate and up quads of a token read from every split's
partial tile in distributed shared memory, then SiTU as above). H200, TP16, s25/n2, both off ->
both on: the kernel alone (h normalized) 20.0 -> 19.3 / 22.2 -> 20.6 / 25.9 -> 23.6 us at 8 /
32 / 64 tokens, with the norm folded 20.9 -> 19.7 / 22.8 -> 21.5 / 26.3 -> 26.4; the dense layer
(specialized, same call) 59.7 -> 57.6 / 77.3 -> 76.1 / 92.4 -> 91.7 at batch 8 / 32 / 64.

The RMSNorm before it: its own launch (:mod:`.rmsnorm`; the dense MLP's ``residual_norm``) or
folded (``rms_fold``: ``mlp_norm`` folded into a derived ``w13``, :func:`.tile_gemm.folded_weight`,
each token's rstd applied to the FP32 sums before the bf16 rounding of gate and up). Selection in
:mod:`.dense_mlp` (``DECODESCOPE_DENSE_TILE``; ``fold`` the default since session 12).
:mod:`.tile_gemm` itself is unchanged.

Fragments: ``ldmatrix`` (``TilePlan.ldsm``) by default here (``DECODESCOPE_TILE_LDSM=0`` or
``ldsm=False``: the plain loads). H200, TP8, h normalized, kernel alone, plain -> ldmatrix: 54.9
-> 41.7 us at 64 tokens (s12/r1) and 52.8 -> 41.6 (s12/r3a); at 8 and 32 tokens no difference
beyond the two runs' order effect (the variant timed first in a row ran ~3 us slower in both:
r1 38.5 -> 35.8 at 8, r3a 35.9 -> 38.7 with the order reversed). Bytes floor 28.9-29.2 us;
cuBLAS's GEMM alone 32.6 / 34.1 / 35.8 at 8 / 32 / 64, plus a SiTU launch 54.3 / 56.4 / 61.2.
"""

# no `from __future__ import annotations`: cute.jit reads the annotations
import os

import cutlass
import cutlass.cute as cute
import torch
from cutlass import BFloat16, Float32

from decodescope.kernels.specialized import env_knobs
from decodescope.kernels.specialized import interface as itf
from decodescope.kernels.specialized import tile_gemm as tg
from decodescope.kernels.specialized.mla_decode_tc import ld_cluster_v4f32, mapa
from decodescope.kernels.specialized.moe_common import situ

COLS = 8  # output columns per 16-row MMA tile (8 gate rows, their 8 up rows)


WGMMA_ENV = "DECODESCOPE_DENSE_TILE_WGMMA"
# the split-K count, forced (unset: the tile GEMM's rule, the fewest splits giving a CTA per SM:
# 2 at TP8, 4 at TP16 with 64 tokens); must divide the 64-wide K chunks (112 at hidden 7168).
# H200 s27/n6, TP16 batch 64, dense layer, same call: 8 splits (264 CTAs, 2 per SM) 98.8 / 99.0
# us against the rule's 4, 92.1 / 92.4: kept for other GPUs' A/Bs, not a default
SPLITS_ENV = "DECODESCOPE_DENSE_TILE_SPLITS"
# the cp.async stages, forced (2..8; unset: the tile GEMM's 4). At 64 tokens a stage is 16 KB of
# weights + 8 KB of activations, and the plans run one CTA per SM (132 CTAs), so up to 8 stages
# fit; ncu s27/n5 (TP16, 64 tokens, folded): 2.33 TB/s, stalls per issue barrier 1.08, wait
# 0.89, long scoreboard 0.78: three chunks (48 KB of weights) in flight per SM are about what
# Little's law asks at ~30 GB/s per SM and ~1.5-2 us of loaded latency
STAGES_ENV = "DECODESCOPE_DENSE_TILE_STAGES"


def wgmma_default() -> bool:
    """``DECODESCOPE_DENSE_TILE_WGMMA``: unset or ``1`` warpgroup MMAs, ``0`` the warps'
    ``mma.sync``, anything else a one-line error."""
    return env_knobs.read(WGMMA_ENV, ("0", "1"), "1") == "1"


def supports(m: int, k: int, dn: int) -> bool:
    """Whether the kernel serves ``m`` tokens, ``K = k``, ``Dn = dn``."""
    return 1 <= m <= 64 and k % tg.BK == 0 and dn % COLS == 0


def row_map(dn: int, cta_rows: int = 4 * tg.WARP_ROWS) -> torch.Tensor:
    """The weight row behind each CTA-local row, for all row CTAs (flat: ``row_ctas *
    cta_rows``), ``-1`` past the end: tile ``t`` of CTA ``b`` holds gate rows ``b * cta_rows / 2
    + 8t ..`` then the same up rows (``+ dn``). The kernel's :meth:`DenseTileGemm.load_w`."""
    half = cta_rows // 2
    ctas = -(-dn // half)
    L = torch.arange(ctas * cta_rows)
    b, loc = L // cta_rows, L % cta_rows
    d = b * half + (loc // 16) * COLS + loc % 8
    w = d + dn * ((loc // 8) % 2)
    return torch.where(d < dn, w, torch.full_like(w, -1))


def plan(m: int, k: int, dn: int, **kw) -> tg.TilePlan:
    """The tile plan of ``m`` tokens, ``K = k``, ``Dn = dn`` (one segment of ``2 dn`` rows);
    ``kw``: :class:`.tile_gemm.TilePlan` flags (``rms_fold``, ``splits_force``, ...)."""
    if not supports(m, k, dn):
        raise ValueError(f"dense tile: m {m} in 1..64, K {k} % {tg.BK}, Dn {dn} % {COLS}")
    if kw.get("ldsm") is None:  # ldmatrix fragments unless DECODESCOPE_TILE_LDSM=0
        kw["ldsm"] = os.environ.get("DECODESCOPE_TILE_LDSM", "") != "0"
    # warpgroup MMAs at every token count (DECODESCOPE_DENSE_TILE_WGMMA, a warpgroup: 4 warps);
    # the cluster split-K by the tile GEMM's rule (TilePlan.cluster left None)
    kw.setdefault("wgmma", wgmma_default() and kw.get("warps", 4) == 4)
    if not kw.get("splits_force"):
        kw["splits_force"] = env_knobs.read(SPLITS_ENV, tuple(range(1, 17))) or 0
    if not kw.get("stages"):
        kw["stages"] = env_knobs.read(STAGES_ENV, tuple(range(2, 9))) or 0
    p = tg.TilePlan(m=m, k=k, segments=(2 * dn,), **kw)
    if p.residual_epilogue or p.out_f32 or p.norm or p.add_residual:
        raise ValueError("dense tile: no residual epilogue, FP32 output, norm launch or residual")
    return p


class DenseTileGemm(tg.TileGemm):
    """:class:`.tile_gemm.TileGemm` with the gate/up row map and the SiTU epilogues."""

    def __init__(self, plan: tg.TilePlan, beta: float, lbeta: float):
        super().__init__(plan)
        self.beta, self.lbeta = float(beta), float(lbeta)

    @cute.jit
    def load_w(self, mW, sW, n, row0, kc, stg, tidx):
        """cp.async of chunk ``kc`` of the CTA's rows (:func:`row_map`; ``n = 2 Dn``, ``row0 =
        cta * cta_rows``) into stage ``stg``; rows of columns ``>= Dn`` are not loaded."""
        p = self.p
        nt = p.threads
        dn = n // 2
        d0 = row0 // 2
        u = tidx % 8
        for i in cutlass.range_constexpr(p.cta_rows * 8 // nt):
            r = tidx // 8 + i * (nt // 8)
            d = d0 + (r // 16) * COLS + r % 8
            if d < dn:
                wr = d + dn * ((r // 8) % 2)
                src = cute.local_tile(mW[wr, None], (8,), (kc * 8 + u,))
                dst = cute.local_tile(sW[stg, r, None], (8,), (self.swz(u, r),))
                cute.arch.inline_ptx(
                    "cp.async.cg.shared.global [{$r0}], [{$r1}], 16;",
                    read_only_args=[dst.iterator, src.iterator],
                )

    @cute.jit
    def store_direct(self, mO, mE, sRs, accs, row0, n, warp, g, c):
        """One split: lane (g, c), tile (q, j): gate (row g) and up (row g + 8) of column
        ``d0 + 8 (2 warp + q) + g``, tokens ``8j + 2c + {0, 1}``: SiTU in registers."""
        p = self.p
        dn = n // 2
        for q in cutlass.range_constexpr(tg.RT):
            # 16-row MMA tile t of the CTA (mma.sync: 2 warp + q; wgmma: 4 q + warp)
            d = row0 // 2 + (self.tile_row(warp, q) // 16) * COLS + g
            if d < dn:
                for j in cutlass.range_constexpr(p.ntiles):
                    for e in cutlass.range_constexpr(2):
                        m = j * 8 + 2 * c + e
                        if m < p.m:
                            gv = accs[q * p.ntiles + j][e]
                            uv = accs[q * p.ntiles + j][2 + e]
                            if cutlass.const_expr(p.rms_fold):
                                rs = cute.math.rsqrt(sRs[m] / Float32(p.k) + Float32(p.eps))
                                gv = gv * rs
                                uv = uv * rs
                            gv = gv.to(BFloat16).to(Float32)
                            uv = uv.to(BFloat16).to(Float32)
                            mO[m, d] = situ(gv, uv, self.beta, self.lbeta).to(BFloat16)

    @cute.jit
    def epilogue_partial(self, mO, mE, mWs, mCnt, bx, cta, n, tidx, sRs=None):
        """The last CTA of row tile ``bx``: per step a thread sums 4 gate rows (``16t + 4h``)
        and their 4 up rows (``+ 8``) of one token over the splits (``epi_batch`` steps' loads
        first), rounds both to bf16 (after the rstd with ``rms_fold``), writes 4 ``act``
        columns ``d0 + 8t + 4h ..``; zeroes the counter."""
        p = self.p
        nt = p.threads
        dn = n // 2
        items = p.cta_rows // 8  # (tile, half) pairs per token
        total = p.m * items
        steps = (total + nt - 1) // nt
        bsz = min(p.epi_batch, steps)
        for b in cutlass.range((steps + bsz - 1) // bsz, unroll=1):
            parts = []
            for t in cutlass.range_constexpr(bsz):
                f = tidx + (b * bsz + t) * nt
                ok = f < total
                fc = cutlass.min(f, total - 1)  # clamped: every load stays in bounds
                m = fc // items
                it = fc % items
                lr = (it // 2) * 16 + (it % 2) * 4  # the gate quad's local row
                gs = []
                us = []
                for s in cutlass.range_constexpr(p.splits):
                    base = (s * p.mp + m) * p.acc_rows + bx * p.cta_rows + lr
                    gs.append(ld_v4(mWs.iterator + base))
                    us.append(ld_v4(mWs.iterator + (base + 8)))
                parts.append((ok, m, it, gs, us))
            for ok, m, it, gs, us in parts:
                d = cta * (p.cta_rows // 2) + (it // 2) * COLS + (it % 2) * 4
                if ok and d < dn:
                    rs = None
                    if cutlass.const_expr(p.rms_fold):
                        rs = sRs[m]
                    ov = self.situ4(gs, us, rs)
                    cute.autovec_copy(ov, cute.local_tile(mO[m, None], (4,), (d // 4,)))
        if tidx == 0:
            mCnt[bx] = cutlass.Int32(0)

    def situ4(self, gs, us, rs):
        """4 ``act`` values from the splits' 4 gate sums ``gs`` and 4 up sums ``us`` (split
        order; ``rs``: the token's rstd with ``rms_fold``): each rounded to bf16, then SiTU
        (trace-time helper of both split-K epilogues)."""
        ov = cute.make_rmem_tensor((4,), BFloat16)
        for e in range(4):
            gv = gs[0][e]
            uv = us[0][e]
            for s in range(1, len(gs)):
                gv = gv + gs[s][e]
                uv = uv + us[s][e]
            if self.p.rms_fold:
                gv = gv * rs
                uv = uv * rs
            gv = gv.to(BFloat16).to(Float32)
            uv = uv.to(BFloat16).to(Float32)
            ov[e] = situ(gv, uv, self.beta, self.lbeta).to(BFloat16)
        return ov

    @cute.jit
    def cl_gather(self, mO, mE, sP, sQ, cta, n, sp, tidx):
        """``cluster`` (:meth:`.tile_gemm.TileGemm.reduce_cluster`): CTA ``sp`` of the cluster
        takes the tokens ``t % splits == sp``; per step a thread sums 4 gate rows and their 4
        up rows of one token over the splits' partial tiles (``ld.shared::cluster``, split
        order), then rounds, applies SiTU and writes 4 ``act`` columns, as
        :meth:`epilogue_partial`."""
        p = self.p
        S = p.splits
        rs_ = p.cta_rows + tg.PART_PAD
        dn = n // 2
        pairs = p.cta_rows // 8  # (tile, half) pairs per token
        per = -(-p.m // S)
        total = per * pairs
        items = []
        for t in cutlass.range_constexpr(-(-total // p.threads)):
            it = tidx + t * p.threads
            m = sp + S * (it // pairs)
            ok = m < p.m  # past the last item m >= splits * per >= p.m
            mc_ = cutlass.min(m, p.mp - 1)
            pr = it % pairs
            lr = (pr // 2) * 16 + (pr % 2) * 4  # the gate quad's local row
            gs = [ld_cluster_v4f32(mapa(sP.iterator + (mc_ * rs_ + lr), r)) for r in range(S)]
            us = [ld_cluster_v4f32(mapa(sP.iterator + (mc_ * rs_ + lr + 8), r)) for r in range(S)]
            rs = self.cl_rstd(sQ, mc_) if p.rms_fold else None
            items.append((ok, m, pr, gs, us, rs))
        cute.arch.cluster_arrive()  # this CTA reads no other's shared memory after this
        for ok, m, pr, gs, us, rs in items:
            d = cta * (p.cta_rows // 2) + (pr // 2) * COLS + (pr % 2) * 4
            if ok and d < dn:
                ov = self.situ4(gs, us, rs)
                cute.autovec_copy(ov, cute.local_tile(mO[m, None], (4,), (d // 4,)))
        cute.arch.cluster_wait()  # nobody exits while another still reads its partials


def ld_v4(ptr):
    """Four FP32 partials (16 bytes, L2: other CTAs wrote them)."""
    return cute.arch.inline_ptx(
        "ld.global.cg.v4.f32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
        write_only_types=[Float32, Float32, Float32, Float32],
        read_only_args=[ptr],
    )


def _fake_args(p: tg.TilePlan):
    """:class:`.tile_gemm.TileGemm`'s arguments with the ``[M, Dn]`` output."""
    a = list(tg._fake_args(p))
    a[2] = itf.fake(torch.bfloat16, (p.m, p.segments[0] // 2))
    return tuple(a)


def compile_plan(p: tg.TilePlan, beta: float, lbeta: float):
    """Compile (cached) the kernel of plan ``p`` (:func:`plan`) and the SiTU betas."""
    key = ("dense_tile", p, float(beta), float(lbeta))
    return itf.compiled(key, lambda: (DenseTileGemm(p, beta, lbeta), _fake_args(p)))


_WS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(p: tg.TilePlan, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (p, str(device))
    ws = _WS.get(key)
    if ws is None:
        cols = p.acc_rows if p.uses_ws else 8
        ws = _WS[key] = (
            torch.zeros(p.ws_rows, cols, dtype=torch.float32, device=device),
            torch.zeros(p.row_ctas, dtype=torch.int32, device=device),
        )
    return ws


def prepare(p: tg.TilePlan, beta: float, lbeta: float, device) -> None:
    """Compile and allocate (before graph capture)."""
    compile_plan(p, beta, lbeta)
    _workspace(p, device)


def dense_gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    act: torch.Tensor,
    situ_betas: tuple[float, float],
    *,
    rms_fold: bool = False,
    eps: float = 1e-5,
    **kw,
) -> None:
    """``act = bf16(situ(bf16(x @ w13[:Dn]^T), bf16(x @ w13[Dn:]^T)))``, one launch. With
    ``rms_fold``, ``w13`` carries the norm weight (:func:`.tile_gemm.folded_weight`) and ``x``
    is the raw input (each token scaled by its rstd). ``kw``: :class:`.tile_gemm.TilePlan`
    flags (``splits_force``, ``warps``, ``stages``, ``pdl``, ``ldsm``, ``epi_batch``)."""
    M, K = x.shape
    dn = w13.shape[0] // 2
    itf.check(x, "dense_gate_up x", (M, K), torch.bfloat16)
    itf.check(w13, "dense_gate_up w13", (2 * dn, K), torch.bfloat16)
    itf.check(act, "dense_gate_up act", (M, dn), torch.bfloat16)
    p = plan(M, K, dn, rms_fold=rms_fold, eps=float(eps), **kw)
    fn = compile_plan(p, *situ_betas)
    ph = itf.placeholder(x.device, tg._PLACEHOLDER)
    ws, cnt = _workspace(p, x.device)
    fn(x, w13, act, ph, ph, ph, ph, ph, ws, cnt)
