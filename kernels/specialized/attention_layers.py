"""The attention half of the specialized KDA and gated-MLA decode layers.

Same contract as :meth:`decodescope.kernels.standard.layers.StandardLayer.forward`'s attention
part: from ``(x_in, r_in)`` compute ``r_out`` (the residual stream after attention) and ``h``
(``rmsnorm(r_out) * mlp_norm``, the MoE block's input). Every buffer is allocated once; the same
launches go into the same buffers every call, on torch's current stream: capturable.

Launches and their ranges (``layer.{i}.attn.<ops>``, names the standard path's ops they cover),
below 8 tokens (``tile_gemm.AUTO_MIN_M``). From 8 tokens on the input projection (and o_proj)
run on :mod:`.tile_gemm`, whose RMSNorm is a launch of its own inside range 1 (KDA 5 launches,
MLA 6):

KDA (4 launches; standard: 6 at TP8, 9 at TP16)
  1. ``input_residual_norm+qkv_proj+f_b_proj`` skinny GEMM, residual add + RMSNorm prologue
     (f_b_proj's weights are read by launch 2, which computes it: the name keeps the lineup)
  2. ``conv1d+kda_recurrence+gated_norm``      :mod:`.kda_decode`
  3. ``o_proj``                                skinny GEMM with the residual-add epilogue
  4. ``residual_norm``                         :mod:`.rmsnorm` (goes away once the MoE front
                                               kernel normalizes in its prologue)
MLA (5 launches; standard: 12-13)
  1. ``input_residual_norm+fused_qkv_a_proj+g_proj`` two segments of one skinny GEMM grid
  2. ``q_kv_norm+q_b_proj``                    skinny GEMM, q_a RMSNorm prologue (the kv_a
                                               norm runs inside launch 3)
  3. ``w_uk_bmm+cache_insert+mla_decode+w_uv_bmm+gate_mul`` :mod:`.mla_decode`
  4. ``o_proj``, 5. ``residual_norm`` as for KDA
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from decodescope.kernels.config import Config, LayerSpec
from decodescope.kernels.specialized import kda_decode as _kda
from decodescope.kernels.specialized import mla_decode as _mla
from decodescope.kernels.specialized import norm_qkv_proj as _nqp
from decodescope.kernels.specialized import oproj_residual_norm as _op
from decodescope.kernels.specialized import rmsnorm as _rms
from decodescope.kernels.specialized import tile_gemm as _tg
from decodescope.tracer import range as _range

BF16 = torch.bfloat16

KDA_OPS = (
    "input_residual_norm+qkv_proj+f_b_proj",
    "conv1d+kda_recurrence+gated_norm",
    "o_proj",
    "residual_norm",
)
MLA_OPS = (
    "input_residual_norm+fused_qkv_a_proj+g_proj",
    "q_kv_norm+q_b_proj",
    "w_uk_bmm+cache_insert+mla_decode+w_uv_bmm+gate_mul",
    "o_proj",
    "residual_norm",
)


OP_OPROJ_NORM = "o_proj+residual_norm"  # DECODESCOPE_OPROJ_NORM=1: the two as one launch


def attn_ops(kind: str, fused_norm: bool = False) -> tuple[str, ...]:
    """The attention half's launches (op names) of a KDA / MLA layer; ``fused_norm``: o_proj
    and the RMSNorm after it as one (:func:`.oproj_residual_norm.norm_fused_plan`)."""
    ops = KDA_OPS if kind == "kda" else MLA_OPS
    return (*ops[:-2], OP_OPROJ_NORM) if fused_norm else ops


def _alloc_buffers(obj, cfg: Config, kind: str, n: int, dev) -> None:
    """The attention half's BF16 buffers for ``n`` rows, as attributes of ``obj``: ``r_mid``
    (the residual after the input add, launch 1 writes it), KDA ``proj`` and ``o``, MLA ``a``,
    ``g``, ``q`` and ``o``."""

    def buf(*shape):
        return torch.empty(shape, dtype=BF16, device=dev)

    obj.r_mid = buf(n, cfg.hidden)
    if kind == "kda":
        obj.proj = buf(n, cfg.kda_in_proj_out)
        obj.o = buf(n, cfg.kda_dim)
    else:
        obj.a = buf(n, cfg.mla_qkv_a_out)
        obj.g = buf(n, cfg.mla_v_dim)
        obj.q = buf(n, cfg.mla_q_b_out)
        obj.o = buf(n, cfg.mla_v_dim)


class SpecializedAttention:
    """One layer's attention half for ``batch`` sequences of ``tokens`` tokens each."""

    def __init__(
        self,
        cfg: Config,
        spec: LayerSpec,
        w: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
        batch: int,
        tokens: int,
    ):
        self.cfg, self.spec, self.w, self.state = cfg, spec, w, state
        self.B, self.T, self.N = batch, tokens, batch * tokens
        self.i = spec.index
        _alloc_buffers(self, cfg, spec.attn, self.N, w["attn_norm"].device)
        # o_proj + the post-attention RMSNorm as one launch (None: two launches; the tp_world 2
        # patches in tp2.py set it to None before they wrap ``stages``)
        self.norm_plan = _op.norm_fused_plan(cfg, spec.attn, self.N)
        # o_proj prefetching the next kernels' weights into L2 (set_prefetch)
        self.pre_plan = None
        self.pre_w: torch.Tensor | None = None

    def set_prefetch(self, w_next: torch.Tensor | None) -> None:
        """o_proj prefetches the start of each K slice of ``w_next`` (the MoE front's packed
        weight) into L2 before its PDL wait, while the decode kernel before it leaves HBM idle
        (``DECODESCOPE_OPROJ_PREFETCH`` bytes per slice; unset: off). Not with the fused
        o_proj + norm; the tp_world 2 patches replace o_proj altogether."""
        self.pre_plan = None
        self.pre_w = None
        if self.norm_plan is None:
            self.pre_plan = _op.prefetch_plan(self.cfg, self.spec.attn, self.N, w_next)
            self.pre_w = w_next if self.pre_plan is not None else None

    def _oproj(self, r_out) -> None:
        if self.pre_plan is None:
            _op.oproj_residual(self.cfg, self.w, self.o, self.r_mid, r_out)
        else:
            from decodescope.kernels.specialized.gemv_stream import gemv_pre

            gemv_pre(self.pre_plan, self.o, self.w["o_proj"], r_out, self.r_mid, self.pre_w)

    def _r(self, op: str):
        return _range(f"layer.{self.i}.attn.{op}")

    @property
    def ops(self) -> tuple[str, ...]:
        return attn_ops(self.spec.attn, self.norm_plan is not None)

    @property
    def launches(self) -> int:
        """Launches of :meth:`forward` (with the RMSNorm after o_proj)."""
        return len(self.ops)

    @property
    def launches_no_norm(self) -> int:
        """Launches of :meth:`stages_no_norm`."""
        return len(attn_ops(self.spec.attn)) - 1

    def warmup(self) -> None:
        """Compile every kernel of this layer (outside capture)."""
        cfg, N = self.cfg, self.N
        from decodescope.kernels.specialized.tile_gemm import compile_any

        compile_any(_nqp.plan_for(cfg, self.spec.attn, N))
        compile_any(_op.plan_for(cfg, self.spec.attn, N))
        _op.fold_prepare(cfg, self.w, self.spec.attn, N)  # folded norms' derived weights
        _rms.compile_plan(_rms.NormPlan(N, cfg.hidden, cfg.eps))
        if self.norm_plan is not None:
            from decodescope.kernels.specialized.gemv_stream import compile_norm_plan

            compile_norm_plan(self.norm_plan)
        if self.pre_plan is not None:
            from decodescope.kernels.specialized.gemv_stream import compile_pre_plan

            compile_pre_plan(self.pre_plan)
        if self.spec.attn == "kda":
            _kda.compile_plan(_kda.plan_for(cfg, self.B, self.T))
        else:
            compile_any(_op.q_b_plan(cfg, N))
            _mla.compile_for(cfg, self.B, self.T)

    def stages(self, x_in, r_in, r_out, h_out) -> list[tuple[str, Callable[[], None]]]:
        """The layer's launches in order, as ``(op name, thunk)``; ``forward`` runs them."""
        out = self._stages(x_in, r_in, r_out, h_out)
        if self.norm_plan is None:
            return out
        cfg, w, p = self.cfg, self.w, self.norm_plan
        return out[:-2] + [(OP_OPROJ_NORM, lambda: _op.oproj_residual_norm(
            cfg, w, p, self.o, self.r_mid, r_out, h_out))]  # fmt: skip

    def stages_no_norm(self, x_in, r_in, r_out, h_out) -> list[tuple[str, Callable[[], None]]]:
        """The launches without the RMSNorm after o_proj (the dense MLP and the MoE front with
        ``front_norm`` normalize in their own prologue): ``r_out`` is the residual stream after
        attention."""
        if self.norm_plan is None:  # through stages(): the tp_world 2 patches wrap it
            return [s for s in self.stages(x_in, r_in, r_out, h_out) if s[0] != KDA_OPS[-1]]
        return self._stages(x_in, r_in, r_out, h_out)[:-1]

    def _stages(self, x_in, r_in, r_out, h_out) -> list[tuple[str, Callable[[], None]]]:
        cfg, w, st = self.cfg, self.w, self.state
        if self.spec.attn == "kda":
            return [
                (KDA_OPS[0], lambda: _nqp.norm_qkv_proj(
                    cfg, w, "kda", x_in, r_in, self.r_mid, [self.proj])),
                (KDA_OPS[1], lambda: _kda.kda_decode(
                    cfg, w, self.proj, st["kda_state"], st["conv_state"], self.o, self.T)),
                (KDA_OPS[2], lambda: self._oproj(r_out)),
                (KDA_OPS[3], lambda: _rms.rmsnorm(r_out, w["mlp_norm"], h_out, cfg.eps)),
            ]  # fmt: skip
        outs = [self.a] + ([self.g] if cfg.mla.output_gate else [])
        return [
            (MLA_OPS[0], lambda: _nqp.norm_qkv_proj(
                cfg, w, "mla", x_in, r_in, self.r_mid, outs)),
            (MLA_OPS[1], lambda: _op.q_b_proj(cfg, w, self.a, self.q)),
            (MLA_OPS[2], lambda: _mla.mla_decode(
                cfg, w, self.a, self.q, self.g, st["kv_cache"], self.o, self.T)),
            (MLA_OPS[3], lambda: self._oproj(r_out)),
            (MLA_OPS[4], lambda: _rms.rmsnorm(r_out, w["mlp_norm"], h_out, cfg.eps)),
        ]  # fmt: skip

    def forward(self, x_in, r_in, r_out, h_out) -> None:
        """``r_out`` = residual after attention; ``h_out = rmsnorm(r_out) * mlp_norm``.

        ``r_out`` may alias ``r_in`` (launch 1 writes ``r_mid``, launch 3 reads it)."""
        for op, fn in self.stages(x_in, r_in, r_out, h_out):
            with self._r(op):
                fn()


