"""tp_world 2: route a :class:`~decodescope.kernels.specialized.step.SpecializedModel`'s
reductions through the fused peer-memory kernels (``oproj_allreduce``, ``moe_allreduce``).

Per layer, on both ranks:

- attention: the ``o_proj`` launch (single-GPU: GEMM + residual epilogue) becomes
  ``o_proj+allreduce+residual`` (:func:`.oproj_allreduce.oproj_allreduce`): the partial sums of
  the two ranks' head shards are exchanged over NVLink in the GEMM's epilogue; while the peer's
  tile travels, each CTA prefetches a share of the MoE front kernel's packed weights into L2;
- MoE: the back end ``latent_norm+latent_up+add`` becomes
  ``latent_allreduce+latent_norm+latent_up+shared_allreduce+add``
  (:func:`.moe_allreduce.moe_allreduce`), prefetching the next layer's first GEMM weights;
  from 8 tokens (where the single-GPU back end is ``BackMma``, :func:`moe_back_unfused`) two
  NCCL all-reduces + the single-GPU back end instead (``install_nccl``'s launches);
- dense MLP (K3's layer 0): the ``down`` launch becomes ``down+allreduce``: the o_proj fused
  kernel on the dense down projection (``act @ dense_w2^T``, row-parallel like o_proj) with a
  zero residual, so it writes ``bf16(P_0 + P_1)``, the all-reduced MLP output (the next layer's
  ``input_residual_norm`` adds it to the residual stream, as at tp_world 1).

:func:`precompile` compiles the fused kernels a model will launch: call it on both ranks, then
a barrier, before the first step (a rank still compiling while its peer spins would let the
peer's 2-second spin time out).

Launch counts do not change (the reductions ride inside existing launches). Both ranks must
build the same layers and run the same steps (every launch pairs with the peer's). Weights
are the caller's: at tp_world 2 each rank holds its own o_proj / expert shards and the same
replicated weights.
"""

from __future__ import annotations

import torch

from decodescope.kernels.specialized import comm
from decodescope.kernels.specialized import moe_allreduce as _ma
from decodescope.kernels.specialized import oproj_allreduce as _oa

OP_OPROJ = "o_proj+allreduce+residual"
OP_BACK = "latent_allreduce+latent_norm+latent_up+shared_allreduce+add"
OP_DENSE_DOWN = "down+allreduce"  # dense MLP's down projection + all-reduce (block "mlp")
PREFETCH_BYTES = 16 << 20  # at most this much of the next op's weights per prefetch


