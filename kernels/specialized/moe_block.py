"""The specialized LatentMoE block: three CuTe DSL launches per layer (standard path: 12-14).

=====  ==========================================================  ===========================
 #      range (``layer.{i}.moe.<ops>``)                              kernel
=====  ==========================================================  ===========================
 1      ``router+latent_down+shared_experts``                        ``router_topk.FrontGemv``:
        (router logits, latent z, shared gate/up; zeroes the          one GEMV over the packed
        routed-sum buffer and the expert counters)                    [router; latent_down;
                                                                      shared_w13] rows
 2      ``grouped_topk+align+routed_experts+shared_experts+topk_sum`` ``moe_experts.MoeExperts``:
                                                                      persistent, top-k in its
                                                                      prologue
 3      ``latent_norm+latent_up+add``                                ``up_proj_shared_add``
=====  ==========================================================  ===========================

From 8 tokens on, kernel 1 is ``front_mma.FrontMma`` (the same outputs on tensor cores;
``DECODESCOPE_MOE_FRONT`` picks; from 32 tokens with the grouped experts
``front_mma.front_tile`` on the tile GEMM, which zeroes nothing, so only there: their route
kernel then zeroes ``acc``); kernel 3 is ``back_mma.BackMma`` below 32 tokens and
``back_tile.back_tile`` (the tile GEMM) from 32 on (``DECODESCOPE_MOE_BACK=auto|mma|simt|tile``,
default auto); kernel 2 is
``moe_experts.MoeExpertsPipe`` below 8 tokens and ``MoeExperts`` from 8 on
(``DECODESCOPE_MOE_EXPERTS`` picks; ``grouped``: the three non-persistent tensor-core
launches of ``moe_grouped`` instead, route / w13 + SiTU / w2 + weighted sum, in the same range).

``chunk`` (tokens per front / back launch, a divisor of ``n_tokens``; default all of them):
a chunked step's block over more tokens than those kernels take (64) runs kernel 1 and kernel 3
once per row chunk (row views, same ranges) and the expert kernels (the grouped ones only) once
over all rows, reading each selected expert's weights once.

``wide`` (a chunked step's token-parallel ops once over all rows, ``step.tokens_once``): the
front is one cuBLAS GEMM over all rows into the FP32 ``y_front`` (:func:`.tile_gemm.mm_f32`; like
the ``tile`` front it zeroes nothing, the grouped route kernel zeroes ``acc``) and the back two
launches over all rows (``DECODESCOPE_WIDE_BACK=addmm``, :func:`wide_back`, the default since
session 39): the latent RMSNorm of the FP32 sum (:mod:`.rmsnorm`), which also rounds the shared
experts' FP32 sum into the output, then the up-projection (cuBLAS) adding into it in its
epilogue. With the grouped experts: 6 launches for any number of rows.
``DECODESCOPE_WIDE_BACK=add``: the back in three launches (the up-projection with FP32 output,
then the shared-expert add rounded once to BF16, ``torch.add``), 7 in all.

``forward_residual`` runs kernel 1 with the layer's post-attention residual-add + RMSNorm in
its prologue (range ``residual_norm+router+latent_down+shared_experts``): the attention side
then drops its ``residual_norm`` launch.

``shared_experts`` appears in ranges 1 and 2: its gate_up GEMM rides with the router (same
input), its activation and down GEMM run inside the expert kernel beside the routed tiles.
Everything runs on torch's current stream, with fixed buffers, no host sync: one CUDA graph.
"""

from __future__ import annotations

import os

import torch

from decodescope.kernels.config import Config
from decodescope.kernels.specialized import back_mma as _bm
from decodescope.kernels.specialized import back_tile as _bt
from decodescope.kernels.specialized import env_knobs as _ek
from decodescope.kernels.specialized import front_mma as _fm
from decodescope.kernels.specialized import gemv_stream as _gs
from decodescope.kernels.specialized import moe_experts as _me
from decodescope.kernels.specialized import moe_grouped as _mg
from decodescope.kernels.specialized import router_topk as _rt
from decodescope.kernels.specialized import tile_gemm as _tg
from decodescope.kernels.specialized import up_proj_shared_add as _up
from decodescope.tracer import range as _range

BF16 = torch.bfloat16
F32 = torch.float32