WIDE_AG_ENV = "DECODESCOPE_WIDE_AG"


def merged_ag(cfg: Config, batch: int, tokens: int) -> bool:
    """Whether an MLA layer's all-rows attention (:class:`AttentionAllTokens`) runs its input
    projections ``qkv_a`` and ``g_proj`` as one cuBLAS GEMM over the two weights' rows into one
    ``[rows, a + g]`` buffer, ``a`` and ``g`` its column slices (``DECODESCOPE_WIDE_AG``:
    1, the default since session 39, measured in part 52; 0 two GEMMs; one launch fewer). Only with the output gate, a BF16 cache and where the decode
    launch (``batch`` sequences of ``tokens``) runs the split kernel, the one that takes the
    slices' row strides (:attr:`.mla_decode_split.MLASplitPlan.lda`)."""
    from decodescope.kernels.specialized import env_knobs as ek

    if not ek.read(WIDE_AG_ENV, (0, 1), "1") or not cfg.mla.output_gate:
        return False
    if cfg.kv_cache_dtype != "bf16":
        return False
    return _mla.kernel_choice(BF16, "", batch, tokens, cfg) == "split"


WIDE_QNORM_ENV = "DECODESCOPE_WIDE_QNORM"


def folded_q_b(cfg: Config, batch: int, tokens: int) -> bool:
    """Whether an MLA layer's all-rows attention drops q_b's RMSNorm launch
    (``DECODESCOPE_WIDE_QNORM=1``, opt-in, session 39, not yet measured): q_b as one cuBLAS GEMM
    on the raw ``q_a`` with the norm weight folded into its weight
    (:func:`.tile_gemm.fold_norm_weight`), and the split decode kernel scaling each score row by
    its token's ``q_a`` rstd (:attr:`.mla_decode_split.MLASplitPlan.qnorm`: scores are linear in
    ``q``). Same conditions as :func:`merged_ag`: a BF16 cache and the split kernel decoding."""
    from decodescope.kernels.specialized import env_knobs as ek

    if not ek.read(WIDE_QNORM_ENV, (0, 1), "0"):
        return False
    if cfg.kv_cache_dtype != "bf16":
        return False
    return _mla.kernel_choice(BF16, "", batch, tokens, cfg) == "split"