def _head(t: torch.Tensor | None, nbytes: int = PREFETCH_BYTES) -> torch.Tensor | None:
    """The first ``nbytes`` of a weight tensor as a flat contiguous view (what to prefetch)."""
    if t is None:
        return None
    flat = t.reshape(-1)
    n = max(1, min(flat.numel(), nbytes // flat.element_size()))
    return flat[:n]


def _first_gemm_weight(w: dict) -> torch.Tensor | None:
    for k in ("in_proj", "qkv_a", "w13_dense", "w13"):
        if k in w:
            return w[k]
    return None


def install(model, ws: comm.PeerWorkspace) -> None:
    """Patch ``model`` (a SpecializedModel built with tp_world 2 per-rank weights) in place."""
    n = len(model.specs)
    dense = getattr(model, "dense", [None] * n)
    for i in range(n):
        attn, moe, mlp = model.attn[i], model.moe[i], dense[i]
        following = _head(_first_gemm_weight(model.weights[i + 1])) if i + 1 < n else None
        if moe is not None:
            nxt = _head(moe.w_front)
        elif mlp is not None:
            nxt = _head(mlp.w["dense_w13"])
        else:
            nxt = None
        _patch_attn(attn, ws, nxt)
        if moe is not None:
            _patch_moe(moe, ws, following)
        if mlp is not None:
            _patch_dense(mlp, ws, following)
    model.tp2_workspace = ws


def _patch_dense(mlp, ws, prefetch) -> None:
    """``down`` -> ``down+allreduce``: the o_proj fused kernel with a zero residual."""
    orig = mlp.stages
    mlp.zero_residual = torch.zeros(mlp.N, mlp.cfg.hidden, dtype=torch.bfloat16,
                                    device=mlp.act.device)  # fmt: skip

    def stages(r, x_out):
        out = []
        for op, fn in orig(r, x_out):
            if op == "down":
                op = OP_DENSE_DOWN
                fn = lambda x_out=x_out: _oa.oproj_allreduce(  # noqa: E731
                    ws, mlp.act, mlp.w["dense_w2"], mlp.zero_residual, x_out, prefetch=prefetch
                )
            out.append((op, fn))
        return out

    mlp.stages = stages


# -- allreduce=nccl: explicit NCCL all-reduce launches (the fallback, recorded as such) ---------

NCCL_OPS = {  # launch -> the launches that replace it (step.Plan.op_names uses the same)
    "attn.o_proj": ("attn.o_proj", "attn.allreduce", "attn.residual_add"),
    "moe.latent_norm+latent_up+add": (  # one all-reduce of MoeBlock.acc_shared
        "moe.latent_allreduce+shared_allreduce",
        "moe.latent_norm+latent_up+add",
    ),
    "mlp.down": ("mlp.down", "mlp.allreduce"),
}
NCCL_IMPL = {"allreduce": "torch.distributed:nccl", "residual_add": "torch:add"}
OP_LATENT_SHARED_AR = "latent_allreduce+shared_allreduce"  # the MoE block's one NCCL launch


def install_nccl(model) -> None:
    """tp_world 2 without the fused kernels: every reduction as an explicit ``dist.all_reduce``
    launch on the default process group (NCCL; captured into the step's graph like any kernel),
    the single-GPU kernels unchanged around it. o_proj runs with a zero residual into a buffer,
    which is all-reduced, then ``r_out = y + r`` (``attn.residual_add``, one torch launch); the
    MoE's FP32 routed sum and shared-expert output are all-reduced before its back-end kernel;
    the dense MLP's output after its down projection."""
    import torch.distributed as dist

    from decodescope.kernels.specialized import oproj_residual_norm as _op

    dense = getattr(model, "dense", [None] * len(model.specs))
    for attn, moe, mlp in zip(model.attn, model.moe, dense, strict=True):
        _nccl_attn(attn, _op, dist)
        if moe is not None:
            _nccl_moe(moe, dist)
        if mlp is not None:
            _nccl_dense(mlp, dist)
    model.tp2_workspace = None
    model.tp2_allreduce = "nccl"


def _nccl_attn(attn, _op, dist) -> None:
    attn.norm_plan = None  # o_proj and the RMSNorm stay two launches (the all-reduce between)
    attn.pre_plan = None
    orig = attn.stages
    y = torch.empty_like(attn.r_mid)
    zero = torch.zeros_like(attn.r_mid)
    attn.nccl_partial = y

    def stages(x_in, r_in, r_out, h_out):
        out = []
        for op, fn in orig(x_in, r_in, r_out, h_out):
            if op == "o_proj":
                out += [
                    ("o_proj", lambda: _op.oproj_residual(attn.cfg, attn.w, attn.o, zero, y)),
                    ("allreduce", lambda: dist.all_reduce(y)),
                    ("residual_add", lambda r_out=r_out: torch.add(y, attn.r_mid, out=r_out)),
                ]
            else:
                out.append((op, fn))
        return out

    attn.stages = stages


def _nccl_moe(moe, dist) -> None:
    """The MoE back end after NCCL all-reduces of the routed latent sum and the shared output:
    one all-reduce where the block holds both in one buffer (``MoeBlock.acc_shared``), else
    two."""
    orig = moe.back
    both = getattr(moe, "acc_shared", None)
    one = both is not None and _views_of(both, moe.acc, moe.shared_out)

    def back(out: torch.Tensor) -> None:
        if one:
            with moe._r(OP_LATENT_SHARED_AR):
                dist.all_reduce(both)
        else:
            with moe._r("latent_allreduce"):
                dist.all_reduce(moe.acc)
            with moe._r("shared_allreduce"):
                dist.all_reduce(moe.shared_out)
        orig(out)

    moe.back = back


def _views_of(buf: torch.Tensor, *parts: torch.Tensor) -> bool:
    """Whether ``parts`` are contiguous and tile ``buf`` exactly, in order."""
    ptr, size = buf.data_ptr(), buf.element_size()
    for p in parts:
        if not p.is_contiguous() or p.data_ptr() != ptr or p.dtype != buf.dtype:
            return False
        ptr += p.numel() * size
    return ptr == buf.data_ptr() + buf.numel() * size


def _nccl_dense(mlp, dist) -> None:
    orig = mlp.stages

    def stages(r, x_out):
        out = []
        for op, fn in orig(r, x_out):
            out.append((op, fn))
            if op == "down":
                out.append(("allreduce", lambda x_out=x_out: dist.all_reduce(x_out)))
        return out

    mlp.stages = stages


def fused_plans(model, sms: int | None = None) -> list:
    """The fused kernels' plans (``OProjARPlan`` / ``MoeARPlan``) ``model`` launches at tp_world
    2, from its tensors' shapes (the keys the launches compile under)."""
    from decodescope.kernels.specialized.router_topk import pdl_enabled

    sms = sms if sms is not None else _oa.device_sms(model.device)
    dense = getattr(model, "dense", [None] * len(model.specs))
    plans: list = []
    for attn, moe, mlp in zip(model.attn, model.moe, dense, strict=True):
        n, k = attn.w["o_proj"].shape
        plans.append(_oa.OProjARPlan(m=model.N, k=k, n=n, sms=sms))
        if mlp is not None:
            n, k = mlp.w["dense_w2"].shape
            plans.append(_oa.OProjARPlan(m=model.N, k=k, n=n, sms=sms))
        if moe is not None and not moe_back_unfused(*moe.acc.shape, moe.latent_up.shape[0]):
            T, L = moe.acc.shape
            H = moe.latent_up.shape[0]
            plans.append(_ma.MoeARPlan(T, L, H, float(moe.cfg.eps), True, sms, pdl_enabled()))
    return list(dict.fromkeys(plans))


def precompile(model) -> int:
    """Compile every fused kernel ``model`` launches (no launch); returns how many plans."""
    plans = fused_plans(model)
    for p in plans:
        (_oa.compile_plan if isinstance(p, _oa.OProjARPlan) else _ma.compile_plan)(p)
    return len(plans)


def _patch_attn(attn, ws, prefetch) -> None:
    attn.norm_plan = None  # the fused o_proj all-reduce kernel replaces o_proj alone
    attn.pre_plan = None
    orig = attn.stages

    def stages(x_in, r_in, r_out, h_out):
        out = []
        for op, fn in orig(x_in, r_in, r_out, h_out):
            if op == "o_proj":
                op = OP_OPROJ
                fn = lambda r_out=r_out: _oa.oproj_allreduce(  # noqa: E731
                    ws, attn.o, attn.w["o_proj"], attn.r_mid, r_out, prefetch=prefetch
                )
            out.append((op, fn))
        return out

    attn.stages = stages


MOE_BACK_OP = "moe.latent_norm+latent_up+add"


def moe_back_unfused(T: int, L: int, H: int) -> bool:
    """At tp_world 2 the MoE back end stays unfused (two NCCL all-reduces + the single-GPU back
    end, as ``install_nccl`` does) where the single-GPU back end is ``BackMma`` or the tile back
    (tensor cores, from 8 tokens): on two H200 (run s6r2, notes/tp2_fused.md) the fused kernel, built on the
    SIMT ``up_proj_shared_add``, took 376 us (LL) at 64 tokens against BackMma's 61.7 us on one
    GPU plus two all-reduces."""
    from decodescope.kernels.specialized import back_mma as _bm

    # below 8 tokens the fused kernel stays (BackMma serves 1..7 tokens on one GPU only since
    # session 7; the unfused path there is unmeasured at tp_world 2)
    return T >= 8 and _bm.back_variant(T, L, H) in ("mma", "tile")


def _patch_moe(moe, ws, prefetch) -> None:
    if moe_back_unfused(moe.N, moe.cfg.expert_dim, moe.cfg.hidden):
        import torch.distributed as dist

        _nccl_moe(moe, dist)
        return

    def back(out: torch.Tensor) -> None:
        with moe._r(OP_BACK):
            _ma.moe_allreduce(ws, moe.acc, moe.latent_norm, moe.latent_up, moe.shared_out, out,
                              moe.cfg.eps, prefetch=prefetch)  # fmt: skip

    moe.back = back
