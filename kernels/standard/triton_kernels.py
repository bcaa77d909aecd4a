"""Triton kernels of ours for the standard path: where vLLM launches a fused kernel of its own
that vllm 0.24's compiled libraries lack (AttnRes, the fused KDA decode and its TP16 chain,
SiTU-and-mul, the q/kv RMSNorm, the MLA decode) and vLLM's Triton ``fused_moe`` GEMM.

Each ``*_kernel`` is a ``@triton.jit`` body; the Python function of the same name without the
suffix checks shapes and launches it on the current stream (capturable into a CUDA graph: no
host syncs, fixed grids). Importing this module needs ``triton``; the standard path falls back
to torch where it is missing (a CPU). ``TRITON_INTERPRET=1`` runs these kernels on a CPU.
"""

from __future__ import annotations

import math
import os

import triton
import triton.language as tl

# Triton's CPU interpreter multiplies bf16 tiles wrongly (numpy has no bf16): upcast there only
DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"


def _p2(n: int) -> int:
    return triton.next_power_of_2(int(n))


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _tanh(x):
    return 2.0 * _sigmoid(2.0 * x) - 1.0


# -- RMSNorm with optional residual add (AttnRes stand-in, latent norm) ------------------------


@triton.jit
def rmsnorm_kernel(
    x_ptr, r_in_ptr, r_out_ptr, w_ptr, y_ptr, n_cols, sx, sr_in, sr_out, sy, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < n_cols
    x = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_in_ptr + row * sr_in + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(r_out_ptr + row * sr_out + offs, x.to(r_out_ptr.dtype.element_ty), mask=m)
    var = tl.sum(x * x, 0) / n_cols
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt(var + eps)) * w
    tl.store(y_ptr + row * sy + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def rmsnorm(x, w, eps, y, r_in=None, r_out=None):
    """``y = rmsnorm(x [+ r_in]) * w``; with a residual also ``r_out = x + r_in``."""
    M, n = x.shape
    has_res = r_in is not None
    r_in = r_in if has_res else x
    r_out = r_out if has_res else x
    block = _p2(n)
    rmsnorm_kernel[(M,)](
        x, r_in, r_out, w, y, n, x.stride(0), r_in.stride(0), r_out.stride(0), y.stride(0), eps,
        HAS_RES=has_res, BLOCK=block, num_warps=min(16, max(4, block // 512)),
    )  # fmt: skip


@triton.jit
def rmsnorm2_kernel(
    x_ptr, sx, off1, n1, w1_ptr, y1_ptr, sy1, off2, n2, w2_ptr, y2_ptr, sy2, eps,
    B1: tl.constexpr, B2: tl.constexpr,
):  # fmt: skip
    """Two RMSNorms over two column ranges of one row (MLA's q_a and kv_a norms in one kernel)."""
    row = tl.program_id(0).to(tl.int64)
    o1 = tl.arange(0, B1)
    m1 = o1 < n1
    a = tl.load(x_ptr + row * sx + off1 + o1, mask=m1, other=0.0).to(tl.float32)
    wa = tl.load(w1_ptr + o1, mask=m1, other=0.0).to(tl.float32)
    ya = a * (1.0 / tl.sqrt(tl.sum(a * a, 0) / n1 + eps)) * wa
    tl.store(y1_ptr + row * sy1 + o1, ya.to(y1_ptr.dtype.element_ty), mask=m1)
    o2 = tl.arange(0, B2)
    m2 = o2 < n2
    b = tl.load(x_ptr + row * sx + off2 + o2, mask=m2, other=0.0).to(tl.float32)
    wb = tl.load(w2_ptr + o2, mask=m2, other=0.0).to(tl.float32)
    yb = b * (1.0 / tl.sqrt(tl.sum(b * b, 0) / n2 + eps)) * wb
    tl.store(y2_ptr + row * sy2 + o2, yb.to(y2_ptr.dtype.element_ty), mask=m2)


def rmsnorm2(x, off1, n1, w1, y1, off2, n2, w2, y2, eps):
    rmsnorm2_kernel[(x.shape[0],)](
        x, x.stride(0), off1, n1, w1, y1, y1.stride(0), off2, n2, w2, y2, y2.stride(0), eps,
        B1=_p2(n1), B2=_p2(n2), num_warps=4,
    )  # fmt: skip


# -- activations ------------------------------------------------------------------------------


@triton.jit
def act_and_mul_kernel(
    x_ptr, y_ptr, inter, sx, sy, beta, lbeta, SITU: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    g = tl.load(x_ptr + row * sx + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * sx + inter + offs, mask=m, other=0.0).to(tl.float32)
    if SITU:
        y = beta * _tanh(g / beta) * _sigmoid(g) * (lbeta * _tanh(u / lbeta))
    else:
        y = g * _sigmoid(g) * u
    tl.store(y_ptr + row * sy + offs, y.to(y_ptr.dtype.element_ty), mask=m)


def act_and_mul(x, y, situ: bool, beta: float = 4.0, lbeta: float = 25.0):
    """``x [M, 2I]`` (gate then up) -> ``y [M, I]``: SiTU-and-mul (or SiLU-and-mul)."""
    M, inter = y.shape
    block = min(1024, _p2(inter))
    act_and_mul_kernel[(M, triton.cdiv(inter, block))](
        x, y, inter, x.stride(0), y.stride(0), beta, lbeta, SITU=situ, BLOCK=block, num_warps=4
    )


@triton.jit
def gate_mul_kernel(o_ptr, so_h, so_n, g_ptr, sg, y_ptr, sy, V: tl.constexpr):
    """``y[n, h*V + v] = o[h, n, v] * sigmoid(g[n, h*V + v])`` (also transposes o)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, V)
    o = tl.load(o_ptr + h * so_h + n * so_n + offs).to(tl.float32)
    g = tl.load(g_ptr + n * sg + h * V + offs).to(tl.float32)
    tl.store(y_ptr + n * sy + h * V + offs, (o * _sigmoid(g)).to(y_ptr.dtype.element_ty))


def gate_mul(o_hnv, g, y):
    H, N, V = o_hnv.shape
    gate_mul_kernel[(N, H)](
        o_hnv, o_hnv.stride(0), o_hnv.stride(1), g, g.stride(0), y, y.stride(0), V=V, num_warps=1
    )


# -- routing -----------------------------------------------------------------------------------


@triton.jit
def sigmoid_topk_kernel(
    logits_ptr, sl, bias_ptr, ids_ptr, w_ptr, E, scale,
    K: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """noaux_tc routing with one group: top-k of sigmoid(logit) + bias, weights sigmoid(logit)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    m = offs < E
    s = _sigmoid(tl.load(logits_ptr + row * sl + offs, mask=m, other=0.0).to(tl.float32))
    sel = tl.where(m, s + tl.load(bias_ptr + offs, mask=m, other=0.0), float("-inf"))
    ko = tl.arange(0, K)
    ids = tl.zeros((K,), dtype=tl.int32)
    ws = tl.zeros((K,), dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.max(sel, 0)
        idx = tl.min(tl.where(sel == best, offs, BLOCK_E), 0)
        wk = tl.sum(tl.where(offs == idx, s, 0.0), 0)
        ids = tl.where(ko == k, idx, ids)
        ws = tl.where(ko == k, wk, ws)
        sel = tl.where(offs == idx, float("-inf"), sel)
    if RENORM:
        ws = ws / tl.sum(ws, 0)
    tl.store(ids_ptr + row * K + ko, ids)
    tl.store(w_ptr + row * K + ko, ws * scale)


def sigmoid_topk(logits, bias, ids, weights, top_k, renorm, scale):
    N, E = logits.shape
    if top_k != _p2(top_k):
        raise ValueError("sigmoid_topk needs a power-of-two top_k")
    sigmoid_topk_kernel[(N,)](
        logits, logits.stride(0), bias, ids, weights, E, scale,
        K=top_k, RENORM=renorm, BLOCK_E=_p2(E), num_warps=4,
    )  # fmt: skip


# -- fused MoE GEMM (one launch over every selected expert, like vLLM's triton fused_moe) --------


@triton.jit
def fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr, ntp_ptr,
    N, K, num_valid, sam, sak, sbe, sbn, sbk, scm, scn,
    A_DIV: tl.constexpr, MUL_W: tl.constexpr, F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """C[tok, :] = A[tok // A_DIV, :] @ B[e].T for the rows of one expert's padded block.

    ``sorted_ids`` / ``expert_ids`` / ``ntp`` come from moe_align_block_size: rows grouped by
    expert, each expert's group padded to a multiple of BLOCK_M with ``num_valid`` (skipped)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(ntp_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    tmask = tok < num_valid
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (tok // A_DIV)[:, None] * sam + offs_k[None, :] * sak
    b_ptrs = b_ptr + e * sbe + offs_n[None, :] * sbn + offs_k[:, None] * sbk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=tmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b)
        a_ptrs += BLOCK_K * sak
        b_ptrs += BLOCK_K * sbk
    if MUL_W:
        acc *= tl.load(topk_w_ptr + tok, mask=tmask, other=0.0)[:, None]
    c_ptrs = c_ptr + tok[:, None] * scm + offs_n[None, :] * scn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])


@triton.jit
def _e2m1(x):
    """FP4 E2M1 codes (uint8 0..15) -> float32: s eem; 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    e = (x >> 1) & 3
    m = (x & 1).to(tl.float32)
    mag = tl.where(
        e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
    )
    return tl.where((x & 8) != 0, -mag, mag)


@triton.jit
def fused_moe_mxfp4_kernel(
    a_ptr, q_ptr, s_ptr, c_ptr, topk_w_ptr, sorted_ids_ptr, expert_ids_ptr, ntp_ptr,
    N, K, num_valid, sam, sak, sqe, sqn, sse, ssn, scm, scn,
    A_DIV: tl.constexpr, MUL_W: tl.constexpr, F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The fused-MoE GEMM with MXFP4 weights dequantized in the kernel (W4A16, as Hopper serving
    runs them). Packing (ours, see weights.py): per 64-wide K chunk c, byte j (0..31) holds the
    code of k = 64c + j in its low nibble and of k = 64c + 32 + j in its high nibble; one E8M0
    scale per 32 values (group 2c for the low half, 2c + 1 for the high half)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(ntp_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    tmask = tok < num_valid
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    j = tl.arange(0, 32)
    a_rows = a_ptr + (tok // A_DIV)[:, None] * sam
    q_base = q_ptr + e * sqe + offs_n[None, :] * sqn
    s_base = s_ptr + e * sse + offs_n * ssn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 64):
        c = k0 // 64
        p = tl.load(q_base + (c * 32 + j)[:, None], mask=nmask[None, :], other=0)
        s_lo = tl.exp2(tl.load(s_base + 2 * c, mask=nmask, other=127).to(tl.float32) - 127.0)
        s_hi = tl.exp2(tl.load(s_base + 2 * c + 1, mask=nmask, other=127).to(tl.float32) - 127.0)
        w_lo = _e2m1(p & 15) * s_lo[None, :]
        w_hi = _e2m1(p >> 4) * s_hi[None, :]
        a_lo = tl.load(a_rows + (k0 + j)[None, :] * sak, mask=tmask[:, None], other=0.0)
        a_hi = tl.load(a_rows + (k0 + 32 + j)[None, :] * sak, mask=tmask[:, None], other=0.0)
        if F32:
            acc += tl.dot(a_lo.to(tl.float32), w_lo)
            acc += tl.dot(a_hi.to(tl.float32), w_hi)
        else:
            acc += tl.dot(a_lo.to(tl.bfloat16), w_lo.to(tl.bfloat16))
            acc += tl.dot(a_hi.to(tl.bfloat16), w_hi.to(tl.bfloat16))
    if MUL_W:
        acc *= tl.load(topk_w_ptr + tok, mask=tmask, other=0.0)[:, None]
    c_ptrs = c_ptr + tok[:, None] * scm + offs_n[None, :] * scn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=tmask[:, None] & nmask[None, :])


def fused_moe_mxfp4(
    a, q, s, c, topk_w, sorted_ids, expert_ids, ntp, num_valid, a_div, mul_w, m_blocks, config=None
):
    """MXFP4 variant of :func:`fused_moe`: ``q [E, N, K/2]`` uint8, ``s [E, N, K/32]`` E8M0."""
    _, N, K2 = q.shape
    cfg = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, **(config or {})}
    grid = (m_blocks, triton.cdiv(N, cfg["BLOCK_N"]))
    fused_moe_mxfp4_kernel[grid](
        a, q, s, c, topk_w, sorted_ids, expert_ids, ntp, N, 2 * K2, num_valid,
        a.stride(0), a.stride(1), q.stride(0), q.stride(1), s.stride(0), s.stride(1),
        c.stride(0), c.stride(1), A_DIV=a_div, MUL_W=mul_w, F32=DOT_F32, BLOCK_M=16, **cfg,
    )  # fmt: skip


def moe_block_config(num_rows: int, n: int, k: int) -> dict:
    """Block sizes for decode-sized M (rows = tokens x top_k): bytes-bound, so wide in K."""
    return {"BLOCK_M": 16, "BLOCK_N": 64 if n >= 64 else 32, "BLOCK_K": 128 if k >= 128 else 64}


def fused_moe(
    a, w, c, topk_w, sorted_ids, expert_ids, ntp, num_valid, a_div, mul_w, m_blocks, config=None
):
    """``c [num_valid, N]`` rows per (token, k) = expert GEMM; ``w [E, N, K]``. ``config``
    overrides BLOCK_N / BLOCK_K / num_warps / num_stages (BLOCK_M is the align block, 16)."""
    _, N, K = w.shape
    cfg = {**moe_block_config(num_valid, N, K), "num_warps": 4, "num_stages": 3, **(config or {})}
    grid = (m_blocks, triton.cdiv(N, cfg["BLOCK_N"]))
    fused_moe_kernel[grid](
        a, w, c, topk_w, sorted_ids, expert_ids, ntp, N, K, num_valid,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        A_DIV=a_div, MUL_W=mul_w, F32=DOT_F32, **cfg,
    )  # fmt: skip


# -- KDA ---------------------------------------------------------------------------------------


@triton.jit
def kda_conv_kernel(
    proj_ptr, sp, cw_ptr, cs_ptr, scs_b, scs_c, out_ptr, so, T, C, BLOCK: tl.constexpr
):
    """Causal conv (kernel 4) update + SiLU over the first C columns of proj (TP16 chain)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    w0 = tl.load(cw_ptr + c * 4 + 0, mask=m, other=0.0).to(tl.float32)
    w1 = tl.load(cw_ptr + c * 4 + 1, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(cw_ptr + c * 4 + 2, mask=m, other=0.0).to(tl.float32)
    w3 = tl.load(cw_ptr + c * 4 + 3, mask=m, other=0.0).to(tl.float32)
    s = cs_ptr + b * scs_b + c * scs_c
    c0 = tl.load(s + 0, mask=m, other=0.0).to(tl.float32)
    c1 = tl.load(s + 1, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(s + 2, mask=m, other=0.0).to(tl.float32)
    for t in range(T):
        n = b * T + t
        x = tl.load(proj_ptr + n * sp + c, mask=m, other=0.0).to(tl.float32)
        y = w0 * c0 + w1 * c1 + w2 * c2 + w3 * x
        y = y * _sigmoid(y)
        tl.store(out_ptr + n * so + c, y.to(out_ptr.dtype.element_ty), mask=m)
        c0 = c1
        c1 = c2
        c2 = x
    tl.store(s + 0, c0.to(cs_ptr.dtype.element_ty), mask=m)
    tl.store(s + 1, c1.to(cs_ptr.dtype.element_ty), mask=m)
    tl.store(s + 2, c2.to(cs_ptr.dtype.element_ty), mask=m)


@triton.jit
def _conv_step(x, w0, w1, w2, w3, c0, c1, c2):
    y = w0 * c0 + w1 * c1 + w2 * c2 + w3 * x
    return y * _sigmoid(y)


@triton.jit
def kda_decode_kernel(
    proj_ptr, sp, f_ptr, sf, qkv_ptr, sq, cw_ptr, cs_ptr, scs_b, scs_c,
    alog_ptr, dtb_ptr, state_ptr, onw_ptr, out_ptr, so,
    T, D, B_OFF, lower_bound, eps, scale,
    H: tl.constexpr, HD: tl.constexpr, DO_CONV: tl.constexpr, DO_NORM: tl.constexpr,
):  # fmt: skip
    """One (sequence, head): [conv update + SiLU], L2 norm of q and k, decay gate, beta, the
    gated delta rule over T tokens on the FP32 state, [sigmoid-gated RMSNorm]. DO_CONV and
    DO_NORM on: vLLM's fused_kda_decode (TP8); off: the recurrence of the TP16 chain."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // H
    h = pid % H
    ok = tl.arange(0, HD)  # key / channel axis
    ov = tl.arange(0, HD)  # value axis
    cq = h * HD + ok
    if DO_CONV:
        ck = D + cq
        cv = 2 * D + cq
        wq0 = tl.load(cw_ptr + cq * 4 + 0).to(tl.float32)
        wq1 = tl.load(cw_ptr + cq * 4 + 1).to(tl.float32)
        wq2 = tl.load(cw_ptr + cq * 4 + 2).to(tl.float32)
        wq3 = tl.load(cw_ptr + cq * 4 + 3).to(tl.float32)
        wk0 = tl.load(cw_ptr + ck * 4 + 0).to(tl.float32)
        wk1 = tl.load(cw_ptr + ck * 4 + 1).to(tl.float32)
        wk2 = tl.load(cw_ptr + ck * 4 + 2).to(tl.float32)
        wk3 = tl.load(cw_ptr + ck * 4 + 3).to(tl.float32)
        wv0 = tl.load(cw_ptr + cv * 4 + 0).to(tl.float32)
        wv1 = tl.load(cw_ptr + cv * 4 + 1).to(tl.float32)
        wv2 = tl.load(cw_ptr + cv * 4 + 2).to(tl.float32)
        wv3 = tl.load(cw_ptr + cv * 4 + 3).to(tl.float32)
        sqp = cs_ptr + b * scs_b + cq * scs_c
        skp = cs_ptr + b * scs_b + ck * scs_c
        svp = cs_ptr + b * scs_b + cv * scs_c
        q0 = tl.load(sqp + 0).to(tl.float32)
        q1 = tl.load(sqp + 1).to(tl.float32)
        q2 = tl.load(sqp + 2).to(tl.float32)
        k0 = tl.load(skp + 0).to(tl.float32)
        k1 = tl.load(skp + 1).to(tl.float32)
        k2 = tl.load(skp + 2).to(tl.float32)
        v0 = tl.load(svp + 0).to(tl.float32)
        v1 = tl.load(svp + 1).to(tl.float32)
        v2 = tl.load(svp + 2).to(tl.float32)
    s_ptrs = state_ptr + (pid * HD + ok[:, None]) * HD + ov[None, :]
    S = tl.load(s_ptrs)
    a = tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + cq).to(tl.float32)
    if DO_NORM:
        onw = tl.load(onw_ptr + ov).to(tl.float32)
    for t in range(T):
        n = b * T + t
        if DO_CONV:
            xq = tl.load(proj_ptr + n * sp + cq).to(tl.float32)
            xk = tl.load(proj_ptr + n * sp + D + cq).to(tl.float32)
            xv = tl.load(proj_ptr + n * sp + 2 * D + h * HD + ov).to(tl.float32)
            q = _conv_step(xq, wq0, wq1, wq2, wq3, q0, q1, q2)
            k = _conv_step(xk, wk0, wk1, wk2, wk3, k0, k1, k2)
            v = _conv_step(xv, wv0, wv1, wv2, wv3, v0, v1, v2)
            q0 = q1
            q1 = q2
            q2 = xq
            k0 = k1
            k1 = k2
            k2 = xk
            v0 = v1
            v1 = v2
            v2 = xv
        else:
            q = tl.load(qkv_ptr + n * sq + cq).to(tl.float32)
            k = tl.load(qkv_ptr + n * sq + D + cq).to(tl.float32)
            v = tl.load(qkv_ptr + n * sq + 2 * D + h * HD + ov).to(tl.float32)
        q = q * (scale / tl.sqrt(tl.sum(q * q, 0) + 1e-12))
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + 1e-12))
        f = tl.load(f_ptr + n * sf + cq).to(tl.float32) + dtb
        gk = lower_bound * _sigmoid(a * f)
        beta = _sigmoid(tl.load(proj_ptr + n * sp + B_OFF + h).to(tl.float32))
        S = S * tl.exp(gk)[:, None]
        kv = tl.sum(k[:, None] * S, 0)
        u = beta * (v - kv)
        S = S + k[:, None] * u[None, :]
        o = tl.sum(q[:, None] * S, 0)
        if DO_NORM:
            g = tl.load(proj_ptr + n * sp + 3 * D + h * HD + ov).to(tl.float32)
            o = o * (1.0 / tl.sqrt(tl.sum(o * o, 0) / HD + eps)) * onw * _sigmoid(g)
        tl.store(out_ptr + n * so + h * HD + ov, o.to(out_ptr.dtype.element_ty))
    tl.store(s_ptrs, S)
    if DO_CONV:
        tl.store(sqp + 0, q0.to(cs_ptr.dtype.element_ty))
        tl.store(sqp + 1, q1.to(cs_ptr.dtype.element_ty))
        tl.store(sqp + 2, q2.to(cs_ptr.dtype.element_ty))
        tl.store(skp + 0, k0.to(cs_ptr.dtype.element_ty))
        tl.store(skp + 1, k1.to(cs_ptr.dtype.element_ty))
        tl.store(skp + 2, k2.to(cs_ptr.dtype.element_ty))
        tl.store(svp + 0, v0.to(cs_ptr.dtype.element_ty))
        tl.store(svp + 1, v1.to(cs_ptr.dtype.element_ty))
        tl.store(svp + 2, v2.to(cs_ptr.dtype.element_ty))


def kda_decode(proj, f, qkv, conv_w, conv_state, A_log, dt_bias, state, o_norm, out, *,
               T, D, b_off, lower_bound, eps, do_conv, do_norm):  # fmt: skip
    B, H, HD, _ = state.shape
    kda_decode_kernel[(B * H,)](
        proj, proj.stride(0), f, f.stride(0), qkv, qkv.stride(0), conv_w, conv_state,
        conv_state.stride(0), conv_state.stride(1), A_log, dt_bias, state, o_norm, out,
        out.stride(0), T, D, b_off, lower_bound, eps, 1.0 / math.sqrt(HD),
        H=H, HD=HD, DO_CONV=do_conv, DO_NORM=do_norm, num_warps=8,
    )  # fmt: skip


def kda_conv(proj, conv_w, conv_state, out, T, C):
    B = conv_state.shape[0]
    block = 256
    kda_conv_kernel[(B, triton.cdiv(C, block))](
        proj, proj.stride(0), conv_w, conv_state, conv_state.stride(0), conv_state.stride(1),
        out, out.stride(0), T, C, BLOCK=block, num_warps=4,
    )  # fmt: skip


@triton.jit
def gated_rmsnorm_kernel(o_ptr, so, g_ptr, sg, w_ptr, y_ptr, sy, eps, H: tl.constexpr,
                         HD: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    n = pid // H
    h = pid % H
    offs = tl.arange(0, HD)
    o = tl.load(o_ptr + n * so + h * HD + offs).to(tl.float32)
    g = tl.load(g_ptr + n * sg + h * HD + offs).to(tl.float32)
    w = tl.load(w_ptr + offs).to(tl.float32)
    y = o * (1.0 / tl.sqrt(tl.sum(o * o, 0) / HD + eps)) * w * _sigmoid(g)
    tl.store(y_ptr + n * sy + h * HD + offs, y.to(y_ptr.dtype.element_ty))


def gated_rmsnorm(o, g, w, y, H, HD, eps):
    N = o.shape[0]
    gated_rmsnorm_kernel[(N * H,)](
        o, o.stride(0), g, g.stride(0), w, y, y.stride(0), eps, H=H, HD=HD, num_warps=2
    )


# -- MLA ---------------------------------------------------------------------------------------


@triton.jit
def mla_cache_insert_kernel(kv_ptr, skv, pe_ptr, spe, cache_ptr, scb, scs, T, ctx,
                            DL: tl.constexpr, DP: tl.constexpr):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    b = n // T
    t = n % T
    dst = cache_ptr + b * scb + (ctx + t) * scs
    ol = tl.arange(0, DL)
    op = tl.arange(0, DP)
    tl.store(dst + ol, tl.load(kv_ptr + n * skv + ol).to(cache_ptr.dtype.element_ty))
    tl.store(dst + DL + op, tl.load(pe_ptr + n * spe + op).to(cache_ptr.dtype.element_ty))


def mla_cache_insert(kv, pe, cache, T, ctx):
    mla_cache_insert_kernel[(kv.shape[0],)](
        kv, kv.stride(0), pe, pe.stride(0), cache, cache.stride(0), cache.stride(1), T, ctx,
        DL=kv.shape[1], DP=pe.shape[1], num_warps=2,
    )  # fmt: skip


@triton.jit
def mla_decode_split_kernel(
    ql_ptr, sql_n, sql_h, qp_ptr, sqp_n, sqp_h, cache_ptr, scb, scs, po_ptr, plse_ptr,
    T, ctx, H, n_split, chunk, sm_scale,
    DL: tl.constexpr, DP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    F32: tl.constexpr,
):  # fmt: skip
    """Split-KV absorbed MLA decode: one (query row, head block, KV split) per program."""
    n = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    b = n // T
    length = ctx + n % T + 1  # causal among the step's own tokens
    start = sp * chunk
    end = tl.minimum(start + chunk, length)
    oh = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = oh < H
    ol = tl.arange(0, DL)
    op = tl.arange(0, DP)
    ql = tl.load(
        ql_ptr + n * sql_n + oh[:, None] * sql_h + ol[None, :], mask=hm[:, None], other=0.0
    )
    qp = tl.load(
        qp_ptr + n * sqp_n + oh[:, None] * sqp_h + op[None, :], mask=hm[:, None], other=0.0
    )
    if F32:
        ql = ql.to(tl.float32)
        qp = qp.to(tl.float32)
    else:
        ql = ql.to(tl.bfloat16)
        qp = qp.to(tl.bfloat16)
    m_i = tl.zeros((BLOCK_H,), dtype=tl.float32) + float("-inf")
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, DL), dtype=tl.float32)
    base = cache_ptr + b * scb
    for j in range(0, chunk, BLOCK_N):
        os_ = start + j + tl.arange(0, BLOCK_N)
        sm = os_ < end
        kl = tl.load(base + os_[:, None] * scs + ol[None, :], mask=sm[:, None], other=0.0)
        kp = tl.load(base + os_[:, None] * scs + DL + op[None, :], mask=sm[:, None], other=0.0)
        kl = kl.to(ql.dtype)
        kp = kp.to(ql.dtype)
        qk = tl.dot(ql, tl.trans(kl)) + tl.dot(qp, tl.trans(kp))
        qk = tl.where(sm[None, :], qk * sm_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp(qk - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(ql.dtype), kl)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    row = (n * H + oh) * n_split + sp
    tl.store(po_ptr + row[:, None] * DL + ol[None, :], o, mask=hm[:, None])
    tl.store(plse_ptr + row, lse, mask=hm)


@triton.jit
def mla_decode_combine_kernel(po_ptr, plse_ptr, out_ptr, so_h, so_n, H, n_split,
                              DL: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    osp = tl.arange(0, BLOCK_S)
    sm = osp < n_split
    row = (n * H + h) * n_split + osp
    lse = tl.load(plse_ptr + row, mask=sm, other=float("-inf"))
    mx = tl.max(lse, 0)
    w = tl.where(sm, tl.exp(lse - mx), 0.0)
    w = w / tl.sum(w, 0)
    ol = tl.arange(0, DL)
    po = tl.load(po_ptr + row[:, None] * DL + ol[None, :], mask=sm[:, None], other=0.0)
    o = tl.sum(po * w[:, None], 0)
    tl.store(out_ptr + h * so_h + n * so_n + ol, o.to(out_ptr.dtype.element_ty))


def mla_num_splits(n_rows: int, heads: int, length: int, sms: int = 132) -> int:
    hb = triton.cdiv(heads, 16)
    want = max(1, (2 * sms) // max(1, n_rows * hb))
    return int(max(1, min(want, triton.cdiv(length, 64), 32)))


def mla_decode(q_lat, q_pe, cache, part_o, part_lse, out_hnl, *, T, ctx, sm_scale, n_split):
    """``q_lat [N, H, 512]`` and ``q_pe [N, H, 64]`` (any strides with unit last dim) against
    ``cache [B, rows, 576]``; writes ``out_hnl [H, N, 512]`` (the W_UV bmm's input layout)."""
    N, H, DL = q_lat.shape
    DP = q_pe.shape[2]
    length = ctx + T
    chunk = triton.cdiv(length, n_split)
    block_h = 16
    mla_decode_split_kernel[(N, triton.cdiv(H, block_h), n_split)](
        q_lat, q_lat.stride(0), q_lat.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
        cache, cache.stride(0), cache.stride(1), part_o, part_lse, T, ctx, H, n_split, chunk,
        sm_scale, DL=DL, DP=DP, BLOCK_H=block_h, BLOCK_N=32, F32=DOT_F32, num_warps=8, num_stages=2,
    )  # fmt: skip
    mla_decode_combine_kernel[(N, H)](
        part_o, part_lse, out_hnl, out_hnl.stride(0), out_hnl.stride(1), H, n_split,
        DL=DL, BLOCK_S=_p2(max(2, n_split)), num_warps=4,
    )  # fmt: skip