def merged_rows(w: dict[str, torch.Tensor], names: tuple[str, ...]) -> torch.Tensor:
    """The weights ``names`` as one ``[sum N, K]`` tensor: a view where they are adjacent row
    blocks of one storage (as :func:`decodescope.kernels.weights.make_layer_weights` makes MLA's
    ``qkv_a`` and ``g_proj``), else one copy made here (their bytes once more in memory)."""
    ws = [w[n] for n in names]
    first = ws[0]
    adjacent = all(t.is_contiguous() and t.dtype == first.dtype and t.shape[1:] == first.shape[1:]
                   for t in ws)  # fmt: skip
    if adjacent:
        st = first.untyped_storage()
        off = first.storage_offset()
        for t in ws:
            adjacent = adjacent and t.untyped_storage().data_ptr() == st.data_ptr() and (
                t.storage_offset() == off)  # fmt: skip
            off += t.numel()
    if not adjacent:
        return torch.cat(ws)
    rows = sum(int(t.shape[0]) for t in ws)
    return first.new_empty(0).set_(st, first.storage_offset(), (rows, *first.shape[1:]),
                                   first.stride())  # fmt: skip


class AttentionAllTokens:
    """One layer's attention half over all ``batch x tokens`` rows of a chunked step (more
    tokens than the decode kernels take in one launch; ``step.tokens_once``): the input
    projections, o_proj and the RMSNorm after it once over every row (:func:`.tile_gemm.
    project_wide`: the norm as one :mod:`.rmsnorm` launch, each weight one cuBLAS GEMM), the
    decode kernel (KDA recurrence, MLA decode) once per chunk of ``per`` sequences on row and
    state views. Same ranges as :class:`SpecializedAttention` (:func:`attn_ops`, never the fused
    o_proj + norm); the decode range holds a launch per chunk.

    ``decode_once`` (``step.decode_once``, ``DECODESCOPE_CHUNK_DECODE=once``): the decode kernel
    too in one launch over every sequence (the kernels' grids are per sequence and head; no
    64-token limit of theirs), ``per`` then ignored.

    ``DECODESCOPE_WIDE_AG=1`` (:func:`merged_ag`, the default since session 39): MLA's
    ``qkv_a`` and ``g_proj`` in one GEMM where the split kernel decodes.

    ``DECODESCOPE_WIDE_QNORM=1`` (:func:`folded_q_b`, opt-in): q_b's norm launch folded into
    the split decode kernel (q_b on the raw q_a with the norm weight folded in).

    Launches: KDA ``2 + chunks + 2``, MLA ``(1 + projections) + q_b + chunks + 2`` (``q_b``: 2,
    1 with the fold), ``chunks`` 1
    with ``decode_once`` (:func:`all_tokens_launches`); every kernel compiles at its first call
    (the model's guarded warm-up step)."""

    def __init__(self, cfg: Config, spec: LayerSpec, w: dict[str, torch.Tensor],
                 state: dict[str, torch.Tensor], batch: int, tokens: int, per: int,
                 decode_once: bool = False):  # fmt: skip
        if decode_once:
            per = batch
        if per < 1 or batch % per:
            raise ValueError(f"AttentionAllTokens: {per} sequences per chunk must divide {batch}")
        self.cfg, self.spec, self.w, self.state = cfg, spec, w, state
        self.B, self.T, self.N, self.per = batch, tokens, batch * tokens, per
        self.chunks = batch // per
        self.i = spec.index
        _alloc_buffers(self, cfg, spec.attn, self.N, w["attn_norm"].device)
        # MLA's qkv_a and g_proj in one GEMM, a and g column slices of its output
        self.w_ag = None
        if spec.attn == "mla" and merged_ag(cfg, per, tokens):
            na = cfg.mla_qkv_a_out
            self.w_ag = merged_rows(w, ("qkv_a", "g_proj"))
            self.ag = torch.empty(self.N, na + cfg.mla_v_dim, dtype=BF16, device=self.w_ag.device)
            self.a, self.g = self.ag[:, :na], self.ag[:, na:]
        # q_b on the raw q_a, its norm's weight folded in; the decode applies the rstd
        self.w_qb = None
        if spec.attn == "mla" and folded_q_b(cfg, per, tokens):
            self.w_qb = _tg.folded_weight(w["q_b"], w["q_a_norm"])  # one per weight tensor
        nc = per * tokens  # rows per decode launch
        self.rows = [slice(c * nc, (c + 1) * nc) for c in range(self.chunks)]
        self.state_c = [{k: v[c * per : (c + 1) * per] for k, v in state.items()}
                        for c in range(self.chunks)]  # fmt: skip

    def _r(self, op: str):
        return _range(f"layer.{self.i}.attn.{op}")

    def _decode(self) -> None:
        cfg, w, T = self.cfg, self.w, self.T
        for rows, st in zip(self.rows, self.state_c, strict=True):
            if self.spec.attn == "kda":
                _kda.kda_decode(cfg, w, self.proj[rows], st["kda_state"], st["conv_state"],
                                self.o[rows], T)  # fmt: skip
            else:
                _mla.mla_decode(cfg, w, self.a[rows], self.q[rows], self.g[rows], st["kv_cache"],
                                self.o[rows], T, q_raw=self.w_qb is not None)  # fmt: skip

    def stages(self, x_in, r_in, r_out, h_out) -> list[tuple[str, Callable[[], None]]]:
        """The launches in order as ``(op name, thunk)``; ``forward`` runs them."""
        cfg, w = self.cfg, self.w
        ops = attn_ops(self.spec.attn)
        if self.spec.attn == "kda":
            first = [(ops[0], lambda: _nqp.norm_qkv_proj(
                cfg, w, "kda", x_in, r_in, self.r_mid, [self.proj]))]  # fmt: skip
        else:
            outs = [self.a] + ([self.g] if cfg.mla.output_gate else [])
            if self.w_ag is not None:  # one GEMM over both weights' rows (merged_ag)
                proj = (ops[0], lambda: _tg.project_wide(
                    x_in, [self.w_ag], [self.ag], residual=r_in, residual_out=self.r_mid,
                    norm_weight=w["attn_norm"], eps=cfg.eps))  # fmt: skip
            else:
                proj = (ops[0], lambda: _nqp.norm_qkv_proj(cfg, w, "mla", x_in, r_in, self.r_mid,
                                                           outs))  # fmt: skip
            if self.w_qb is not None:  # folded_q_b: one GEMM, no norm launch
                q_a = self.a[:, : cfg.mla.q_lora_rank]
                q_b = (ops[1], lambda: _tg.project_wide(q_a, [self.w_qb], [self.q]))
            else:
                q_b = (ops[1], lambda: _op.q_b_proj(cfg, w, self.a, self.q))
            first = [proj, q_b]
        return first + [
            (ops[-3], self._decode),
            (ops[-2], lambda: _op.oproj_residual(cfg, w, self.o, self.r_mid, r_out)),
            (ops[-1], lambda: _rms.rmsnorm(r_out, w["mlp_norm"], h_out, cfg.eps)),
        ]

    def forward(self, x_in, r_in, r_out, h_out) -> None:
        """As :meth:`SpecializedAttention.forward`, over all rows."""
        for op, fn in self.stages(x_in, r_in, r_out, h_out):
            with self._r(op):
                fn()