OPS = (
    "router+latent_down+shared_experts",
    "grouped_topk+align+routed_experts+shared_experts+topk_sum",
    "latent_norm+latent_up+add",
)
# the front kernel with the post-attention (residual-add +) RMSNorm fused in
OP_FRONT_NORM = "residual_norm+router+latent_down+shared_experts"

WIDE_BACK_ENV = "DECODESCOPE_WIDE_BACK"
WIDE_BACK = ("add", "addmm")


def wide_back() -> str:
    """The ``wide`` back's form (``DECODESCOPE_WIDE_BACK``, read at each call): ``addmm`` (the
    default since session 39, measured in part 52) two launches, the RMSNorm launch also rounding the shared
    experts' FP32 sum into ``out`` (:attr:`.rmsnorm.NormPlan.side`), then one cuBLAS GEMM adding
    into ``out`` in its epilogue (``bf16(acc + bf16(shared))``: the shared sum rounded first, as
    vLLM adds its BF16 shared output); ``add`` three, the latent RMSNorm, cuBLAS with FP32
    output, the shared add rounded once (``bf16(y + shared)``)."""
    return str(_ek.read(WIDE_BACK_ENV, WIDE_BACK, "addmm"))


def wide_back_launches() -> int:
    """Launches of the ``wide`` back (:func:`wide_back`)."""
    return 2 if wide_back() == "addmm" else 3


def _check_cfg(cfg: Config) -> None:
    e = cfg.moe
    if not e.latent_dim or not cfg.shared_inter:
        raise ValueError("the specialized MoE block needs LatentMoE with shared experts")
    if e.n_group != 1 or e.scoring != "sigmoid" or e.activation != "situ":
        raise ValueError("the specialized MoE block implements sigmoid routing (one group), SiTU")


