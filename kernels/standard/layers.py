"""Standard decode layers: vLLM's default Hopper decomposition of a Kimi K3 decoder layer.

One :class:`StandardLayer` is one decoder layer (KDA or gated MLA attention, then LatentMoE or
the dense MLP) for a fixed batch and tokens per sequence, with every intermediate buffer
allocated once: :meth:`StandardLayer.forward` launches the same kernels into the same buffers
every call, so a step of layers captures into one CUDA graph. Ops run inside
``range(f"layer.{i}.{block}.{op}")``, the layer inside ``range(f"layer.{i}:{kind}")``
(DESIGN.md section 6); a range that covers a fused kernel names every op it covers.

Kernel sequence (DESIGN.md section 9; ``|`` = second stream; all-reduces only at tp_world > 1):

- KDA: input_residual_norm, qkv_proj (merged in_proj_qkvgfab GEMM), f_b_proj GEMM,
  conv1d+kda_recurrence+gated_norm (one fused kernel; TP16: conv1d, kda_recurrence, copy,
  gated_norm), o_proj GEMM, [allreduce]
- MLA: input_residual_norm, fused_qkv_a_proj GEMM | g_proj GEMM, q_kv_norm, q_b_proj GEMM,
  w_uk_bmm, cache_insert, mla_decode (split-KV + combine), w_uv_bmm, gate_mul, o_proj GEMM,
  [allreduce]
- then residual_norm (the second AttnRes stand-in), and LatentMoE: router GEMM | latent_down
  GEMM, shared_experts (gate_up GEMM, SiTU-and-mul, down GEMM), grouped_topk, align
  (moe_align_block_size), routed_experts (fused-MoE w13, SiTU-and-mul, fused-MoE w2 with the
  routing weights), topk_sum, [latent_allreduce], latent_norm, latent_up GEMM,
  [shared_allreduce], add
- dense MLP (layer 0): gate_up GEMM, act, down GEMM
"""

from __future__ import annotations

import math

import torch

from decodescope.kernels.config import Config, LayerSpec
from decodescope.kernels.standard import ops as O
from decodescope.kernels.standard.ops import TORCH, TRITON, Ops, tk
from decodescope.kernels.weights import dequant_mxfp4, expert_weight
from decodescope.tracer import range  # noqa: A004  (shadows the builtin: never loop here)

BF16 = torch.bfloat16
BLOCK_M = 16  # fused-MoE row block (decode M)


