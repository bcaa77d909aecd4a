"""Tensor-core FLOPs one decoder layer does per rank in one decode step, by the parts of
:func:`decodescope.kernels.bytes.layer_bytes_breakdown`.

The bytes floor (``layer_bytes / copy bandwidth``, DESIGN.md section 7) bounds a layer at decode
batch sizes. Past a few hundred rows (the verify steps of 32 or 64 sequences of 1 + 7 tokens)
the projections become bound by the tensor cores instead: the MoE back's up-projection over
512 rows is 512 x 3584 x 7168 x 2 = 26.3 GFLOP (TP8), more time at the GEMM rate than its 51 MB
take at the copy rate. ``layer_flops_breakdown`` counts, per part, the multiply-adds of the
matrix products (2 FLOPs each) that a tensor-core kernel does:

- every projection: ``2 x rows x out x in``, ``rows = batch x tokens_per_seq``;
- MLA: the absorbed ``W_UK`` / ``W_UV`` products per row and head, and the attention over the
  latent cache (scores over ``kv_lora + rope``, values over ``kv_lora``), each of a sequence's
  ``T`` new rows attending to the context and to the new rows up to its own (causal);
- the routed experts: ``rows x top_k`` token-expert pairs, each through w13 and w2 (all
  pairs, whichever experts they hit); the shared experts per row; the dense MLP per row.

Left out, as FLOPs that no tensor-core rate bounds: the KDA recurrence and short convolution
(FP32 vector work per token), norms, activations, the router's top-k. Their parts count zero
here, so their ops keep the bytes floor alone. The compute floor of a part is its FLOPs over
the GEMM rate measured beside the run (:func:`decodescope.kernels.bandwidth.gemm_tflops`).
"""

from __future__ import annotations

from decodescope.kernels.config import Config


def _mm(rows: int, out_f: int, in_f: int) -> int:
    return 2 * rows * out_f * in_f


def layer_flops_breakdown(cfg: Config, kind: str, batch: int, tokens_per_seq: int = 1
                          ) -> dict[str, int]:  # fmt: skip
    """Per-part tensor-core FLOPs of one layer of ``kind`` (kda | mla | dense) for ``batch``
    sequences of ``tokens_per_seq`` new tokens; the part names are those of
    :func:`.bytes.layer_bytes_breakdown` (a part without matrix products is absent)."""
    rows = batch * tokens_per_seq
    H = cfg.hidden
    attn = "mla" if kind == "mla" or cfg.model.kda is None else "kda"
    out: dict[str, int] = {}
    if attn == "kda":
        k = cfg.kda
        out["in_proj"] = _mm(rows, cfg.kda_in_proj_out, H)
        out["f_b"] = _mm(rows, cfg.kda_dim, k.head_dim)
        out["o_proj"] = _mm(rows, H, cfg.kda_dim)
    else:
        m = cfg.mla
        nh, T = cfg.mla_heads, tokens_per_seq
        out["fused_qkv_a"] = _mm(rows, cfg.mla_qkv_a_out, H)
        if m.output_gate:
            out["g_proj"] = _mm(rows, cfg.mla_v_dim, H)
        out["q_b"] = _mm(rows, cfg.mla_q_b_out, m.q_lora_rank)
        out["w_uk_uv"] = rows * nh * (_mm(1, m.kv_lora_rank, m.qk_nope_head_dim)
                                      + _mm(1, m.v_head_dim, m.kv_lora_rank))  # fmt: skip
        # keys seen by the sequence's T new rows: the context, then 1..T of the new rows
        keys = T * cfg.context_len + T * (T + 1) // 2
        per_key = 2 * (m.kv_lora_rank + m.qk_rope_head_dim) + 2 * m.kv_lora_rank
        out["kv_cache_read"] = batch * nh * keys * per_key
        out["o_proj"] = _mm(rows, H, cfg.mla_v_dim)
    if kind == "dense":
        out["dense_mlp"] = _mm(rows, 3 * cfg.dense_inter, H)
        return out
    e = cfg.moe
    out["router"] = _mm(rows, e.num_experts, H)
    if e.latent_dim:
        out["latent_down_up"] = 2 * _mm(rows, cfg.expert_dim, H)
    if e.n_shared:
        out["shared_experts"] = _mm(rows, 3 * cfg.shared_inter, H)
    out["routed_experts"] = _mm(rows * e.top_k, 3 * cfg.expert_inter, cfg.expert_dim)
    return out


def layer_flops(cfg: Config, kind: str, batch: int, tokens_per_seq: int = 1) -> int:
    """Total of :func:`layer_flops_breakdown`."""
    return sum(layer_flops_breakdown(cfg, kind, batch, tokens_per_seq).values())


def op_flops(parts: dict[str, int], ops: list[str]) -> dict[str, int]:
    """FLOPs per op of one layer: each op's parts (:func:`.bytes.op_parts`, the fractions the
    bytes use: the halves of the latent projections and of ``W_UK`` / ``W_UV`` do equal work, the
    dense and shared MLPs' gate-up is 2/3 of theirs) over the FLOP parts; parts without
    FLOPs (state, cache writes, norms) count zero."""
    from decodescope.kernels.bytes import op_parts

    return {op: int(round(sum(parts.get(p, 0) * x for p, x in op_parts(op).items())))
            for op in ops}  # fmt: skip


def compute_floor_us(flops: int | float, gemm_tflops: float) -> float:
    """The compute floor in microseconds at ``gemm_tflops`` TFLOP/s."""
    return flops / (gemm_tflops * 1e12) * 1e6
