"""o_proj + residual add in one launch: ``r' = bf16(bf16(o @ Wo^T) + r)``.

The next RMSNorm (the MoE block's input norm) needs the whole 7168-wide row, which the 448 CTAs
of this GEMM each hold only 16 columns of. Two ways to fuse it: a grid-wide step (every CTA
waits on a counter, then one pass normalizes: a serialization point inside the launch), or let
the consumer recompute the per-token rstd in its prologue from ``r'`` (M x 14 KB from L2 per
CTA). We take the second, as :mod:`.norm_qkv_proj` does for the attention input: the MoE
kernels read ``r'`` and normalize it themselves, so this kernel writes only the new residual
stream and the layer has no separate norm launch. With more than one GPU the all-reduce goes
between the GEMM and the add (not fused yet: one GPU runs the per-rank shapes).

MLA also runs its ``q_b`` projection through the same kernel family (:func:`q_b_proj`): the
q_a RMSNorm is that launch's prologue (skinny / split-K), or folded into the tile GEMM
(from 16 tokens by default, ``tile_gemm.folds``: the norm weight in a derived q_b weight, rstd in the
epilogue; :func:`fold_prepare` makes the weight before capture).
"""

from __future__ import annotations

import torch

from decodescope.kernels.specialized.skinny_gemm import skinny_gemm_ref
from decodescope.kernels.specialized.tile_gemm import TilePlan, folded_weight, gemm_plan, project


def plan_for(cfg, kind: str, m: int):
    k = cfg.kda_dim if kind == "kda" else cfg.mla_v_dim
    return gemm_plan(m, k, (cfg.hidden,), residual_epilogue=True, eps=cfg.eps)


OPROJ_NORM_ENV = "DECODESCOPE_OPROJ_NORM"
# off: H200 s17/r2 (TP8 batch 1, bench shares) o_proj + norm 6.4 -> 6.7 us fused, but the MoE
# front after it 20.5 -> 26.4 (its pre-wait weight stream no longer runs beside a one-CTA norm);
# projected step 10.59 -> 11.09 ms. Kernel alone: GEMV + norm 8.25, fused 8.98 us.
OPROJ_NORM_DEFAULT = "0"


def norm_fused_plan(cfg, kind: str, m: int):
    """The :class:`.gemv_stream.GemvStreamNorm` plan that runs o_proj, the residual add and
    the MoE block's input RMSNorm as one launch (``DECODESCOPE_OPROJ_NORM=1``; unset:
    ``OPROJ_NORM_DEFAULT``), or None: the knob off, or o_proj at ``m`` tokens not on
    :mod:`.gemv_stream` (1 token by default)."""
    from decodescope.kernels.specialized import env_knobs
    from decodescope.kernels.specialized import gemv_stream as gs
    from decodescope.kernels.specialized.skinny_gemm import GemmPlan

    if env_knobs.read(OPROJ_NORM_ENV, ("0", "1"), OPROJ_NORM_DEFAULT) != "1":
        return None
    p = plan_for(cfg, kind, m)
    if not isinstance(p, GemmPlan) or not p.gemv:
        return None
    return gs.norm_plan(gs.from_gemm_plan(p))


def oproj_residual_norm(cfg, w: dict, plan, o, r, r_out, h_out) -> None:
    """``r_out = bf16(o @ o_proj^T) + r`` and ``h_out = rmsnorm(r_out) * mlp_norm`` in one
    launch of ``plan`` (:func:`norm_fused_plan`); ``r_out`` may alias ``r``."""
    from decodescope.kernels.specialized import gemv_stream as gs

    gs.gemv_norm(plan, o, w["o_proj"], r_out, r, w["mlp_norm"], h_out)


# off by default: H200 s17/r3 (TP8 batch 1, bench shares) 512 B per slice took the MoE front
# 20.8 -> 19.7 us but the MLA decode running beside the prefetches 15.4 -> 18.1; step 10.59 ->
# 10.64 ms
OPROJ_PREFETCH_ENV = "DECODESCOPE_OPROJ_PREFETCH"
PREFETCH_CHOICES = ("0", "128", "256", "384", "512", "768", "1024")


def prefetch_bytes() -> int:
    """``DECODESCOPE_OPROJ_PREFETCH``: bytes per K slice (of 8) of every row of the MoE front's
    weight that the o_proj GEMV prefetches into L2 before its PDL wait (unset or 0: none)."""
    from decodescope.kernels.specialized import env_knobs

    return int(env_knobs.read(OPROJ_PREFETCH_ENV, PREFETCH_CHOICES, "0"))