class SpecializedMoE:
    """One layer's LatentMoE block for ``n_tokens`` rows; owns its packed weights and buffers."""

    def __init__(
        self,
        cfg: Config,
        w: dict[str, torch.Tensor],
        n_tokens: int,
        layer: int = 0,
        device: torch.device | str | None = None,
        chunk: int | None = None,
        wide: bool = False,
    ):
        _check_cfg(cfg)
        e = cfg.moe
        dev = torch.device(device) if device is not None else w["router"].device
        self.cfg, self.layer, self.N = cfg, layer, n_tokens
        # tokens per launch of the front and back kernels (which take at most 64): with fewer
        # than N they run once per row chunk, the expert kernels once over all N rows
        self.Nc = n_tokens if chunk is None else int(chunk)
        if not 1 <= self.Nc <= n_tokens or n_tokens % self.Nc:
            raise ValueError(f"SpecializedMoE: chunk {chunk} must divide n_tokens {n_tokens}")
        N, H, E, k = n_tokens, cfg.hidden, e.num_experts, e.top_k
        L, Ie, S = cfg.expert_dim, cfg.expert_inter, cfg.shared_inter
        self.w_front = _rt.pack_front_weights(w).to(dev)
        self.bias = w["router_bias"].to(dev, F32).contiguous()
        self.w13 = w["w13"].to(dev, BF16).contiguous()
        self.w2 = w["w2"].to(dev, BF16).contiguous()
        self.shared_w2 = w["shared_w2"].to(dev, BF16).contiguous()
        self.latent_norm = w["latent_norm"].to(dev, BF16).contiguous()
        self.latent_up = w["latent_up"].to(dev, BF16).contiguous()
        self.mlp_norm = w["mlp_norm"].to(dev, BF16).contiguous() if "mlp_norm" in w else None
        self.y_front = torch.empty(N, E + L + 2 * S, dtype=F32, device=dev)
        # the routed latent sum and the shared experts' output, adjacent in one FP32 buffer: at
        # tp_world 2 one all-reduce of ``acc_shared`` sums both (tp2._nccl_moe)
        self.acc_shared = torch.empty(N * (L + H), dtype=F32, device=dev)
        self.acc = self.acc_shared[: N * L].view(N, L)
        self.done = torch.empty(E, dtype=torch.int32, device=dev)
        self.h = torch.empty(N * k, Ie, dtype=BF16, device=dev)
        self.shared_out = self.acc_shared[N * L :].view(N, H)
        self.topk_ids = torch.empty(N, k, dtype=torch.int32, device=dev)
        self.topk_weights = torch.empty(N, k, dtype=F32, device=dev)
        self.top_k = k
        self.scaling = float(e.routed_scaling)
        self.beta, self.lbeta = float(cfg.model.situ_beta), float(cfg.model.situ_linear_beta)
        # front and back once over all N rows on cuBLAS (chunk is then moot)
        self.wide = bool(wide)
        if self.wide:
            wide_back()  # a bad DECODESCOPE_WIDE_BACK fails here, not inside a step
            self.Nc = N
            self.y_up = torch.empty(N, H, dtype=F32, device=dev)  # the up-projection, FP32

    def _r(self, op: str):
        return _range(f"layer.{self.layer}.moe.{op}")

    def _grouped(self) -> bool:
        """Whether :meth:`experts` runs the grouped kernels (environment read now)."""
        c = self.cfg
        dims = (c.moe.num_experts, self.top_k, c.expert_dim, c.expert_inter, c.hidden,
                c.shared_inter)  # fmt: skip
        return _mg.selected(self.N, dims)

    def route_zeroes_acc(self) -> bool:
        """Whether the front leaves ``acc`` to the grouped route kernel (the ``tile`` front,
        which zeroes nothing, or the ``wide`` cuBLAS front); read from the environment at each
        call, like the front's choice."""
        return self.wide or self._front() == "tile"

    def _front(self) -> str:
        """The front kernel of this call (:func:`front_mma.front_variant`, at the tokens of one
        launch)."""
        return _fm.front_variant(self.Nc, self.cfg.hidden, self._grouped(), self.w_front.shape[0])

    @property
    def chunks(self) -> int:
        """Launches of the front and of the back kernel (one per row chunk of ``Nc`` tokens)."""
        return self.N // self.Nc

    def _chunks(self, *ts):
        """Per front / back launch, the row views of ``ts`` that it takes (unchunked: the
        tensors themselves, one launch)."""
        if self.chunks == 1:
            return [ts]
        rows = [slice(c * self.Nc, (c + 1) * self.Nc) for c in range(self.chunks)]
        return [tuple(t[r] for t in ts) for r in rows]

    def front(self, h: torch.Tensor) -> None:
        """Kernel 1: ``front_mma.FrontMma`` (tensor cores) where the shapes allow, else
        ``router_topk.FrontGemv`` (``DECODESCOPE_MOE_FRONT`` overrides: ``mma`` / ``simt`` /
        ``tile``: the tile GEMM with FP32 output, no zeroing; only with the grouped experts,
        whose route kernel then zeroes ``acc``; ``done`` is theirs to ignore). ``wide``: one
        cuBLAS GEMM over all rows (FP32 out)."""
        self._early_now = None  # set by _early() where this front runs the route early
        if self.wide:
            if not self._grouped():
                raise ValueError(f"the wide MoE front needs the grouped expert kernels ({self.N} "
                                 "tokens)")  # fmt: skip
            with self._r(OPS[0]):
                _tg.mm_f32(h, self.w_front, self.y_front)
            return
        v = self._front()
        if v == "tile" and not self._grouped():
            raise ValueError(
                f"DECODESCOPE_MOE_FRONT=tile needs the grouped expert kernels (at {self.N} "
                "tokens the persistent ones run, and they need acc/done zeroed by the front)"
            )
        with self._r(OPS[0]):
            for hc, y, acc in self._chunks(h, self.y_front, self.acc):
                if v == "tile":
                    _fm.front_tile(hc, self.w_front, y)
                elif v == "mma":
                    _fm.front_mma(hc, self.w_front, y, acc, self.done, early=self._early())
                else:
                    _rt.front_gemv(hc, self.w_front, y, acc, self.done)

    def _early(self):
        """``(rks, n_router, part, sig)`` for :func:`.front_mma.front_mma` where this call runs
        the one-token route early (:func:`.experts_t1.early_plan`), else None; kept for
        :meth:`experts` as ``_early_now``."""
        from decodescope.kernels.specialized import experts_t1 as _t1

        c = self.cfg
        E = c.moe.num_experts
        dims = (E, self.top_k, c.expert_dim, c.expert_inter, c.hidden, c.shared_inter)
        if self.chunks != 1 or not self._grouped():
            return None
        rks = _t1.early_plan(self.N, dims, self.route_zeroes_acc())
        if rks == 1:
            return None
        part, sig = _t1.early_buffers(self, rks, E, self.acc.device)
        if getattr(self, "_early_pending", False):  # the last early front had no route after it
            sig.zero_()  # (a check or a timing of the front alone): its counts are stale
        self._early_now = (rks, part, sig)
        self._early_pending = True
        return rks, E, part, sig

    def front_residual(self, x: torch.Tensor, r_in: torch.Tensor, r_out: torch.Tensor) -> None:
        """Front kernel with the residual-add + RMSNorm (``mlp_norm``) in its prologue."""
        self._early_now = None
        if self.mlp_norm is None:
            raise ValueError("forward_residual needs the layer's mlp_norm weight")
        if self.chunks > 1:
            raise ValueError("forward_residual runs unchunked (chunk = n_tokens) only")
        with self._r(OP_FRONT_NORM):
            _rt.front_gemv(x, self.w_front, self.y_front, self.acc, self.done, residual=r_in,
                           norm_w=self.mlp_norm, residual_out=r_out, eps=self.cfg.eps)  # fmt: skip

    def front_norm(self, r: torch.Tensor) -> None:
        """Front kernel on ``rmsnorm(r) * mlp_norm`` (the residual already added upstream, as
        the attention side's ``o_proj`` does): ``front_mma.FrontMmaNorm`` where the front is
        the tensor-core kernel (up to ``NORM_MAX_T`` tokens), else ``router_topk.FrontGemv``
        with its norm prologue."""
        self._early_now = None
        if self.mlp_norm is None:
            raise ValueError("forward_norm needs the layer's mlp_norm weight")
        mma = self._front() == "mma" and self.Nc <= _fm.NORM_MAX_T
        with self._r(OP_FRONT_NORM):
            for rc, y, acc in self._chunks(r, self.y_front, self.acc):
                if mma:
                    _fm.front_mma(rc, self.w_front, y, acc, self.done,
                                  norm_w=self.mlp_norm, eps=self.cfg.eps)  # fmt: skip
                else:
                    _rt.front_gemv(rc, self.w_front, y, acc, self.done,
                                   norm_w=self.mlp_norm, eps=self.cfg.eps)  # fmt: skip

    def experts(self) -> None:
        """Kernel 2 (``moe_experts``), or with ``DECODESCOPE_MOE_EXPERTS=grouped`` the three
        launches of :mod:`moe_grouped` (route, w13 + SiTU, w2 + weighted sum), same outputs,
        same range."""
        with self._r(OPS[1]):
            E, S = self.cfg.moe.num_experts, self.cfg.shared_inter
            zero_acc = self.route_zeroes_acc()
            early, self._early_now = getattr(self, "_early_now", None), None  # this front's
            self._early_pending = getattr(self, "_early_pending", False) and early is None
            if self._grouped():
                bufs = _mg.buffers_for(self, self.N, E, self.top_k, S, self.acc.device)
                _mg.moe_grouped(
                    self.y_front, self.bias, self.w13, self.w2, self.shared_w2, self.h, self.acc,
                    self.shared_out, self.topk_ids, self.topk_weights, bufs, top_k=self.top_k,
                    scaling=self.scaling, beta=self.beta, lbeta=self.lbeta, zero_acc=zero_acc,
                    early=early, back_w=self.latent_up,
                )  # fmt: skip
                return
            if self.chunks > 1:
                raise ValueError(
                    f"the experts of {self.N} tokens in one pass need the grouped kernels "
                    f"(DECODESCOPE_MOE_EXPERTS={os.environ.get('DECODESCOPE_MOE_EXPERTS', 'auto')})"
                )
            if zero_acc:
                raise ValueError(
                    "DECODESCOPE_MOE_FRONT=tile needs the grouped expert kernels: the "
                    "persistent ones need acc/done zeroed by the front"
                )
            _me.moe_experts(
                self.y_front,
                self.bias,
                self.w13,
                self.w2,
                self.shared_w2,
                self.h,
                self.acc,
                self.shared_out,
                self.done,
                self.topk_ids,
                self.topk_weights,
                top_k=self.top_k,
                scaling=self.scaling,
                beta=self.beta,
                lbeta=self.lbeta,
            )

    def back(self, out: torch.Tensor) -> None:
        """Kernel 3: ``back_mma.BackMma`` (tensor cores) from 1 token on, ``up_proj_shared_add``
        where its shapes do not fit; ``back_tile.back_tile`` (the tile GEMM, one launch) with
        ``tile`` or from ``back_tile.TILE_FROM`` tokens
        (``DECODESCOPE_MOE_BACK=auto|mma|simt|tile``). ``wide``: the norm, cuBLAS and the add
        over all rows."""
        if self.wide:
            with self._r(OPS[2]):
                if wide_back() == "addmm":
                    a = _tg.wide_norm(self.acc, self.latent_norm, eps=self.cfg.eps,
                                      side=(self.shared_out, out))  # fmt: skip
                    _tg.mm_add_(a, self.latent_up, out)
                    return
                a = _tg.wide_norm(self.acc, self.latent_norm, eps=self.cfg.eps)
                _tg.mm_f32(a, self.latent_up, self.y_up)
                add_round(self.y_up, self.shared_out, out)
            return
        fn = {"mma": _bm.back_mma, "tile": _bt.back_tile, "gemv": _gs.back_gemv}.get(
            _bm.back_variant(self.Nc, self.cfg.expert_dim, self.cfg.hidden),
            _up.up_proj_shared_add,
        )
        with self._r(OPS[2]):
            for acc, shared, o in self._chunks(self.acc, self.shared_out, out):
                fn(acc, self.latent_norm, self.latent_up, shared, o, self.cfg.eps)

    def forward(self, h: torch.Tensor, out: torch.Tensor) -> None:
        """``out [N, H] bf16`` = LatentMoE(``h [N, H] bf16``) (reference ``moe_ref``)."""
        self.front(h)
        self.experts()
        self.back(out)

    def forward_norm(self, r: torch.Tensor, out: torch.Tensor) -> None:
        """``out = MoE(rmsnorm(r) * mlp_norm)`` in 3 launches: pass the attention half's
        ``r_out`` and skip its ``residual_norm`` launch (KDA layer 6 launches, MLA 7)."""
        self.front_norm(r)
        self.experts()
        self.back(out)

    def forward_residual(self, x: torch.Tensor, r_in: torch.Tensor, r_out: torch.Tensor,
                         out: torch.Tensor) -> None:  # fmt: skip
        """``r_out = x + r_in`` (``r_out`` must not alias ``x`` or ``r_in``);
        ``out = MoE(rmsnorm(r_out) * mlp_norm)``: the layer's
        post-attention residual norm and the MoE block in 3 launches (the attention side then
        skips its ``residual_norm`` launch). The per-token rstd is recomputed by every front CTA
        (an L2 read of 2 x T x H BF16 per CTA): worth it up to about 16 tokens."""
        self.front_residual(x, r_in, r_out)
        self.experts()
        self.back(out)