def _clone_args(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _agree(cand, ref, make_args, outs, tol=2e-2) -> bool:
    """Run ``cand`` and ``ref`` on copies of the same fresh arguments; compare ``outs``."""
    a1 = make_args()
    a2 = _clone_args(a1)
    cand(*a1)
    ref(*a2)
    return all(O.close(a1[i], a2[i], tol) for i in outs)


class StandardLayer:
    def __init__(
        self,
        cfg: Config,
        spec: LayerSpec,
        weights: dict[str, torch.Tensor],
        state: dict[str, torch.Tensor],
        batch: int,
        tokens_per_seq: int,
        ops: Ops,
        side_stream: torch.cuda.Stream | None = None,
        tp_world: int = 1,
        kda_mode: str = "auto",
        comm=None,  # kernels.standard.comm.Comm when tp_world > 1 (None: dist.all_reduce)
    ) -> None:
        self.kda_mode = kda_mode
        self.comm = comm
        self.cfg, self.spec, self.w, self.state = cfg, spec, weights, state
        self.B, self.T = batch, tokens_per_seq
        self.N = batch * tokens_per_seq
        self.ops = ops
        self.dev = ops.device
        self.side = side_stream
        self.tp_world = tp_world
        self.i = spec.index
        self.topk_ids: torch.Tensor | None = None  # the last step's routing (for layer_bytes)
        self.topk_weights: torch.Tensor | None = None
        N, H = self.N, cfg.hidden
        self.h = self._buf(N, H)
        self.attn_out = self._red_buf(N, H)
        self.attn_red = self.attn_out  # where the attention all-reduce leaves the sum
        gemms = {
            "kda": ("attn.qkv_proj", "attn.f_b_proj", "attn.o_proj"),
            "mla": (
                "attn.g_proj",
                "attn.q_b_proj",
                "attn.w_uk_bmm",
                "attn.w_uv_bmm",
                "attn.o_proj",
            ),
        }[spec.attn]
        gemms += (
            ("mlp.gate_up", "mlp.down")
            if spec.mlp == "dense"
            else ("moe.latent_down", "moe.latent_up", "moe.shared_gate_up", "moe.shared_down")
        )
        for op in gemms:
            ops.impl.setdefault(op, "torch:cublas")
        if spec.attn == "kda":
            self._build_kda()
        else:
            self._build_mla()
        if spec.mlp == "dense":
            self._build_dense()
        else:
            self._build_moe()

    # -- helpers -----------------------------------------------------------------------------
    def _buf(self, *shape, dtype=BF16) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.dev)

    def _r(self, block: str, op: str) -> range:
        return range(f"layer.{self.i}.{block}.{op}")

    def _fork(self):
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.dev))
            return torch.cuda.stream(self.side)
        return _Null()

    def _join(self):
        if self.side is not None:
            torch.cuda.current_stream(self.dev).wait_stream(self.side)

    def _red_buf(self, *shape) -> torch.Tensor:
        """A buffer the layer all-reduces (symmetric memory for allreduce=oneshot)."""
        if self.comm is not None and self.tp_world > 1:
            return self.comm.buffer(*shape)
        return self._buf(*shape)

    def _allreduce(self, block: str, op: str, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks (tp_world > 1); returns the tensor holding the sum."""
        if self.tp_world <= 1:
            return t
        if self.comm is not None:
            self.ops.impl.setdefault(f"{block}.{op}", self.comm.impl_name)
            with self._r(block, op):
                return self.comm.all_reduce(t)
        import torch.distributed as dist

        with self._r(block, op):
            dist.all_reduce(t)
        return t

    def _norm(self, x, w, y, r_in=None, r_out=None) -> None:
        """RMSNorm (with residual add when given): Triton, vLLM or torch, as chosen."""
        impl = self._impl_norm_res if r_in is not None else self._impl_norm
        if impl == TRITON:
            tk.rmsnorm(x, w, self.cfg.eps, y, r_in, r_out)
        elif impl.startswith("vllm:"):
            self._vllm_rms(y, x, w, self.cfg.eps)
        else:
            O.rmsnorm_torch(x, w, self.cfg.eps, y, r_in, r_out)

    def _choose_norms(self) -> None:
        ops, N, H, dev = self.ops, self.N, self.cfg.hidden, self.dev

        def mk(n):
            return lambda: [torch.randn(N, n, device=dev).to(BF16), self.w["attn_norm"][:n],
                            self.cfg.eps, self._buf(N, n), torch.randn(N, n, device=dev).to(BF16),
                            self._buf(N, n)]  # fmt: skip

        def probe_tr():
            return _agree(tk.rmsnorm, O.rmsnorm_torch, mk(H), [3, 5])

        # AttnRes stand-in: a fused residual-add + RMSNorm (K3's AttnRes is one Triton kernel)
        self._impl_norm_res = ops.choose(
            "residual_norm",
            [(TRITON, ops.probed(("rmsnorm_res", N, H), probe_tr)), (TORCH, None)],
        )
        if self.spec.mlp == "moe" and self.cfg.moe.latent_dim:
            L = self.cfg.expert_dim
            self._vllm_rms = ops.vllm_op("_C.rms_norm")

            def probe_v():
                def cand(x, w, eps, y):
                    self._vllm_rms(y, x, w, eps)

                def ref(x, w, eps, y):
                    O.rmsnorm_torch(x, w, eps, y)

                return _agree(cand, ref, lambda: mk(L)()[:4], [3])

            def probe_t():
                return _agree(
                    lambda x, w, e, y: tk.rmsnorm(x, w, e, y),
                    lambda x, w, e, y: O.rmsnorm_torch(x, w, e, y),
                    lambda: mk(L)()[:4],
                    [3],
                )

            self._impl_norm = ops.choose(
                "moe.latent_norm",
                [
                    ("vllm:_C.rms_norm", ops.probed(("rms_norm", N, L), probe_v)),
                    (TRITON, ops.probed(("rmsnorm", N, L), probe_t)),
                    (TORCH, None),
                ],
            )

    # -- KDA -------------------------------------------------------------------------------
    def _build_kda(self) -> None:
        cfg, N, ops = self.cfg, self.N, self.ops
        k = cfg.kda
        D = cfg.kda_dim
        sz = cfg.kda_in_proj_sizes
        self.kda_boff = 4 * D + sz["f_a"]
        self.proj = self._buf(N, cfg.kda_in_proj_out)
        self.fbuf = self._buf(N, D)
        self.kda_o = self._buf(N, D)
        # vLLM: the fused KDA decode CUDA kernel at TP8 (heads/t = 12); at TP16 (6 heads) the
        # Triton chain it falls back to. Neither kernel is in vllm 0.24: ours stand in.
        self.kda_chain = cfg.kda_heads < 12 if self.kda_mode == "auto" else self.kda_mode == "chain"
        if self.kda_chain:
            self.kda_qkv = self._buf(N, 3 * D)
            self.kda_o32 = self._buf(N, D, dtype=torch.float32)
            self.kda_o16 = self._buf(N, D)
        usable = k.conv_kernel == 4 and (k.head_dim & (k.head_dim - 1)) == 0
        name = "attn.kda_chain" if self.kda_chain else "attn.fused_kda_decode"
        key = ("kda", self.B, self.T, D, self.kda_chain)
        cands = [(TRITON, ops.probed(key, self._probe_kda))] if usable else []
        self._impl_kda = ops.choose(name, cands + [(TORCH, None)])

    def _kda_args(self, proj, fbuf, conv_state, state, out):
        cfg = self.cfg
        return dict(
            proj=proj, f=fbuf, conv_w=self.w["conv_w"], conv_state=conv_state,
            A_log=self.w["A_log"], dt_bias=self.w["dt_bias"], state=state,
            o_norm=self.w["o_norm"], out=out, T=self.T, D=cfg.kda_dim, b_off=self.kda_boff,
            lower_bound=cfg.kda.gate_lower_bound, eps=cfg.eps,
        )  # fmt: skip

    def _kda_triton(self, proj, fbuf, conv_state, state, out) -> None:
        a = self._kda_args(proj, fbuf, conv_state, state, out)
        D, H, HD = self.cfg.kda_dim, self.cfg.kda_heads, self.cfg.kda.head_dim
        if not self.kda_chain:
            tk.kda_decode(
                a["proj"], a["f"], a["proj"], a["conv_w"], conv_state, a["A_log"], a["dt_bias"],
                state, a["o_norm"], out, T=self.T, D=D, b_off=self.kda_boff,
                lower_bound=a["lower_bound"], eps=a["eps"], do_conv=True, do_norm=True,
            )  # fmt: skip
            return
        with self._r("attn", "conv1d"):
            tk.kda_conv(proj, a["conv_w"], conv_state, self.kda_qkv, self.T, 3 * D)
        with self._r("attn", "kda_recurrence"):
            tk.kda_decode(
                proj, a["f"], self.kda_qkv, a["conv_w"], conv_state, a["A_log"], a["dt_bias"],
                state, a["o_norm"], self.kda_o32, T=self.T, D=D, b_off=self.kda_boff,
                lower_bound=a["lower_bound"], eps=a["eps"], do_conv=False, do_norm=False,
            )  # fmt: skip
        with self._r("attn", "copy"):
            self.kda_o16.copy_(self.kda_o32)
        with self._r("attn", "gated_norm"):
            tk.gated_rmsnorm(self.kda_o16, proj[:, 3 * D :], a["o_norm"], out, H, HD, self.cfg.eps)

    def _probe_kda(self) -> bool:
        cfg, N, dev = self.cfg, self.N, self.dev
        D = cfg.kda_dim
        proj = torch.randn(N, cfg.kda_in_proj_out, device=dev).to(BF16)
        fbuf = torch.randn(N, D, device=dev).to(BF16)
        cs = self.state["conv_state"].clone()
        st = self.state["kda_state"].clone()
        out1, out2 = self._buf(N, D), self._buf(N, D)
        cs2, st2 = cs.clone(), st.clone()
        self._kda_triton(proj, fbuf, cs, st, out1)
        O.kda_torch(**self._kda_args(proj, fbuf, cs2, st2, out2))
        return O.close(out1, out2) and O.close(st, st2, 1e-2) and O.close(cs, cs2, 1e-2)

    def _kda_forward(self) -> None:
        w, D = self.w, self.cfg.kda_dim
        with self._r("attn", "qkv_proj"):
            torch.mm(self.h, w["in_proj"].t(), out=self.proj)
        with self._r("attn", "f_b_proj"):
            f_a = self.proj[:, 4 * D : 4 * D + self.cfg.kda.head_dim]
            torch.mm(f_a, w["f_b"].t(), out=self.fbuf)
        st, cs = self.state["kda_state"], self.state["conv_state"]
        if self._impl_kda == TRITON:
            if self.kda_chain:
                self._kda_triton(self.proj, self.fbuf, cs, st, self.kda_o)
            else:
                with self._r("attn", "conv1d+kda_recurrence+gated_norm"):
                    self._kda_triton(self.proj, self.fbuf, cs, st, self.kda_o)
        else:
            with self._r("attn", "conv1d+kda_recurrence+gated_norm"):
                O.kda_torch(**self._kda_args(self.proj, self.fbuf, cs, st, self.kda_o))
        with self._r("attn", "o_proj"):
            torch.mm(self.kda_o, w["o_proj"].t(), out=self.attn_out)
        self.attn_red = self._allreduce("attn", "allreduce", self.attn_out)

    # -- gated MLA -------------------------------------------------------------------------
    def _build_mla(self) -> None:
        cfg, N, ops, dev = self.cfg, self.N, self.ops, self.dev
        m = cfg.mla
        nh = cfg.mla_heads
        self.mla_a = self._buf(N, cfg.mla_qkv_a_out)
        self.mla_gate = self._buf(N, cfg.mla_v_dim) if m.output_gate else None
        self.q_a_n = self._buf(N, m.q_lora_rank)
        self.kv_n = self._buf(N, m.kv_lora_rank)
        self.mla_q = self._buf(N, cfg.mla_q_b_out)
        self.q_lat_h = self._buf(nh, N, m.kv_lora_rank)
        self.o_lat_h = self._buf(nh, N, m.kv_lora_rank)
        self.o_v_h = self._buf(nh, N, m.v_head_dim)
        self.o_gated = self._buf(N, cfg.mla_v_dim)
        length = cfg.context_len + self.T
        self.n_split = tk.mla_num_splits(N, nh, length) if tk is not None else 1
        self.part_o = self._buf(N * nh * self.n_split * m.kv_lora_rank, dtype=torch.float32)
        self.part_lse = self._buf(N * nh * self.n_split, dtype=torch.float32)
        self.sm_scale = 1.0 / math.sqrt(m.qk_head_dim)
        rows = self.state["kv_cache"].shape[1]
        b = torch.arange(self.B, device=dev).repeat_interleave(self.T)
        t = torch.arange(self.T, device=dev).repeat(self.B)
        self.slots = (b * rows + cfg.context_len + t).to(torch.long)
        self.cache_scale = torch.ones(1, dtype=torch.float32, device=dev)
        kv_dtype_str = "fp8" if cfg.kv_cache_dtype == "fp8_e4m3" else "auto"
        self.kv_dtype_str = kv_dtype_str

        # fused_qkv_a: vLLM's dsv3_fused_a_gemm for 1..16 tokens at 7168 -> 2112, else cuBLAS
        self._fa_gemm = ops.vllm_op("_C.dsv3_fused_a_gemm")
        fits = N <= 16 and cfg.hidden == 7168 and cfg.mla_qkv_a_out == 2112

        def probe_fa():
            x = torch.randn(N, cfg.hidden, device=dev).to(BF16)
            out = self._buf(N, cfg.mla_qkv_a_out)
            self._fa_gemm(out, x, self.w["qkv_a"].t())
            return O.close(out, x @ self.w["qkv_a"].t())

        cands = [("vllm:_C.dsv3_fused_a_gemm", ops.probed(("fa", N), probe_fa))] if fits else []
        self._impl_fa = ops.choose("attn.fused_qkv_a_proj", cands + [("torch:cublas", None)])

        def q_kv_args():
            a = torch.randn(N, cfg.mla_qkv_a_out, device=dev).to(BF16)
            return [a, 0, m.q_lora_rank, self.w["q_a_norm"], self._buf(N, m.q_lora_rank),
                    m.q_lora_rank, m.kv_lora_rank, self.w["kv_a_norm"],
                    self._buf(N, m.kv_lora_rank), cfg.eps]  # fmt: skip

        def q_kv_torch(x, o1, n1, w1, y1, o2, n2, w2, y2, eps):
            O.rmsnorm_torch(x[:, o1 : o1 + n1], w1, eps, y1)
            O.rmsnorm_torch(x[:, o2 : o2 + n2], w2, eps, y2)

        self._q_kv_torch = q_kv_torch
        self._impl_qkv_norm = ops.choose(
            "attn.q_kv_norm",
            [
                (TRITON, ops.probed(("qkvn", N), lambda: _agree(tk.rmsnorm2, q_kv_torch,
                                                                  q_kv_args, [4, 8]))),
                (TORCH, None),
            ],
        )  # fmt: skip

        # cache insert: vLLM's concat_and_cache_mla, else ours
        self._cc = ops.vllm_op("_C_cache_ops.concat_and_cache_mla", "_C.concat_and_cache_mla")
        cache = self.state["kv_cache"]

        def ins_args():
            kv = torch.randn(N, m.kv_lora_rank, device=dev).to(BF16)
            pe = torch.randn(N, m.qk_rope_head_dim, device=dev).to(BF16)
            return [kv, pe, cache.clone()]

        def ins_vllm(kv, pe, c):
            self._cc(kv, pe, c.view(-1, 1, c.shape[-1]), self.slots, kv_dtype_str,
                     self.cache_scale)  # fmt: skip

        def ins_triton(kv, pe, c):
            tk.mla_cache_insert(kv, pe, c, self.T, cfg.context_len)

        def ins_torch(kv, pe, c):
            O.cache_insert_torch(kv, pe, c, self.T, cfg.context_len)

        def probe_ins(fn):
            def p():
                a1 = ins_args()
                a2 = _clone_args(a1)
                fn(*a1)
                ins_torch(*a2)
                sl = slice(cfg.context_len, None)
                tol = 7e-2 if cache.element_size() == 1 else 1e-2  # fp8: one-ulp rounding flips
                return O.close(a1[2][:, sl].float(), a2[2][:, sl].float(), tol)

            return p

        self._ins = {"vllm": ins_vllm, TRITON: ins_triton, TORCH: ins_torch}
        name = vllm_name = O.vllm_name(ops, "_C_cache_ops.concat_and_cache_mla",
                                       "_C.concat_and_cache_mla")  # fmt: skip
        self._impl_ins = ops.choose(
            "attn.cache_insert",
            [
                (vllm_name, ops.probed(("ins", N), probe_ins(ins_vllm))),
                (TRITON, ops.probed(("ins_t", N), probe_ins(ins_triton))),
                (TORCH, None),
            ],
        )
        del name

        def dec_args():
            ql = torch.randn(nh, N, m.kv_lora_rank, device=dev).to(BF16) * 0.5
            qp = torch.randn(N, nh, m.qk_rope_head_dim, device=dev).to(BF16)
            c = cache.clone()
            c[:, cfg.context_len :] = torch.randn_like(c[:, cfg.context_len :], dtype=BF16).to(
                c.dtype
            )
            return [ql.transpose(0, 1), qp, c, self._buf(nh, N, m.kv_lora_rank)]

        def dec_triton(ql, qp, c, out):
            tk.mla_decode(ql, qp, c, self.part_o, self.part_lse, out, T=self.T,
                          ctx=cfg.context_len, sm_scale=self.sm_scale, n_split=self.n_split)  # fmt: skip

        def dec_torch(ql, qp, c, out):
            O.mla_decode_torch(ql, qp, c, out, T=self.T, ctx=cfg.context_len,
                               sm_scale=self.sm_scale)  # fmt: skip

        self._dec = {TRITON: dec_triton, TORCH: dec_torch}
        self._impl_dec = ops.choose(
            "attn.mla_decode",
            [(TRITON, ops.probed(("dec", N, self.n_split),
                                 lambda: _agree(dec_triton, dec_torch, dec_args, [3]))),
             (TORCH, None)],
        )  # fmt: skip
        if m.output_gate:
            self._impl_gate = ops.choose(
                "attn.gate_mul",
                [(TRITON, ops.probed(("gm", N), lambda: _agree(
                    tk.gate_mul, O.gate_mul_torch,
                    lambda: [torch.randn(nh, N, m.v_head_dim, device=dev).to(BF16),
                             torch.randn(N, cfg.mla_v_dim, device=dev).to(BF16),
                             self._buf(N, cfg.mla_v_dim)], [2]))),
                 (TORCH, None)],
            )  # fmt: skip

    def _mla_forward(self) -> None:
        cfg, w, N = self.cfg, self.w, self.N
        m = cfg.mla
        nh = cfg.mla_heads
        if self.mla_gate is not None:
            with self._fork(), self._r("attn", "g_proj"):
                torch.mm(self.h, w["g_proj"].t(), out=self.mla_gate)
        with self._r("attn", "fused_qkv_a_proj"):
            if self._impl_fa.startswith("vllm:"):
                self._fa_gemm(self.mla_a, self.h, w["qkv_a"].t())
            else:
                torch.mm(self.h, w["qkv_a"].t(), out=self.mla_a)
        with self._r("attn", "q_kv_norm"):
            args = (self.mla_a, 0, m.q_lora_rank, w["q_a_norm"], self.q_a_n, m.q_lora_rank,
                    m.kv_lora_rank, w["kv_a_norm"], self.kv_n, cfg.eps)  # fmt: skip
            if self._impl_qkv_norm == TRITON:
                tk.rmsnorm2(*args)
            else:
                self._q_kv_torch(*args)
        with self._r("attn", "q_b_proj"):
            torch.mm(self.q_a_n, w["q_b"].t(), out=self.mla_q)
        q3 = self.mla_q.view(N, nh, m.qk_head_dim)
        with self._r("attn", "w_uk_bmm"):
            torch.bmm(q3[:, :, : m.qk_nope_head_dim].transpose(0, 1), w["w_uk"], out=self.q_lat_h)
        k_pe = self.mla_a[:, m.q_lora_rank + m.kv_lora_rank :]
        cache = self.state["kv_cache"]
        with self._r("attn", "cache_insert"):
            key = "vllm" if self._impl_ins.startswith("vllm:") else self._impl_ins
            self._ins[key](self.kv_n, k_pe, cache)
        with self._r("attn", "mla_decode"):
            self._dec[self._impl_dec](
                self.q_lat_h.transpose(0, 1), q3[:, :, m.qk_nope_head_dim :], cache, self.o_lat_h
            )
        with self._r("attn", "w_uv_bmm"):
            torch.bmm(self.o_lat_h, w["w_uv"], out=self.o_v_h)
        if self.mla_gate is not None:
            self._join()
            with self._r("attn", "gate_mul"):
                if self._impl_gate == TRITON:
                    tk.gate_mul(self.o_v_h, self.mla_gate, self.o_gated)
                else:
                    O.gate_mul_torch(self.o_v_h, self.mla_gate, self.o_gated)
        else:
            with self._r("attn", "transpose"):
                self.o_gated.view(N, nh, m.v_head_dim).copy_(self.o_v_h.transpose(0, 1))
        with self._r("attn", "o_proj"):
            torch.mm(self.o_gated, w["o_proj"].t(), out=self.attn_out)
        self.attn_red = self._allreduce("attn", "allreduce", self.attn_out)

    # -- LatentMoE -------------------------------------------------------------------------
    def _build_moe(self) -> None:
        cfg, N, ops, dev = self.cfg, self.N, self.ops, self.dev
        e = cfg.moe
        E, k, L, Ie, S = e.num_experts, e.top_k, cfg.expert_dim, cfg.expert_inter, cfg.shared_inter
        numel = N * k
        self.numel = numel
        max_padded = -(-(numel + E * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
        self.sorted_ids = self._buf(max_padded, dtype=torch.int32)
        self.expert_ids = self._buf(max_padded // BLOCK_M, dtype=torch.int32)
        self.ntp = self._buf(1, dtype=torch.int32)
        self.m_blocks = min(max_padded // BLOCK_M, numel)
        self.z = self._buf(N, L) if e.latent_dim else None
        self.ids_buf = self._buf(N, k, dtype=torch.int32)
        self.tw_buf = self._buf(N, k, dtype=torch.float32)
        self.w13_out = self._buf(numel, 2 * Ie)
        self.act_out = self._buf(numel, Ie)
        self.w2_out = self._buf(numel, L)
        self.routed = self._red_buf(N, L)
        self.routed_n = self._buf(N, L) if e.latent_dim else None
        self.up_out = self._buf(N, cfg.hidden)
        if S:
            self.sh13 = self._buf(N, 2 * S)
            self.sh_act = self._buf(N, S)
            self.sh_out = self._red_buf(N, cfg.hidden)
        self.situ = e.activation == "situ"
        self.beta, self.lbeta = cfg.model.situ_beta, cfg.model.situ_linear_beta

        # router GEMM: BF16 in, FP32 logits (cuBLAS with an fp32 output), else BF16 logits
        def probe_mm32():
            x = torch.randn(N, cfg.hidden, device=dev).to(BF16)
            y = torch.empty(N, E, dtype=torch.float32, device=dev)
            torch.mm(x, self.w["router"].t(), out_dtype=torch.float32, out=y)
            return y.dtype == torch.float32 and O.close(y, x.float() @ self.w["router"].float().t())

        self._impl_router = ops.choose(
            "moe.router",
            [("torch:cublas(out_dtype=fp32)", ops.probed(("mm32", N), probe_mm32)),
             ("torch:cublas(bf16)", None)],
        )  # fmt: skip
        self.logits = self._buf(
            N, E, dtype=torch.float32 if self._impl_router.endswith("fp32)") else BF16
        )

        def act_args(M, n):
            return lambda: [torch.randn(M, 2 * n, device=dev).to(BF16) * 3, self._buf(M, n),
                            self.situ, self.beta, self.lbeta]  # fmt: skip

        self._impl_act = ops.choose(
            "moe.act_and_mul",
            [(TRITON, ops.probed(("act", numel, Ie, self.situ), lambda: _agree(
                tk.act_and_mul, O.act_and_mul_torch, act_args(numel, Ie), [1]))),
             (TORCH, None)],
        )  # fmt: skip

        # routing: vLLM's grouped_topk (noaux_tc, sigmoid), else our one-kernel Triton top-k
        self._gtk = ops.vllm_op("_moe_C.grouped_topk")
        bias = self.w["router_bias"]

        def route_ref(lg):
            ids = torch.empty(N, k, dtype=torch.int32, device=dev)
            tw = torch.empty(N, k, dtype=torch.float32, device=dev)
            O.routing_torch(lg, bias, ids, tw, k, e.renormalize, e.routed_scaling)
            return ids, tw

        def same_routing(ids, tw, lg) -> bool:
            ids_r, tw_r = route_ref(lg)
            a, ia = torch.sort(ids.long(), dim=1)
            b, ib = torch.sort(ids_r.long(), dim=1)
            agree = (a == b).all(1).float().mean().item()
            return agree > 0.95 and O.close(tw.float().gather(1, ia), tw_r.gather(1, ib), 1e-2)

        def probe_gtk():
            lg = torch.randn(N, E, device=dev, dtype=self.logits.dtype)
            tw, ids = self._gtk(lg, e.n_group, e.topk_group, k, e.renormalize, e.routed_scaling,
                                bias, 1)  # fmt: skip
            return same_routing(ids, tw, lg)

        def probe_tk():
            lg = torch.randn(N, E, device=dev, dtype=self.logits.dtype)
            ids = torch.empty(N, k, dtype=torch.int32, device=dev)
            tw = torch.empty(N, k, dtype=torch.float32, device=dev)
            tk.sigmoid_topk(lg, bias, ids, tw, k, e.renormalize, e.routed_scaling)
            return same_routing(ids, tw, lg)

        pow2 = (k & (k - 1)) == 0 and e.n_group == 1
        self._impl_route = ops.choose(
            "moe.grouped_topk",
            [("vllm:_moe_C.grouped_topk", ops.probed(("gtk", N, E, k), probe_gtk))]
            + ([(TRITON, ops.probed(("stk", N, E, k), probe_tk))] if pow2 else [])
            + [(TORCH, None)],
        )

        # moe_align_block_size: vLLM's kernel (probed: grouping, padding, block experts)
        self._align = ops.vllm_op("_moe_C.moe_align_block_size")
        self.align_fill = False

        def probe_align():
            ids = torch.argsort(torch.rand(N, E, device=dev), dim=1)[:, :k].to(torch.int32)
            s1, e1, n1 = self.sorted_ids.clone(), self.expert_ids.clone(), self.ntp.clone()
            s2, e2, n2 = s1.clone(), e1.clone(), n1.clone()
            s1.fill_(-1)
            self._align(ids, E, BLOCK_M, s1, e1, n1, None)
            if int((s1[: int(n1.item())] < 0).sum().item()):
                ops.flags[("align_fill", N, E, k)] = True  # the kernel leaves padding to us
                s1.fill_(numel)
                self._align(ids, E, BLOCK_M, s1, e1, n1, None)
            O.moe_align_torch(ids, E, BLOCK_M, s2, e2, n2)
            nb = int(n2.item()) // BLOCK_M
            if int(n1.item()) != int(n2.item()) or not torch.equal(e1[:nb], e2[:nb]):
                return False
            a = torch.sort(s1[: nb * BLOCK_M].view(nb, BLOCK_M), 1).values
            b = torch.sort(s2[: nb * BLOCK_M].view(nb, BLOCK_M), 1).values
            return torch.equal(a, b)

        self._impl_align = ops.choose(
            "moe.align",
            [("vllm:_moe_C.moe_align_block_size", ops.probed(("align", N, E, k), probe_align)),
             (TORCH, None)],
        )  # fmt: skip
        self.align_fill = ops.flags.get(("align_fill", N, E, k), False)

        self.mxfp4 = "w13_q" in self.w

        def probe_fm():
            # one token, k distinct experts: rows must equal the experts' own GEMMs
            ids = torch.randperm(E, device=dev)[:k].view(1, k).to(torch.int32)
            s = torch.empty(k + E * (BLOCK_M - 1) + BLOCK_M, dtype=torch.int32, device=dev)
            eids = torch.empty(s.numel() // BLOCK_M, dtype=torch.int32, device=dev)
            ntp = torch.empty(1, dtype=torch.int32, device=dev)
            O.moe_align_torch(ids, E, BLOCK_M, s, eids, ntp)
            a = torch.randn(1, L, device=dev).to(BF16)
            c = self._buf(k, 2 * Ie)
            if self.mxfp4:
                tk.fused_moe_mxfp4(a, self.w["w13_q"], self.w["w13_s"], c, self.tw_buf, s, eids,
                                   ntp, k, k, False, k)  # fmt: skip
            else:
                tk.fused_moe(a, self.w["w13"], c, self.tw_buf, s, eids, ntp, k, k, False, k)
            ref = torch.stack([expert_weight(self.w, "w13", int(i)) @ a[0].float() for i in ids[0]])
            return O.close(c, ref)

        name = "moe.routed_experts" + ("(mxfp4 w4a16)" if self.mxfp4 else "")
        self._impl_fm = ops.choose(
            name, [(TRITON, ops.probed(("fm", L, Ie, self.mxfp4), probe_fm)), (TORCH, None)]
        )
        if self.mxfp4 and self._impl_fm == TORCH:  # a CPU: dequantize once for the torch GEMM
            self._deq = {
                n: dequant_mxfp4(self.w[f"{n}_q"], self.w[f"{n}_s"], BF16) for n in ("w13", "w2")
            }
        self._msum = ops.vllm_op("_moe_C.moe_sum")

        def probe_sum():
            x = torch.randn(N, k, L, device=dev).to(BF16)
            y = self._buf(N, L)
            self._msum(x, y)
            return O.close(y, x.float().sum(1))

        self._impl_sum = ops.choose(
            "moe.topk_sum",
            [("vllm:_moe_C.moe_sum", ops.probed(("sum", N, k, L), probe_sum)),
             ("torch:sum", None)],
        )  # fmt: skip
        self._choose_norms()

    def _routed_gemm(self, name, a, c, tw, a_div, mul_w) -> None:
        """One fused-MoE GEMM over every selected expert (``name``: w13 | w2)."""
        args = (tw, self.sorted_ids, self.expert_ids, self.ntp, self.numel, a_div, mul_w,
                self.m_blocks)  # fmt: skip
        if self._impl_fm == TRITON:
            if self.mxfp4:
                tk.fused_moe_mxfp4(a, self.w[f"{name}_q"], self.w[f"{name}_s"], c, *args)
            else:
                tk.fused_moe(a, self.w[name], c, *args)
        else:
            wt = self._deq[name] if self.mxfp4 else self.w[name]
            O.fused_moe_torch(a, wt, c, *args)

    def _act(self, x, y) -> None:
        if self._impl_act == TRITON:
            tk.act_and_mul(x, y, self.situ, self.beta, self.lbeta)
        else:
            O.act_and_mul_torch(x, y, self.situ, self.beta, self.lbeta)

    def _moe_forward(self, x_out: torch.Tensor) -> None:
        cfg, w, N = self.cfg, self.w, self.N
        e = cfg.moe
        k = e.top_k
        if e.latent_dim:
            with self._fork(), self._r("moe", "latent_down"):
                torch.mm(self.h, w["latent_down"].t(), out=self.z)
        with self._r("moe", "router"):
            if self.logits.dtype == torch.float32:
                torch.mm(self.h, w["router"].t(), out_dtype=torch.float32, out=self.logits)
            else:
                torch.mm(self.h, w["router"].t(), out=self.logits)
        if "shared_w13" in w:
            with self._r("moe", "shared_experts"):
                torch.mm(self.h, w["shared_w13"].t(), out=self.sh13)
                self._act(self.sh13, self.sh_act)
                torch.mm(self.sh_act, w["shared_w2"].t(), out=self.sh_out)
        with self._r("moe", "grouped_topk"):
            if self._impl_route.startswith("vllm:"):
                tw, ids = self._gtk(self.logits, e.n_group, e.topk_group, k, e.renormalize,
                                    e.routed_scaling, w["router_bias"], 1)  # fmt: skip
            elif self._impl_route == TRITON:
                ids, tw = self.ids_buf, self.tw_buf
                tk.sigmoid_topk(self.logits, w["router_bias"], ids, tw, k, e.renormalize,
                                e.routed_scaling)  # fmt: skip
            else:
                ids, tw = self.ids_buf, self.tw_buf
                O.routing_torch(self.logits, w["router_bias"], ids, tw, k, e.renormalize,
                                e.routed_scaling)  # fmt: skip
        self.topk_ids, self.topk_weights = ids, tw
        with self._r("moe", "align"):
            if self._impl_align.startswith("vllm:"):
                if self.align_fill:
                    self.sorted_ids.fill_(self.numel)
                self._align(ids, e.num_experts, BLOCK_M, self.sorted_ids, self.expert_ids,
                            self.ntp, None)  # fmt: skip
            else:
                O.moe_align_torch(ids, e.num_experts, BLOCK_M, self.sorted_ids, self.expert_ids,
                                  self.ntp)  # fmt: skip
        z = self.z if e.latent_dim else self.h
        if e.latent_dim:
            self._join()
        with self._r("moe", "routed_experts"):
            self._routed_gemm("w13", z, self.w13_out, tw, k, False)
            self._act(self.w13_out, self.act_out)
            self._routed_gemm("w2", self.act_out, self.w2_out, tw, 1, True)
        with self._r("moe", "topk_sum"):
            if self._impl_sum.startswith("vllm:"):
                self._msum(self.w2_out.view(N, k, -1), self.routed)
            else:
                torch.sum(self.w2_out.view(N, k, -1), dim=1, out=self.routed)
        if e.latent_dim:
            routed = self._allreduce("moe", "latent_allreduce", self.routed)
            with self._r("moe", "latent_norm"):
                self._norm(routed, w["latent_norm"], self.routed_n)
            with self._r("moe", "latent_up"):
                torch.mm(self.routed_n, w["latent_up"].t(), out=self.up_out)
        else:
            self.up_out = self._allreduce("moe", "routed_allreduce", self.routed)
        if "shared_w13" in w:
            sh_out = self._allreduce("moe", "shared_allreduce", self.sh_out)
            with self._r("moe", "add"):
                torch.add(self.up_out, sh_out, out=x_out)
        else:
            with self._r("moe", "add"):
                x_out.copy_(self.up_out)

    # -- dense MLP -------------------------------------------------------------------------
    def _build_dense(self) -> None:
        N, Dn = self.N, self.cfg.dense_inter
        self.d13 = self._buf(N, 2 * Dn)
        self.d_act = self._buf(N, Dn)
        self.situ = self.cfg.moe.activation == "situ"
        self.beta, self.lbeta = self.cfg.model.situ_beta, self.cfg.model.situ_linear_beta
        self._impl_act = self.ops.choose(
            "mlp.act_and_mul",
            [(TRITON, self.ops.probed(("act", N, Dn, self.situ), lambda: _agree(
                tk.act_and_mul, O.act_and_mul_torch,
                lambda: [torch.randn(N, 2 * Dn, device=self.dev).to(BF16) * 3,
                         self._buf(N, Dn), self.situ, self.beta, self.lbeta], [1]))),
             (TORCH, None)],
        )  # fmt: skip
        self._choose_norms()

    def _dense_forward(self, x_out: torch.Tensor) -> None:
        w = self.w
        with self._r("mlp", "gate_up"):
            torch.mm(self.h, w["dense_w13"].t(), out=self.d13)
        with self._r("mlp", "act"):
            self._act(self.d13, self.d_act)
        with self._r("mlp", "down"):
            torch.mm(self.d_act, w["dense_w2"].t(), out=x_out)
        self._allreduce("mlp", "allreduce", x_out)

    # -- the layer ---------------------------------------------------------------------------
    def poison(self) -> None:
        """NaN into every intermediate floating-point buffer of the layer (never its weights,
        state or cache scale), so that a check sees any output a kernel failed to write."""
        keep = {id(t) for t in (*self.w.values(), *self.state.values())}
        for name, v in vars(self).items():
            if name == "cache_scale" or not isinstance(v, torch.Tensor):
                continue
            if v.is_floating_point() and id(v) not in keep:
                v.fill_(float("nan"))

    def forward(self, x_in, r_in, x_out, r_out) -> None:
        """``r_out = x_in + r_in`` ... ``x_out`` = this layer's MLP output (see reference)."""
        spec, w = self.spec, self.w
        with range(f"layer.{self.i}:{spec.kind}"):
            with self._r("attn", "input_residual_norm"):
                self._norm(x_in, w["attn_norm"], self.h, r_in, r_out)
            if spec.attn == "kda":
                self._kda_forward()
            else:
                self._mla_forward()
            blk = "attn"  # the post-attention AttnRes: what a fused o_proj+allreduce covers
            with self._r(blk, "residual_norm"):
                self._norm(self.attn_red, w["mlp_norm"], self.h, r_out, r_out)
            if spec.mlp == "dense":
                self._dense_forward(x_out)
            else:
                self._moe_forward(x_out)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