OPROJ_PREFETCH_EVICT_ENV = "DECODESCOPE_OPROJ_PREFETCH_EVICT"


def prefetch_evict_last() -> bool:
    """``DECODESCOPE_OPROJ_PREFETCH_EVICT``: ``normal`` (unset: the prefetches as before) or
    ``last`` (with an ``evict_last`` L2 cache policy, what may keep the lines through o_proj's
    own stream until the front reads them). H200 session 37 (part 50, TP16 batch 1, 512 B and a
    30 MB set-aside): the front -0.8 us, the MLA decode beside the prefetches +2.2, the MLA
    layer +1.6: not kept."""
    from decodescope.kernels.specialized import env_knobs

    return env_knobs.read(OPROJ_PREFETCH_EVICT_ENV, ("normal", "last"), "normal") == "last"


def prefetch_plan(cfg, kind: str, m: int, w_next: torch.Tensor | None):
    """The :class:`.gemv_stream.GemvStreamPre` plan of o_proj at ``m`` tokens prefetching the
    first :func:`prefetch_bytes` of each eighth of every row of ``w_next`` (the MoE front's
    packed weight: :class:`.front_mma.FrontMma`'s 8 warps start their K walks there), or None:
    the knob off, no next weight, or o_proj not on :mod:`.gemv_stream`."""
    from decodescope.kernels.specialized import gemv_stream as gs
    from decodescope.kernels.specialized.skinny_gemm import GemmPlan

    nb = prefetch_bytes()
    if not nb or w_next is None or w_next.dim() != 2:
        return None
    p = plan_for(cfg, kind, m)
    if not isinstance(p, GemmPlan) or not p.gemv:
        return None
    rows, k = (int(v) for v in w_next.shape)
    if k % 8 or nb > k * 2 // 8:
        return None
    return gs.pre_plan(gs.from_gemm_plan(p), rows, k, nb, last=prefetch_evict_last())


def oproj_residual(cfg, w: dict, o, r, r_out) -> None:
    """``r_out = bf16(o @ o_proj^T) + r`` (bf16). ``r_out`` may alias ``r``: each element is
    read and then written by the same thread."""
    project(o, [w["o_proj"]], [r_out], epilogue_residual=r, eps=cfg.eps)


def oproj_residual_ref(cfg, w: dict, o, r):
    outs, _ = skinny_gemm_ref(o, [w["o_proj"]], epilogue_residual=r)
    return outs[0]


def q_b_plan(cfg, m: int):
    mla = cfg.mla
    return gemm_plan(
        m,
        mla.q_lora_rank,
        (cfg.mla_q_b_out,),
        norm=True,
        x_stride=cfg.mla_qkv_a_out,
        eps=cfg.eps,
    )


def fold_prepare(cfg, w: dict, kind: str, m: int) -> None:
    """Before graph capture: the derived weights (``bf16(W * norm weight)``) of every projection
    whose plan at ``m`` tokens folds its RMSNorm into the tile GEMM (``DECODESCOPE_TILE_NORM``:
    ``fold`` q_b, ``fold_all`` also the input projections); :func:`.tile_gemm.folded_weight`
    keeps one per weight tensor while it lives, so the launches find them made."""
    from decodescope.kernels.specialized import norm_qkv_proj as nqp

    p = nqp.plan_for(cfg, kind, m)
    if isinstance(p, TilePlan) and p.rms_fold:
        for wt in nqp.weights_for(w, kind):
            folded_weight(wt, w["attn_norm"])
    if kind == "mla":
        p = q_b_plan(cfg, m)
        if isinstance(p, TilePlan) and p.rms_fold:
            folded_weight(w["q_b"], w["q_a_norm"])


def q_b_proj(cfg, w: dict, a: torch.Tensor, q_out: torch.Tensor) -> None:
    """``q = rmsnorm(q_a) * q_a_norm @ q_b^T`` with ``q_a = a[:, :q_lora]`` (a strided view);
    where ``tile_gemm.folds`` says so (from 16 tokens by default) one tile GEMM launch on the
    folded weight."""
    q_a = a[:, : cfg.mla.q_lora_rank]
    project(q_a, [w["q_b"]], [q_out], norm_weight=w["q_a_norm"], eps=cfg.eps)


def q_b_proj_ref(cfg, w: dict, a):
    q_a = a[:, : cfg.mla.q_lora_rank]
    outs, _ = skinny_gemm_ref(q_a, [w["q_b"]], norm_weight=w["q_a_norm"], eps=cfg.eps)
    return outs[0]