def all_tokens_launches(cfg: Config, kind: str, chunks: int, merged: bool = False,
                        q_fold: bool = False) -> int:  # fmt: skip
    """Launches of :class:`AttentionAllTokens`: the norm and one GEMM per input projection (one
    in all where ``merged``, :func:`merged_ag`), (MLA) q_b's norm and GEMM (the GEMM alone where
    ``q_fold``, :func:`folded_q_b`), the decode kernel per chunk, o_proj, the RMSNorm."""
    if kind == "kda":
        return 2 + chunks + 2
    q_b = 1 if q_fold else 2
    return 1 + (2 if cfg.mla.output_gate and not merged else 1) + q_b + chunks + 2


def attention_ref(cfg: Config, spec: LayerSpec, w, state, x_in, r_in, tokens: int):
    """The kernels' torch references chained (FP32 math, the kernels' BF16 rounding points).

    Returns ``(r_out, h_out, new_state)``."""
    kind = spec.attn
    outs, r_mid = _nqp.norm_qkv_proj_ref(cfg, w, kind, x_in, r_in)
    if kind == "kda":
        o, s, c = _kda.kda_decode_ref(
            cfg, w, outs[0], state["kda_state"], state["conv_state"], tokens
        )
        new_state = {"kda_state": s, "conv_state": c}
    else:
        a = outs[0]
        g = outs[1] if len(outs) > 1 else None
        q = _op.q_b_proj_ref(cfg, w, a)
        o, cache = _mla.mla_decode_ref(cfg, w, a, q, g, state["kv_cache"], tokens)
        new_state = {"kv_cache": cache}
    r_out = _op.oproj_residual_ref(cfg, w, o, r_mid)
    h = _rms.rmsnorm_ref(r_out, w["mlp_norm"], cfg.eps)
    return r_out, h, new_state
