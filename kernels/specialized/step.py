"""The ``specialized`` workload: a decode step of the fused CuTe DSL layers (issue 5).

The same layers as the ``standard`` workload (``kernels/workloads.py``), built from the same seed
(weights, state and inputs come from :mod:`decodescope.kernels.weights` exactly as
:class:`~decodescope.kernels.standard.model.StandardModel` makes them), so the two compute the
same function. Each layer is::

    with range(f"layer.{i}:{kind}"):
        SpecializedAttention.forward(x, r, r_out, h)   # layer.{i}.attn.<fused ops>
        SpecializedMoE.forward(h, x_out)                # layer.{i}.moe.<fused ops>

with the residual stream carried between layers through ping-pong buffers (the step's inputs
``x_in`` / ``r_in`` are read, never written, so every graph replay computes the same function
of inputs and state), the KDA / MLA state updated in place, every kernel on torch's current
stream: one CUDA graph per step. Kernels compile on the first (eager) step, which the factory
runs: the capture child's warm-up and capture then find them compiled.

A dense layer (``layers="dense,kda,mla"``: K3's layer 0) is the attention half without its
``residual_norm`` launch, then :class:`.dense_mlp.SpecializedDenseMLP` (two launches,
``layer.{i}.mlp.residual_norm+gate_up+act`` and ``layer.{i}.mlp.down``) normalizing the
residual stream in its first kernel's prologue.

Option ``front_norm`` (0 | 1 | auto; default ``DECODESCOPE_FRONT_NORM``, else 0) drops the
attention half's last launch (the post-attention RMSNorm) and lets the MoE front kernel
normalize the residual stream in its prologue
(``moe.residual_norm+router+latent_down+shared_experts``): one launch less per layer. The
environment variable makes it a recorded kernel knob, so ``decodescope bench`` can A/B it.
Off by default: on the H200 (s15, TP8 batch 1, bench shares) the fused norm cost more than the
launch it saves (KDA layer 111.9 -> 115.3 us, projected step 10.68 -> 11.07 ms).

More than 64 tokens per step (the kernels take at most ``MAX_STEP_TOKENS`` = 64 tokens per
launch: the verify step of 32 or 64 sequences of 1+7 tokens): at tp_world 1 every layer runs
in sequence chunks (:func:`chunking`: the largest divisor of the batch whose tokens fit), each
chunk the same kernels on its sequences' rows, state and cache (views, no copies). The function
is the same (tokens of different sequences never meet in attention; the MoE is per token).
By default (``DECODESCOPE_CHUNK_EXPERTS=once``, :func:`experts_once`) only the attention half
and the MoE front and back kernels run per chunk; each MoE block's grouped expert kernels run
once over all of the step's tokens, after every chunk's attention half, so the expert weights
(most of a layer's bytes) are read once. ``chunk``: the whole layer per chunk (launches and
every weight read multiplied by the chunks). Since session 21 (``DECODESCOPE_CHUNK_TOKEN_OPS=
once``, :func:`tokens_once`) every token-parallel op runs once over all tokens too, on cuBLAS
GEMMs and :mod:`.rmsnorm` launches, with only the decode kernels (KDA recurrence, MLA decode)
per chunk; since session 22 that includes a dense layer's MLP
(:class:`.dense_mlp.DenseMLPAllTokens`: gate_up, :mod:`.situ_mul`, down), and the decode
kernels run once over all sequences too (``DECODESCOPE_CHUNK_DECODE=once``,
:func:`decode_once`; ``chunk``: per chunk), so that no kernel of the step runs per chunk any
more. The launch counts, the ranges and the run's notes and ``chunks`` record say which ran.

Where a half cannot run a preset or shape (no all-reduce, an FP8 latent cache, MXFP4 experts,
more than 64 tokens per step at tp_world 2, ...), :func:`check_usable` raises a
ValueError naming each missing piece. Without a CUDA GPU the factory validates the options, then
raises a ValueError saying so; :func:`plan` gives the meta and range names without a GPU.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from decodescope.kernels.workloads import Workload, register
from decodescope.tracer import range as _range

CUTE = "cute:decodescope"
BACKEND = "specialized"


def _int(v: Any, name: str) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ValueError(f"option {name} must be an integer, got {v!r}") from None


# -- what the halves support -------------------------------------------------------------------


def _attn_ops(kind: str, fused_norm: bool = False) -> tuple[str, ...]:
    from decodescope.kernels.specialized import attention_layers as al

    return al.attn_ops(kind, fused_norm)


def _moe_ops(front_norm: bool = False) -> tuple[str, ...]:
    from decodescope.kernels.specialized import moe_block as mb

    if front_norm:
        return (mb.OP_FRONT_NORM, *mb.OPS[1:])
    return mb.OPS


FRONT_NORM_DROPS = "residual_norm"  # the attention launch the MoE front kernel takes over
# tp_world 2: launches that carry the all-reduces (kernels/specialized/tp2.py's names)
TP2_RENAME = {
    "attn.o_proj": "attn.o_proj+allreduce+residual",
    "moe.latent_norm+latent_up+add": "moe.latent_allreduce+latent_norm+latent_up+shared_allreduce+add",
    "mlp.down": "mlp.down+allreduce",
}
ALLREDUCE = "fused"  # tp_world 2 default: peer memory inside the kernels (tp2.install)
ALLREDUCES = (ALLREDUCE, "nccl")  # nccl: explicit dist.all_reduce launches (tp2.install_nccl)


FRONT_NORM_ENV = "DECODESCOPE_FRONT_NORM"


def parse_front_norm(v: Any, n_tokens: int) -> bool:
    """``front_norm`` option: 0 | 1 | auto (on up to 16 tokens per step, where the front
    kernel's per-CTA recompute of the row norms costs less than the launch it saves); None:
    ``DECODESCOPE_FRONT_NORM`` (unset: 0)."""
    if v is None:
        e = os.environ.get(FRONT_NORM_ENV, "").strip() or "0"
        try:
            return parse_front_norm(e, n_tokens)
        except ValueError:
            raise ValueError(f"{FRONT_NORM_ENV}={e!r}: expected 0, 1 or auto") from None
    s = str(v).strip().lower()
    if s in ("auto", ""):
        return n_tokens <= 16
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off", "none"):
        return False
    raise ValueError(f"option front_norm must be 0, 1 or auto, got {v!r}")


def _dense_ops(n_tokens: int) -> tuple[str, ...]:
    from decodescope.kernels.specialized import dense_mlp as dm

    return dm.ops_for(n_tokens)


def _dense_problems(cfg, n_tokens: int, tp_world: int = 1) -> list[str]:
    from decodescope.kernels.specialized import dense_mlp as dm

    out: list[str] = []
    where = "specialized dense MLP"
    if tp_world == 2:  # the down projection's all-reduce: the o_proj fused kernel (tp2.py)
        from decodescope.kernels.specialized import oproj_allreduce as oa

        _try(out, f"{where}, down+allreduce", lambda: oa.OProjARPlan(
            m=n_tokens, k=cfg.dense_inter, n=cfg.hidden))  # fmt: skip
    split = False
    try:
        split = dm.split_norm_for(n_tokens)
    except ValueError as e:
        out.append(f"{where}: {e}")
    _try(out, f"{where}, gate_up+act", lambda: dm.gate_up_plan(cfg, n_tokens, norm=not split))
    _try(out, f"{where}, down", lambda: dm.down_plan(cfg, n_tokens))
    return out


def _front_norm_problems() -> list[str]:
    """What the fused-norm front needs from the halves (present at the time of writing)."""
    from decodescope.kernels.specialized import attention_layers as al
    from decodescope.kernels.specialized import moe_block as mb

    out = []
    if not hasattr(mb, "OP_FRONT_NORM"):
        out.append("moe_block.OP_FRONT_NORM (the fused residual_norm front) is missing")
    if not hasattr(mb.SpecializedMoE, "forward_norm"):
        out.append("SpecializedMoE.forward_norm (RMSNorm in the front prologue) is missing")
    for ops in (al.KDA_OPS, al.MLA_OPS):
        if ops[-1] != FRONT_NORM_DROPS:
            out.append(f"the attention half's last launch is {ops[-1]!r}, not {FRONT_NORM_DROPS!r}")
    return [f"front_norm: {p}" for p in out]


def _try(problems: list[str], what: str, fn) -> None:
    """Run a static check; a ValueError is a missing piece. Anything else (a kernel class
    renamed, its constructor changed) is not this check's business: the GPU warm-up still
    compiles and runs every kernel and names what fails."""
    try:
        fn()
    except ValueError as e:
        problems.append(f"{what}: {e}")
    except Exception:
        pass


def _attn_problems(cfg, kind: str, batch: int, tokens: int) -> list[str]:
    from decodescope.kernels.specialized import kda_decode as kda
    from decodescope.kernels.specialized import mla_decode as mla
    from decodescope.kernels.specialized import norm_qkv_proj as nqp
    from decodescope.kernels.specialized import oproj_residual_norm as op
    from decodescope.kernels.specialized import rmsnorm as rms

    N, out = batch * tokens, []
    where = f"specialized attention ({kind})"
    _try(out, f"{where}, fused input projection", lambda: nqp.plan_for(cfg, kind, N))
    _try(out, f"{where}, o_proj+residual", lambda: op.plan_for(cfg, kind, N))
    _try(out, f"{where}, residual_norm", lambda: rms.RMSNorm(rms.NormPlan(N, cfg.hidden, cfg.eps)))
    if kind == "kda":
        _try(out, f"{where}, KDA decode", lambda: kda.make_op(kda.plan_for(cfg, batch, tokens)))
    else:
        _try(out, f"{where}, q_b_proj", lambda: op.q_b_plan(cfg, N))
        _try(out, f"{where}, MLA decode", lambda: mla.MLADecode(mla.plan_for(cfg, batch, tokens)))
    return out


def _decode_problems(cfg, kinds, batch: int, tokens: int) -> list[str]:
    """The decode kernels over all ``batch`` sequences at once (:func:`decode_once`)."""
    from decodescope.kernels.specialized import kda_decode as kda
    from decodescope.kernels.specialized import mla_decode as mla

    out: list[str] = []
    where = f"{CHUNK_DECODE_ENV}=once: the decode kernel over all {batch} sequences"
    if "kda" in kinds:
        _try(out, f"{where} (KDA)", lambda: kda.make_op(kda.plan_for(cfg, batch, tokens)))
    if "mla" in kinds:
        _try(out, f"{where} (MLA)", lambda: mla.MLADecode(mla.plan_for(cfg, batch, tokens)))
    return out


def _moe_problems(cfg, n_tokens: int) -> list[str]:
    from decodescope.kernels.specialized import moe_block as mb
    from decodescope.kernels.specialized import moe_experts as me
    from decodescope.kernels.specialized import up_proj_shared_add as up

    out: list[str] = []
    where = "specialized MoE"
    try:
        mb._check_cfg(cfg)
    except ValueError as e:
        return [f"{where}: {e} (preset {cfg.model.name!r})"]
    if cfg.expert_dtype != "bf16":
        out.append(
            f"{where}: routed experts in {cfg.expert_dtype} are not implemented (the expert "
            "kernel reads BF16 w13/w2; use expert_dtype=bf16)"
        )
    e = cfg.moe
    L, Ie, S, H = cfg.expert_dim, cfg.expert_inter, cfg.shared_inter, cfg.hidden
    _try(out, f"{where}, expert kernel", lambda: me.MoeExperts(
        n_tokens, e.num_experts, e.top_k, L, Ie, H, S, float(e.routed_scaling),
        float(cfg.model.situ_beta), float(cfg.model.situ_linear_beta), 132))  # fmt: skip
    _try(out, f"{where}, up-projection", lambda: up.UpProjSharedAdd(n_tokens, L, H, cfg.eps))
    return out


def _tp2_problems(cfg, specs, n_tokens: int) -> list[str]:
    """The fused reductions' limits (receive area) for this step."""
    from decodescope.kernels.specialized import moe_allreduce as ma
    from decodescope.kernels.specialized import oproj_allreduce as oa

    out: list[str] = []
    for kind in sorted({s.attn for s in specs}):
        _try(out, f"tp_world 2, {kind} o_proj+allreduce", lambda k=kind: oa.plan_for(
            cfg, k, n_tokens))  # fmt: skip
    if any(s.mlp == "moe" for s in specs):
        _try(out, "tp_world 2, MoE back end + all-reduces", lambda: ma.MoeARPlan(
            n_tokens, cfg.expert_dim, cfg.hidden, float(cfg.eps)))  # fmt: skip
    return out


MAX_STEP_TOKENS = 64  # tokens one launch of the specialized kernels takes


def chunking(batch: int, tokens: int) -> tuple[int, int]:
    """``(sequences per chunk, chunks)``: the whole batch in one chunk up to
    ``MAX_STEP_TOKENS`` tokens, else the largest divisor of ``batch`` whose tokens fit (equal
    chunks: one compiled shape, the same launches in each)."""
    if batch * tokens <= MAX_STEP_TOKENS:
        return batch, 1
    per = max(d for d in range(1, batch + 1) if batch % d == 0 and d * tokens <= MAX_STEP_TOKENS)
    return per, batch // per


def chunk_text(n_tokens: int, n_chunks: int, per: int, once: bool | None,
               token_ops: bool = False, dense: bool = False,
               decode: bool = False) -> str:  # fmt: skip
    """How a chunked step ran, for notes and reports (``once``: the experts once over all
    tokens; None: not recorded, a run from before the choice existed, which ran per chunk;
    ``token_ops``: only the decode kernels per chunk, :func:`tokens_once`; ``dense``: the step
    has a dense layer, whose MLP then runs once over all tokens too; ``decode``: the decode
    kernels once over all sequences too, :func:`decode_once`)."""
    head = (f"{n_tokens} tokens per step: the specialized kernels take at most "
            f"{MAX_STEP_TOKENS} per launch, so ")  # fmt: skip
    if once and token_ops and decode:
        return (
            f"{n_tokens} tokens per step: every kernel runs once over all tokens (none per "
            "sequence chunk): the decode kernels (KDA recurrence, MLA decode) over all "
            "sequences, the projections, the MoE front and back (cuBLAS)"
            + (", the dense MLP" if dense else "")
            + " and the experts"
        )
    if once and token_ops:
        return head + (
            f"the decode kernels (KDA recurrence, MLA decode) run in {n_chunks} chunks of {per} "
            "sequences; the projections, the MoE front and back (cuBLAS)"
            + (", the dense MLP" if dense else "")
            + " and the experts once over all tokens"
        )
    if once:
        return head + (
            f"the attention half and the MoE front and back run in {n_chunks} chunks of {per} "
            f"sequences (their launches and weight reads x{n_chunks}), the routed and shared "
            "experts once over all tokens"
        )
    return head + (
        f"each layer runs in {n_chunks} chunks of {per} sequences (launches and weight reads "
        f"x{n_chunks})"
    )


def check_usable(
    cfg, specs, batch: int, tokens: int, tp_world: int = 1, front_norm: bool = False
) -> None:
    """Raise ValueError naming every piece the specialized path lacks for this step."""
    problems: list[str] = []
    per, n_chunks = chunking(batch, tokens)
    if n_chunks > 1 and tp_world != 1:
        problems.append(
            f"{batch * tokens} tokens per step: more than {MAX_STEP_TOKENS} run in sequence "
            f"chunks at tp_world 1 only (the fused reductions take one chunk); run tp_world 1 "
            f"or at most {MAX_STEP_TOKENS} tokens"
        )
    nb = per  # sequences per chunk: each chunk's shape is what the kernels see
    if front_norm:
        problems += _front_norm_problems()
    if tp_world not in (1, 2):
        problems.append(
            f"tp_world={tp_world}: the specialized path's fused reductions are two-rank "
            "(kernels/specialized/comm.py); run tp_world 1 or 2"
        )
    if tp_world == 2:
        problems += _tp2_problems(cfg, specs, nb * tokens)
    if any(s.mlp == "dense" for s in specs):
        problems += _dense_problems(cfg, nb * tokens, tp_world)
    seen: set[str] = set()
    for s in specs:
        if s.attn not in seen:
            seen.add(s.attn)
            problems += _attn_problems(cfg, s.attn, nb, tokens)
    if any(s.mlp == "moe" for s in specs):
        problems += _moe_problems(cfg, nb * tokens)
    if tp_world == 1 and decode_once(cfg, batch, tokens, front_norm):
        problems += _decode_problems(cfg, {s.attn for s in specs}, batch, tokens)
    if problems:
        head = (
            f"workload 'specialized' cannot run preset {cfg.preset or cfg.model.name!r} "
            f"tp_shape {cfg.tp} batch {batch} tokens_per_seq {tokens}:"
        )
        raise ValueError(head + "\n  - " + "\n  - ".join(problems))


# -- the plan: options, meta and range names, no GPU needed ------------------------------------


@dataclass
class Plan:
    cfg: Any
    specs: list
    batch: int
    tokens: int
    seed: int
    tp_world: int
    preset: str
    front_norm: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    weights: str = "rank"  # tp_world 2: kernels/sharding.build_rank_weights mode
    allreduce: str = ALLREDUCE  # tp_world 2: fused | nccl

    @property
    def chunk(self) -> tuple[int, int]:
        """``(sequences per chunk, chunks)`` (:func:`chunking`)."""
        return chunking(self.batch, self.tokens)

    @property
    def chunk_tokens(self) -> int:
        return self.chunk[0] * self.tokens

    def op_names(self, spec) -> list[str]:
        """``block.op`` names of one chunk's launches of one layer, in launch order."""
        attn = _attn_ops(spec.attn)
        if spec.mlp == "dense" and self.tokens_once:  # the attention half's norm writes h
            from decodescope.kernels.specialized.dense_mlp import WIDE_OPS

            names = [f"attn.{o}" for o in attn] + [f"mlp.{o}" for o in WIDE_OPS]
        elif spec.mlp == "dense":  # the dense MLP's first kernel normalizes in its prologue
            attn = tuple(o for o in attn if o != FRONT_NORM_DROPS)
            dense = _dense_ops(self.chunk_tokens)
            names = [f"attn.{o}" for o in attn] + [f"mlp.{o}" for o in dense]
        else:
            if self.front_norm:
                attn = tuple(o for o in attn if o != FRONT_NORM_DROPS)
            elif self.fused_norm(spec):
                attn = _attn_ops(spec.attn, True)
            moe = _moe_ops(self.front_norm)
            names = [f"attn.{o}" for o in attn] + [f"moe.{o}" for o in moe]
        if self.tp_world == 2 and self.allreduce == "nccl":  # explicit all-reduce launches
            from decodescope.kernels.specialized.tp2 import NCCL_OPS

            names = [x for n in names for x in NCCL_OPS.get(n, (n,))]
        elif self.tp_world == 2:  # the reductions ride in these launches (tp2.py)
            from decodescope.kernels.specialized import tp2 as _tp2

            n_tok = self.chunk_tokens
            unfused = _tp2.moe_back_unfused(n_tok, self.cfg.expert_dim, self.cfg.hidden)
            names = [x for n in names
                     for x in (_tp2.NCCL_OPS[n] if unfused and n == _tp2.MOE_BACK_OP
                               else (TP2_RENAME.get(n, n),))]  # fmt: skip
        return names

    def fused_norm(self, spec) -> bool:
        """o_proj and the RMSNorm after it as one launch in ``spec``'s layer
        (``DECODESCOPE_OPROJ_NORM``; one GPU; not with ``front_norm`` or a dense MLP, which
        normalize in their own first kernel)."""
        from decodescope.kernels.specialized import oproj_residual_norm as _op

        if self.tp_world != 1 or self.front_norm or spec.mlp == "dense" or self.tokens_once:
            return False
        return _op.norm_fused_plan(self.cfg, spec.attn, self.chunk_tokens) is not None

    @property
    def experts_once(self) -> bool:
        """Chunked, with each MoE block's experts once over all tokens (:func:`experts_once`)."""
        return experts_once(self.cfg, self.batch, self.tokens)

    @property
    def tokens_once(self) -> bool:
        """Chunked, with only the decode kernels per chunk (:func:`tokens_once`)."""
        return tokens_once(self.cfg, self.batch, self.tokens, self.front_norm)

    @property
    def decode_once(self) -> bool:
        """Chunked, with the decode kernels once over all sequences too (:func:`decode_once`)."""
        return decode_once(self.cfg, self.batch, self.tokens, self.front_norm)

    @property
    def decode_launches(self) -> int:
        """Launches of a decode kernel per layer: 1 with :attr:`decode_once`, else per chunk."""
        return 1 if self.decode_once else self.chunk[1]

    def range_names(self) -> dict[str, list[str]]:
        """``{"layer.{i}:{kind}": ["layer.{i}.attn.<ops>", ..., "layer.{i}.moe.<ops>"]}``, in
        the order the step opens them (repeated per sequence chunk; with the experts once over
        all tokens, the attention ranges per chunk, then the MoE ranges once, their front and
        back ranges holding a launch per chunk; with the token-parallel ops once too, every range
        once, the decode range holding a launch per chunk)."""
        n_chunks = self.chunk[1]
        once = self.experts_once
        out = {}
        for s in self.specs:
            names = [f"layer.{s.index}.{o}" for o in self.op_names(s)]
            if self.tokens_once:
                out[f"layer.{s.index}:{s.kind}"] = names
            elif once and s.mlp == "moe":
                attn = [n for n in names if ".attn." in n]
                out[f"layer.{s.index}:{s.kind}"] = attn * n_chunks + names[len(attn) :]
            else:
                out[f"layer.{s.index}:{s.kind}"] = names * n_chunks
        return out

    def launches(self) -> dict[str, int]:
        """Kernel launches per layer: one per range, plus the ranges that hold several kernels
        (:func:`extra_launches`; with the experts once over all tokens, the front and back
        ranges hold a launch per chunk)."""
        n, n_chunks = self.chunk_tokens, self.chunk[1]
        once = self.experts_once
        out = {}
        for (lay, ops), s in zip(self.range_names().items(), self.specs, strict=True):
            if self.tokens_once:
                out[lay] = tokens_once_launches(self.cfg, s, self.batch, self.tokens,
                                                self.decode_launches)  # fmt: skip
            elif once and s.mlp == "moe":
                out[lay] = (len(ops) + n_chunks * attn_extra_launches(self.cfg, s, n)
                            + 2 * (n_chunks - 1) + moe_extra_launches(self.cfg, self.batch
                                                                      * self.tokens))  # fmt: skip
            else:
                out[lay] = len(ops) + n_chunks * extra_launches(self.cfg, s, n)
        return out

    def op_impl(self) -> dict[str, str]:
        from decodescope.kernels.specialized.tp2 import NCCL_IMPL

        nccl = self.tp_world == 2 and self.allreduce == "nccl"
        out = {}
        for s in self.specs:
            for o in self.op_names(s):
                last = o.split(".")[-1]
                key = "allreduce" if last.endswith("allreduce") else last
                out[o] = NCCL_IMPL.get(key, CUTE) if nccl else CUTE
                if self._on_cublas(s, o):  # any tp_world: the tp2 patches keep these calls
                    from decodescope.kernels.specialized.tile_gemm import CUBLAS_IMPL

                    out[o] = CUBLAS_IMPL
        return out

    def _on_cublas(self, spec, op: str) -> bool:
        """Whether op ``op`` of ``spec``'s layer runs its GEMM on cuBLAS
        (``DECODESCOPE_TILE_CUBLAS``, :func:`.tile_gemm.cublas_serves`). At tp_world 2 the input
        projection stays as on one GPU, and so does ``attn.o_proj`` where the all-reduce is an
        NCCL launch of its own; the fused ``o_proj+allreduce+residual`` is another op name."""
        from decodescope.kernels.specialized import tile_gemm as tg
        from decodescope.kernels.specialized import tma_gemm as tm

        n, cfg = self.chunk_tokens, self.cfg
        if self.tokens_once:
            return op in WIDE_CUBLAS_OPS
        # DECODESCOPE_PROJ_TMA: the GEMMs it moves run on the TMA kernel (tma_gemm.serves)
        if op == "attn.o_proj":
            k = cfg.kda_dim if spec.attn == "kda" else cfg.mla_v_dim
            return tg.cublas_serves(n, k, 1, False, False) and not tm.serves(True)
        if op == "attn.input_residual_norm+qkv_proj+f_b_proj":
            return tg.cublas_serves(n, cfg.hidden, 1, True, True) and not tm.serves(False)
        return False


# the ops of a layer that run cuBLAS GEMMs where the token-parallel ops run once over all
# tokens (tokens_once)
WIDE_CUBLAS_OPS = frozenset({
    "attn.input_residual_norm+qkv_proj+f_b_proj", "attn.input_residual_norm+fused_qkv_a_proj+g_proj",
    "attn.q_kv_norm+q_b_proj", "attn.o_proj", "moe.router+latent_down+shared_experts",
    "moe.latent_norm+latent_up+add", "mlp.gate_up", "mlp.down",
})  # fmt: skip


def tokens_once_launches(cfg, spec, batch: int, tokens: int, n_chunks: int) -> int:
    """Launches of a layer whose token-parallel ops run once over all ``batch x tokens`` rows
    (:func:`tokens_once`), its decode kernel in ``n_chunks`` launches: the attention half
    (:func:`.attention_layers.all_tokens_launches`; MLA's projections merged where
    :func:`.attention_layers.merged_ag` says so),
    then for a MoE layer the cuBLAS front, the experts range, the back's norm and GEMM
    (``DECODESCOPE_WIDE_BACK=addmm``, the default; with ``add`` a third launch,
    :func:`.moe_block.wide_back`), for a
    dense layer gate_up, the activation and down."""
    from decodescope.kernels.specialized.attention_layers import (
        all_tokens_launches,
        folded_q_b,
        merged_ag,
    )

    merged = spec.attn == "mla" and merged_ag(cfg, batch // n_chunks, tokens)
    q_fold = spec.attn == "mla" and folded_q_b(cfg, batch // n_chunks, tokens)
    attn = all_tokens_launches(cfg, spec.attn, n_chunks, merged, q_fold)
    if spec.mlp == "dense":
        from decodescope.kernels.specialized.dense_mlp import WIDE_OPS

        return attn + len(WIDE_OPS)
    from decodescope.kernels.specialized.moe_block import wide_back_launches

    return attn + 1 + 1 + moe_extra_launches(cfg, batch * tokens) + wide_back_launches()


def extra_launches(cfg, spec, n_tokens: int) -> int:
    """Kernels beyond one per range in a layer, as the kernel selection of this process picks
    them: the tile GEMM's separate RMSNorm launch (``tile_gemm``, the input projection and
    MLA's q_b) and the grouped experts' three launches in the experts range (``moe_grouped``)."""
    extra = attn_extra_launches(cfg, spec, n_tokens)
    return extra + (moe_extra_launches(cfg, n_tokens) if spec.mlp != "dense" else 0)


def attn_extra_launches(cfg, spec, n_tokens: int) -> int:
    """The attention half's kernels beyond one per range: the tile GEMM's separate RMSNorm
    launch (``tile_gemm``; the input projection and MLA's q_b)."""
    from decodescope.kernels.specialized import norm_qkv_proj as nqp
    from decodescope.kernels.specialized import oproj_residual_norm as op
    from decodescope.kernels.specialized import tile_gemm as tg

    def norm_launch(plan) -> int:
        return 1 if isinstance(plan, tg.TilePlan) and plan.norm else 0

    extra = norm_launch(nqp.plan_for(cfg, spec.attn, n_tokens))
    if spec.attn == "mla":
        extra += norm_launch(op.q_b_plan(cfg, n_tokens))
    return extra


def _moe_dims(cfg) -> tuple:
    e = cfg.moe
    return (e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter, cfg.hidden, cfg.shared_inter)


def moe_extra_launches(cfg, n_tokens: int) -> int:
    """The MoE block's kernels beyond one per range: the grouped experts' three launches in the
    experts range (``moe_grouped``) where this process picks them for ``n_tokens``; two where
    the one-token experts rank the token in their w13 kernel (``DECODESCOPE_MOE_T1_ROUTE=w13``:
    no route launch)."""
    from decodescope.kernels.specialized import experts_t1 as t1
    from decodescope.kernels.specialized import moe_grouped as mg

    dims = _moe_dims(cfg)
    if not mg.selected(n_tokens, dims):
        return 0
    return 1 if t1.use_t1(n_tokens, dims) and t1.route_where() == "w13" else 2


CHUNK_EXPERTS_ENV = "DECODESCOPE_CHUNK_EXPERTS"
CHUNK_EXPERTS = ("once", "chunk")


def experts_once(cfg, batch: int, tokens: int) -> bool:
    """Whether a chunked step (more than ``MAX_STEP_TOKENS`` tokens) runs each MoE layer's
    routed and shared experts once over all of the step's tokens, with only the attention half
    and the MoE front / back kernels (at most 64 tokens a launch) per sequence chunk:
    ``DECODESCOPE_CHUNK_EXPERTS=once`` (the default) where the grouped expert kernels take the
    step's tokens (:func:`.moe_grouped.selected`); ``chunk``: the whole layer per chunk, each
    chunk reading the expert weights again (before session 20; the A/B). False for one chunk."""
    if chunking(batch, tokens)[1] == 1:
        return False
    from decodescope.kernels.specialized import env_knobs as knob
    from decodescope.kernels.specialized import moe_grouped as mg

    if knob.read(CHUNK_EXPERTS_ENV, CHUNK_EXPERTS, "once") != "once":
        return False
    return mg.selected(batch * tokens, _moe_dims(cfg))


CHUNK_DECODE_ENV = "DECODESCOPE_CHUNK_DECODE"
CHUNK_DECODE = ("chunk", "once")


def decode_once(cfg, batch: int, tokens: int, front_norm: bool = False) -> bool:
    """Whether a step with the token-parallel ops once (:func:`tokens_once`) runs the decode
    kernels (KDA recurrence, MLA decode) once over every sequence too, so that every kernel of
    the step sees all of its tokens: ``DECODESCOPE_CHUNK_DECODE=once`` (the default since the
    H200 A/B of session 22, o1: TP8 64x8 KDA decode 249.9 -> 190.0 us, MLA decode 348.1 ->
    256.0, projected step 210.87 -> 207.59 ms; TP16 64x8 174.1 -> 94.0, 249.0 -> 173.7,
    117.94 -> 110.62 ms); ``chunk``: one launch per sequence chunk, each on its chunk's rows,
    state and cache (views)."""
    if not tokens_once(cfg, batch, tokens, front_norm):
        return False
    from decodescope.kernels.specialized import env_knobs as knob

    return knob.read(CHUNK_DECODE_ENV, CHUNK_DECODE, "once") == "once"


CHUNK_TOKEN_OPS_ENV = "DECODESCOPE_CHUNK_TOKEN_OPS"
CHUNK_TOKEN_OPS = ("chunk", "once")


def tokens_once(cfg, batch: int, tokens: int, front_norm: bool = False) -> bool:
    """Whether a chunked step with the experts once (:func:`experts_once`) also runs each
    layer's other token-parallel ops once over all of its tokens: the attention input
    projections, o_proj, the RMSNorm after it (:class:`.attention_layers.AttentionAllTokens`),
    the MoE front and back (``SpecializedMoE(wide=True)``) and a dense layer's MLP
    (:class:`.dense_mlp.DenseMLPAllTokens`, since session 22), on cuBLAS GEMMs and
    :mod:`.rmsnorm` / :mod:`.situ_mul` launches, so that only the decode kernels (KDA recurrence, MLA decode: per-sequence state)
    run per chunk: ``DECODESCOPE_CHUNK_TOKEN_OPS=once`` (the default since session 21);
    ``chunk``: those ops per chunk on the specialized kernels (session 20, the A/B). Not with
    ``front_norm``."""
    if front_norm or not experts_once(cfg, batch, tokens):
        return False
    from decodescope.kernels.specialized import env_knobs as knob

    return knob.read(CHUNK_TOKEN_OPS_ENV, CHUNK_TOKEN_OPS, "once") == "once"


def kernel_env() -> dict[str, str]:
    """The ``DECODESCOPE_*`` variables that pick kernels or their options in this process (not
    the bookkeeping ones): recorded in each run so that a figure names what produced it
    (:func:`decodescope.tracer.capture.kernel_knobs`, which every capture records too)."""
    from decodescope.tracer.capture import kernel_knobs

    return kernel_knobs()


def plan(
    preset: str = "kimi-k3",
    tp_shape: int | str = 8,
    batch: int | str = 1,
    tokens_per_seq: int | str = 1,
    layers: str = "kda,mla",
    seed: int | str = 0,
    backend: str = BACKEND,
    context_len: int | str = 1024,
    kv_cache_dtype: str = "bf16",
    expert_dtype: str = "bf16",
    device: str | None = None,
    tp_world: int | str = 1,
    front_norm: str | int | None = None,
    weights: str = "rank",
    allreduce: str = ALLREDUCE,
    **unknown: Any,
) -> Plan:
    """Validate the options (the ``standard`` workload's) and say what the step will run."""
    from decodescope.kernels import bytes as kbytes
    from decodescope.kernels.config import get_config
    from decodescope.kernels.standard.model import parse_layers

    if unknown:
        raise ValueError(
            f"unknown option(s) for workload 'specialized': {', '.join(sorted(unknown))}"
        )
    if backend != BACKEND:
        raise ValueError(f"workload 'specialized' runs backend 'specialized', got {backend!r}")
    cfg = get_config(
        preset,
        tp_shape,
        context_len=_int(context_len, "context_len"),
        kv_cache_dtype=kv_cache_dtype,
        expert_dtype=expert_dtype,
    )
    specs = parse_layers(cfg, layers)
    b, t, s = _int(batch, "batch"), _int(tokens_per_seq, "tokens_per_seq"), _int(seed, "seed")
    world = _int(tp_world, "tp_world")
    if b < 1:
        raise ValueError(f"batch must be >= 1, got {b}")
    if not 1 <= t <= 8:
        raise ValueError(f"tokens_per_seq must be in 1..8 (1 + k drafts), got {t}")
    if world < 1:
        raise ValueError(f"tp_world must be >= 1, got {world}")
    from decodescope.kernels.sharding import WEIGHT_MODES, source_config

    if weights not in WEIGHT_MODES:
        raise ValueError(
            f"option weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}"
        )
    if allreduce not in ALLREDUCES:
        raise ValueError(
            f"workload 'specialized': allreduce must be {ALLREDUCE!r} (reductions inside the "
            f"fused kernels) or 'nccl' (explicit NCCL launches), got {allreduce!r}"
        )
    if world > 1 and weights == "shard":
        source_config(cfg, world)  # tp_shape divisible by tp_world (ConfigError is a ValueError)
    fn = parse_front_norm(front_norm, b * t)
    check_usable(cfg, specs, b, t, world, fn)
    p = Plan(cfg, specs, b, t, s, world, preset, fn, weights=weights, allreduce=allreduce)
    launches = p.launches()
    per_kind: dict[str, int] = {}
    for s_ in specs:
        per_kind.setdefault(s_.kind, launches[f"layer.{s_.index}:{s_.kind}"])
    p.meta = {
        "workload": "specialized",
        "backend": BACKEND,
        "preset": preset,
        "batch": b,
        "tokens_per_seq": t,
        "tp_shape": cfg.tp,
        "tp_world": world,
        # until a step has routed: the uniform-routing expectation (replaced after each refresh)
        "layer_bytes": {s_.kind: kbytes.layer_bytes(cfg, s_.kind, b, t, None) for s_ in specs},
    }
    p.meta["config_json"] = json.dumps(
        {
            "config": cfg.to_dict(),
            "layers": [f"{sp.index}:{sp.kind}" for sp in specs],
            "op_impl": p.op_impl(),
            "launches": launches,
            "launches_per_kind": per_kind,
            "ranges": p.range_names(),
            "seed": s,
            "front_norm": fn,
            "layer_bytes_from": "expected (uniform routing): no step has run",
            # kernel choices forced through the environment (DECODESCOPE_MOE_EXPERTS=... etc.)
            "kernel_env": kernel_env(),
            # sequences per chunk and chunks (more than MAX_STEP_TOKENS tokens: chunked); where
            # chunked, whether the MoE experts ran once over all tokens or per chunk
            "chunks": {"sequences": p.chunk[0], "chunks": p.chunk[1]}
            | ({"experts": "once" if p.experts_once else "chunk"} if p.chunk[1] > 1 else {})
            | ({"token_ops": "once"} if p.tokens_once else {})
            | ({"decode": "once"} if p.decode_once else {})
            # since session 22 a dense layer's MLP runs once over all tokens with them
            | (
                {"dense": "once"} if p.tokens_once and any(x.mlp == "dense" for x in specs) else {}
            ),  # fmt: skip
        },
        default=str,
    )
    if world > 1:
        cj = json.loads(p.meta["config_json"])
        cj |= {"allreduce": allreduce, "weights": weights}
        p.meta["config_json"] = json.dumps(cj, default=str)
    p.meta["notes"] = "; ".join(cfg.notes) + (
        "; tp_world 1: no all-reduce runs" if world == 1 else ""
    )
    per, n_chunks = p.chunk
    if n_chunks > 1:
        text = chunk_text(b * t, n_chunks, per, p.experts_once, p.tokens_once,
                          any(x.mlp == "dense" for x in specs), p.decode_once)  # fmt: skip
        p.meta["notes"] += f"; {text}"
    return p


# -- the model ---------------------------------------------------------------------------------


class SpecializedModel:
    """N specialized layers for one batch: weights, state, inputs, buffers and ``step()``.

    Weights, state and inputs are made as :class:`StandardModel` makes them (same seed, same
    device kind: the same tensors). ``weights`` (a list per layer) lets callers share them."""

    def __init__(
        self,
        cfg,
        specs,
        batch: int,
        tokens_per_seq: int = 1,
        seed: int = 0,
        device="cpu",
        weights: list[dict] | None = None,
        front_norm: bool = False,
    ) -> None:
        import torch

        from decodescope.kernels.specialized.attention_layers import (
            AttentionAllTokens,
            SpecializedAttention,
        )
        from decodescope.kernels.specialized.dense_mlp import DenseMLPAllTokens, SpecializedDenseMLP
        from decodescope.kernels.specialized.moe_block import SpecializedMoE
        from decodescope.kernels.weights import make_inputs, make_layer_weights, make_state

        check_usable(cfg, specs, batch, tokens_per_seq, front_norm=front_norm)
        self.front_norm = front_norm
        self.cfg, self.specs = cfg, specs
        self.batch, self.T, self.seed = batch, tokens_per_seq, seed
        self.N = batch * tokens_per_seq
        # more than MAX_STEP_TOKENS tokens: the layers run in equal sequence chunks
        self.per, self.chunks = chunking(batch, tokens_per_seq)
        self.Nc = self.per * tokens_per_seq  # tokens per chunk (the kernels' shape)
        self.device = torch.device(device)
        if weights is None:
            weights = [make_layer_weights(cfg, s, seed, self.device) for s in specs]
        self.weights = weights
        self.states = [make_state(cfg, s, batch, tokens_per_seq, seed, self.device) for s in specs]
        self.x_in, self.r_in = make_inputs(cfg, self.N, seed, self.device)

        def seqs(st: dict, c: int) -> dict:  # chunk c's sequences of a layer's state (views)
            if self.chunks == 1:
                return st
            return {k: v[c * self.per : (c + 1) * self.per] for k, v in st.items()}

        C = range(self.chunks)
        # per layer and chunk: [layer][chunk]; self.attn / self.moe / self.dense: chunk 0's
        self.attn_c = [
            [SpecializedAttention(cfg, s, w, seqs(st, c), self.per, tokens_per_seq) for c in C]
            for s, w, st in zip(specs, self.weights, self.states, strict=True)
        ]
        # chunked: the MoE blocks' experts once over all N tokens (one block per layer, its
        # front and back kernels per chunk of rows) or everything per chunk (experts_once)
        self.experts_once = experts_once(cfg, batch, tokens_per_seq)
        # chunked: the token-parallel ops of each layer once over all N rows too, only the
        # decode kernels per chunk (tokens_once)
        self.tokens_once = tokens_once(cfg, batch, tokens_per_seq, front_norm)
        # and the decode kernels once over all sequences (decode_once)
        self.decode_once = decode_once(cfg, batch, tokens_per_seq, front_norm)
        self.attn_all = [
            AttentionAllTokens(cfg, s, w, st, batch, tokens_per_seq, self.per, self.decode_once)
            if self.tokens_once else None
            for s, w, st in zip(specs, self.weights, self.states, strict=True)
        ]  # fmt: skip

        def moe_blocks(s, w):
            if self.tokens_once:
                return [SpecializedMoE(cfg, w, self.N, layer=s.index, device=self.device,
                                       wide=True)]  # fmt: skip
            if self.experts_once:
                return [SpecializedMoE(cfg, w, self.N, layer=s.index, device=self.device,
                                       chunk=self.Nc)]  # fmt: skip
            return [SpecializedMoE(cfg, w, self.Nc, layer=s.index, device=self.device) for c in C]

        # per layer: the MoE blocks, or None for a dense layer (its MLP is in self.dense_c)
        self.moe_c = [
            moe_blocks(s, w) if s.mlp == "moe" else None
            for s, w in zip(specs, self.weights, strict=True)
        ]

        def dense_mlps(s, w):
            if self.tokens_once:
                return [DenseMLPAllTokens(cfg, w, self.N, layer=s.index, device=self.device)]
            return [SpecializedDenseMLP(cfg, w, self.Nc, layer=s.index, device=self.device)
                    for c in C]  # fmt: skip

        self.dense_c = [
            dense_mlps(s, w) if s.mlp == "dense" else None
            for s, w in zip(specs, self.weights, strict=True)
        ]
        for ac, mc in zip(self.attn_c, self.moe_c, strict=True):
            if mc is not None:  # o_proj's L2 prefetch of the MoE front (DECODESCOPE_OPROJ_PREFETCH)
                for c, a in enumerate(ac):
                    a.set_prefetch(mc[min(c, len(mc) - 1)].w_front)
        self.attn = [a[0] for a in self.attn_c]
        self.moe = [m[0] if m is not None else None for m in self.moe_c]
        self.dense = [d[0] if d is not None else None for d in self.dense_c]
        self.hs = [torch.empty_like(self.x_in) for _ in specs]  # the MoE input of each layer
        self.xs = [torch.empty_like(self.x_in) for _ in range(2)]
        self.rs = [torch.empty_like(self.r_in) for _ in range(2)]
        last = (len(specs) - 1) % 2
        self.x_out, self.r_out = self.xs[last], self.rs[last]

    def _layer(self, i: int, x, r, guarded: bool) -> None:
        spec = self.specs[i]
        h, x_out, r_out = self.hs[i], self.xs[i % 2], self.rs[i % 2]
        once = self.experts_once and spec.mlp == "moe"  # the MoE half over all rows, once
        wide = self.attn_all[i]  # every token-parallel op over all rows, the decode per chunk
        with _range(f"layer.{spec.index}:{spec.kind}"):
            if wide is not None:
                second = (("dense MLP", lambda: self.dense_c[i][0].forward(h, x_out))
                          if spec.mlp == "dense"
                          else ("MoE", lambda: self.moe_c[i][0].forward(h, x_out)))  # fmt: skip
                self._run(i, None, [
                    (f"attention ({spec.attn})", lambda: wide.forward(x, r, r_out, h)),
                    second,
                ], guarded)  # fmt: skip
                return
            for c in range(self.chunks):  # one chunk unless more than MAX_STEP_TOKENS tokens
                bufs = (x, r, r_out, h, x_out)  # one chunk: the buffers themselves
                if self.chunks > 1:
                    rows = slice(c * self.Nc, (c + 1) * self.Nc)
                    bufs = tuple(b[rows] for b in bufs)
                halves = self._halves(i, c, *bufs)
                self._run(i, c, halves[:1] if once else halves, guarded)
            if once:
                self._run(i, None, self._halves(i, 0, x, r, r_out, h, x_out)[1:], guarded)

    def _halves(self, i: int, c: int, x, r, r_out, h, x_out) -> list:
        """Layer ``i``'s two halves on chunk ``c``'s rows (all of them with one chunk), as
        ``(what, thunk)``: the attention half, then the MoE block or the dense MLP."""
        spec = self.specs[i]
        attn = f"attention ({spec.attn})"
        if spec.mlp == "dense":
            return [
                (attn, lambda: self._attn_no_norm(i, x, r, r_out, h, c)),
                ("dense MLP", lambda: self.dense_c[i][c].forward_norm(r_out, x_out)),
            ]
        if self.front_norm:
            return [
                (attn, lambda: self._attn_no_norm(i, x, r, r_out, h, c)),
                ("MoE", lambda: self._moe_front_norm(i, r_out, x_out, c)),
            ]
        return [
            (attn, lambda: self.attn_c[i][c].forward(x, r, r_out, h)),
            ("MoE", lambda: self.moe_c[i][c].forward(h, x_out)),
        ]

    def _run(self, i: int, c: int | None, halves: list, guarded: bool) -> None:
        """Run ``halves``; ``guarded``: each checked (compiled, launched, synchronized), a
        failure naming the half, the layer and the shape (``c``: the sequence chunk, None: all
        of the step's rows)."""
        import torch

        for what, fn in halves:
            if not guarded:
                fn()
                continue
            try:
                fn()
                if self.device.type == "cuda":  # a fault in this half surfaces here
                    torch.cuda.synchronize(self.device)
            except Exception as e:
                spec = self.specs[i]
                part = ""
                if self.chunks > 1:
                    part = (f" (sequence chunk {c + 1}/{self.chunks})" if c is not None
                            else f" (all {self.N} tokens at once)")  # fmt: skip
                raise ValueError(
                    f"specialized {what} of layer.{spec.index}:{spec.kind}{part} failed to "
                    f"compile or run (preset {self.cfg.preset or self.cfg.model.name!r} tp_shape "
                    f"{self.cfg.tp} batch {self.batch} tokens_per_seq {self.T}): "
                    f"{type(e).__name__}: {e}"
                ) from e

    def _attn_no_norm(self, i: int, x, r, r_out, h, c: int = 0) -> None:
        """The attention half without its last launch (the post-attention RMSNorm): ``r_out``
        is the residual stream after attention (o_proj's residual epilogue wrote it)."""
        attn = self.attn_c[i][c]
        for op, fn in attn.stages_no_norm(x, r, r_out, h):
            with attn._r(op):
                fn()

    def _moe_front_norm(self, i: int, r_out, x_out, c: int = 0) -> None:
        """The MoE block with ``h = rmsnorm(r_out) * mlp_norm`` in its front kernel's prologue."""
        self.moe_c[i][c].forward_norm(r_out, x_out)

    def _steps(self, guarded: bool) -> None:
        from decodescope.kernels.specialized.utils import sigmoid_tokens

        x, r = self.x_in, self.r_in
        with sigmoid_tokens(self.N):  # DECODESCOPE_FAST_SIGMOID=auto: by the step's tokens
            for i in range(len(self.specs)):
                self._layer(i, x, r, guarded)
                x, r = self.xs[i % 2], self.rs[i % 2]

    def step(self) -> None:
        """One decode step over every layer, on the current stream (capturable)."""
        self._steps(False)

    def warmup(self) -> None:
        """One eager step that compiles every kernel; a failure names the layer and half."""
        self._steps(True)

    def refresh(self, seed: int | None = None) -> None:
        """Fresh random inputs (same buffers, same draws as StandardModel.refresh)."""
        from decodescope.kernels.weights import make_inputs

        s = self.seed + 1 if seed is None else seed
        self.seed = s
        x, r = make_inputs(self.cfg, self.N, s, self.device)
        self.x_in.copy_(x)
        self.r_in.copy_(r)

    def selected_experts(self) -> dict[int, Any]:
        """The routing of the last step: ``{layer index: topk_ids [N, k]}`` (MoE layers)."""
        import torch

        return {
            s.index: torch.cat([b.topk_ids for b in m]) if len(m) > 1 else m[0].topk_ids
            for s, m in zip(self.specs, self.moe_c, strict=True)
            if m is not None
        }

    def launches(self) -> dict[str, int]:
        """Launches per layer (attention half + MoE block or dense MLP), all chunks."""
        from decodescope.kernels.specialized import moe_block as mb

        out = {}
        n = self.chunks
        for s, a, d in zip(self.specs, self.attn, self.dense, strict=True):
            lay = f"layer.{s.index}:{s.kind}"
            if self.tokens_once:
                out[lay] = tokens_once_launches(self.cfg, s, self.batch, self.T,
                                                1 if self.decode_once else n)  # fmt: skip
                continue
            if d is not None:
                per = a.launches_no_norm + d.launches + attn_extra_launches(self.cfg, s, self.Nc)
                out[lay] = per * n
                continue
            att = a.launches_no_norm if self.front_norm else a.launches
            att += attn_extra_launches(self.cfg, s, self.Nc)
            if self.experts_once:  # front and back per chunk, the experts once over all rows
                out[lay] = att * n + 2 * n + 1 + moe_extra_launches(self.cfg, self.N)
            else:
                out[lay] = (att + len(mb.OPS) + moe_extra_launches(self.cfg, self.Nc)) * n
        return out


def layer_bytes_meta(cfg, specs, batch: int, tokens: int, selected: dict) -> tuple[dict, dict]:
    """``(layer_bytes {kind: median bytes}, distinct experts {layer: n})`` from the routing
    the step really selected (the standard workload's computation)."""
    from decodescope.kernels import bytes as kbytes

    per_kind: dict[str, list[int]] = {}
    distinct: dict[str, int] = {}
    for s in specs:
        ids = selected.get(s.index)
        per_kind.setdefault(s.kind, []).append(kbytes.layer_bytes(cfg, s.kind, batch, tokens, ids))
        if ids is not None:
            distinct[f"layer.{s.index}"] = kbytes.distinct_experts(ids)
    return {k: sorted(v)[len(v) // 2] for k, v in per_kind.items()}, distinct


def _require_gpu(dev) -> None:
    import torch

    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            "workload 'specialized' runs CuTe DSL kernels (sm_90a) and needs a CUDA GPU: "
            f"device {str(dev)!r}, torch.cuda.is_available() = {torch.cuda.is_available()} "
            "(the options are valid; decodescope.kernels.specialized.step.plan(...) gives the "
            "meta and range names without a GPU)"
        )
    major, minor = torch.cuda.get_device_capability(dev)
    if major != 9:
        name = torch.cuda.get_device_name(dev)
        raise ValueError(
            f"workload 'specialized' compiles for sm_90a (Hopper); {name} is sm_{major}{minor}"
        )


@register("specialized")
def specialized(**opts: Any) -> Workload:
    """The fused CuTe DSL decode layers (kernels/specialized), same options as ``standard``:
    preset (kimi-k3 | tiny), tp_shape, batch, tokens_per_seq (1..8), layers ("kda,mla",
    "dense,kda,mla": layer 0's attention + dense MLP first, ...),
    seed, context_len, kv_cache_dtype (bf16 | fp8_e4m3), expert_dtype (bf16), device (cuda),
    tp_world (1 | 2); and front_norm (0 | 1 | auto): the post-attention RMSNorm in the MoE front
    kernel's prologue, one launch less per layer (default: ``DECODESCOPE_FRONT_NORM``, else 0:
    the two halves as they stand).

    tp_world 2 (one process per rank, started by decodescope.tracer.distributed): joins the
    process group as the standard workload does (``standard.comm.init_from_env``), builds this
    rank's weights exactly as the standard workload does for the same ``weights`` option (rank |
    shard, kernels/sharding.py: the same seed gives the same tensors on both paths), and routes
    the reductions through the fused peer-memory kernels (:func:`enable_tp2`, ``allreduce=fused``,
    the default) or through explicit NCCL all-reduce launches around the single-GPU kernels
    (``allreduce=nccl``, ``tp2.install_nccl``: the fallback, recorded in op_impl and ranges).
    """
    import torch

    p = plan(**opts)
    device = opts.get("device")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rank, wts = 0, None
    if p.tp_world > 1:
        from decodescope.kernels import sharding
        from decodescope.kernels.standard.comm import init_from_env

        rank, dev = init_from_env(p.tp_world)  # multicast env vars forced off there
        _require_gpu(dev)
        wts = sharding.build_rank_weights(p.cfg, p.specs, p.seed, rank, p.tp_world, p.weights, dev)
    _require_gpu(dev)
    model = SpecializedModel(
        p.cfg, p.specs, p.batch, p.tokens, seed=p.seed, device=dev, weights=wts,
        front_norm=p.front_norm,
    )  # fmt: skip
    if p.tp_world > 1:
        if p.weights == "shard":
            sharding.shard_model_state_(model, rank, p.tp_world)
        start_tp2(model, allreduce=p.allreduce)
    meta = dict(p.meta)
    config = json.loads(meta["config_json"])
    if p.tp_world > 1:
        config["rank"] = rank
    first = [True]

    def update_meta() -> None:
        lb, distinct = layer_bytes_meta(p.cfg, p.specs, p.batch, p.tokens, model.selected_experts())
        meta["layer_bytes"] = lb
        config["distinct_experts"] = distinct
        config["layer_bytes_from"] = "the routing of the last refresh step"
        # tp_world 2 with nccl: the model's kernels plus the all-reduce / add launches
        config["launches"] = p.launches() if p.allreduce == "nccl" and p.tp_world > 1 else (
            model.launches())  # fmt: skip
        config["seed"] = model.seed
        meta["config_json"] = json.dumps(config, default=str)

    def step() -> None:
        model.step()

    def refresh() -> None:
        model.refresh()
        if first[0]:  # the first eager step compiles every kernel: name what fails
            model.warmup()
            first[0] = False
        else:
            model.step()  # eager, outside capture: warms up and routes the new inputs
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        if p.tp_world > 1:
            import torch.distributed as dist

            if model.tp2_workspace is not None:  # a spin that timed out: the pair is out of step
                model.tp2_workspace.check()
            dist.barrier()  # both ranks aligned before what the caller runs next (capture)
        update_meta()

    refresh()
    wl = Workload(name="specialized", step=step, refresh=refresh, meta=meta)
    wl.model = model  # type: ignore[attr-defined]  (tests and scripts reach the layers)
    wl.plan = p  # type: ignore[attr-defined]
    return wl


# -- tp_world 2 (issue 8; kernels/specialized/tp2.py) ------------------------------------------


def enable_tp2(model: SpecializedModel, ws) -> None:
    """Route ``model``'s o_proj and MoE back-end launches through the two-GPU fused reductions
    (``comm.PeerWorkspace`` ``ws``; ``oproj_allreduce`` / ``moe_allreduce``). Call on both ranks
    of a tp_world 2 process group, after building the model from that rank's weights."""
    from decodescope.kernels.specialized import tp2

    tp2.install(model, ws)


def start_tp2(model: SpecializedModel, ws=None, allreduce: str = ALLREDUCE) -> None:
    """Both ranks of a tp_world 2 group: compile every kernel of the step, then route the
    reductions through the fused kernels (``ws``: a ``comm.PeerWorkspace``, made here when
    None). Compiling first matters: a rank still compiling while its peer spins in a fused
    kernel would let the peer's 2 s spin time out. The compile step is the single-GPU step
    (each kernel the tp_world 2 step launches except the fused ones, which compile from their
    plans), run on a copy of the decode state that is put back afterwards."""
    import torch
    import torch.distributed as dist

    from decodescope.kernels.specialized import comm, tp2

    saved = [{k: v.clone() for k, v in st.items()} for st in model.states]
    model.warmup()  # compiles (single-GPU kernels, this rank's weights; outputs discarded)
    for st, sv in zip(model.states, saved, strict=True):
        for k, v in sv.items():
            st[k].copy_(v)
    del saved
    if allreduce == "nccl":  # explicit NCCL launches, no peer workspace, no spin
        tp2.install_nccl(model)
        if dist.is_initialized():
            dist.barrier()
        return
    if ws is None:
        ws = comm.PeerWorkspace.create(device=model.device)  # collective
    enable_tp2(model, ws)
    tp2.precompile(model)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    if dist.is_initialized():
        dist.barrier()  # both ranks compiled: the first fused launch pairs within the spin limit