def add_round(y: torch.Tensor, shared: torch.Tensor, out: torch.Tensor) -> None:
    """``out = bf16(y + shared)`` (FP32 operands, one rounding): the wide back's last launch."""
    torch.add(y, shared, out=out)


def moe_block_ref(
    cfg: Config, w: dict[str, torch.Tensor], h: torch.Tensor, topk_ids: torch.Tensor | None = None
):
    """The three kernels' torch references chained (FP32, the kernels' BF16 roundings).

    Returns ``(out [N, H] bf16, topk_ids [N, k])``; with ``topk_ids`` given, routes with them."""
    e = cfg.moe
    E, L = e.num_experts, cfg.expert_dim
    y = _rt.front_gemv_ref(h, _rt.pack_front_weights(w))
    ids, tw = _rt.router_topk_ref(y[:, :E], w["router_bias"], e.top_k, e.routed_scaling)
    if topk_ids is not None:
        ids = topk_ids.to(torch.int32)
        sc = torch.sigmoid(y[:, :E].double()).gather(1, ids.long())
        tw = (sc / sc.sum(-1, keepdim=True) * e.routed_scaling).float()
    acc, sh = _me.moe_experts_ref(
        y[:, E : E + L],
        y[:, E + L :],
        ids,
        tw,
        w["w13"],
        w["w2"],
        w["shared_w2"],
        cfg.model.situ_beta,
        cfg.model.situ_linear_beta,
    )
    out = _up.up_proj_shared_add_ref(acc, w["latent_norm"], w["latent_up"], sh, cfg.eps)
    return out, ids
