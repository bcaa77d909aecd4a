"""CPU checks of the two ways (the defaults since session 39, part 52) a chunked verify step's layers (more than 64 tokens, the
token-parallel ops once over all rows, ``step.tokens_once``) run in fewer launches:

- ``DECODESCOPE_WIDE_BACK=addmm`` (``moe_block.wide_back``): the MoE back in two launches, the
  latent RMSNorm also rounding the shared experts' sum into the layer's output, then one cuBLAS
  GEMM adding into it;
- ``DECODESCOPE_WIDE_AG=1`` (``attention_layers.merged_ag``): MLA's ``qkv_a`` and ``g_proj`` as
  one cuBLAS GEMM over the two weights' rows, the split decode kernel reading ``a`` and ``g`` as
  column slices of its output (``MLASplitPlan.lda`` / ``ldg``).

The steps with them against the standard model, and their dry runs, are in
tests/test_specialized_step.py; the kernels on the H200 in tests/test_wide_ops_gpu.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("decodescope.kernels.specialized.interface")

from decodescope.kernels.config import LayerSpec, get_config  # noqa: E402
from decodescope.kernels.specialized import attention_layers as al  # noqa: E402
from decodescope.kernels.specialized import interface as itf  # noqa: E402
from decodescope.kernels.specialized import mla_decode_split as ms  # noqa: E402
from decodescope.kernels.specialized import step as S  # noqa: E402
from decodescope.kernels.weights import make_layer_weights  # noqa: E402

KNOBS = ("DECODESCOPE_WIDE_BACK", "DECODESCOPE_WIDE_AG", "DECODESCOPE_WIDE_QNORM",
         "DECODESCOPE_MLA_KERNEL")  # fmt: skip


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for k in KNOBS:
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize("tp,batch", [(8, 32), (16, 64), (8, 64), (16, 32)])
def test_verify_step_launches(monkeypatch, tp, batch):
    """The kimi-k3 verify steps past 64 tokens (B x (1 + 7)): 11 / 13 launches per KDA / MLA
    layer by default (the two-launch back and the merged projections; the issue's target is
    11); 12 / 15 with both off, as before session 39; 11 / 14 with the back alone; 12 / 14
    with the merged projections alone. Plan only: no GPU, no weights."""

    def launches():
        p = S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=8, layers="kda,mla")
        assert p.tokens_once and p.decode_once
        return tuple(p.launches().values())

    assert launches() == (11, 13)
    monkeypatch.setenv("DECODESCOPE_WIDE_BACK", "add")
    monkeypatch.setenv("DECODESCOPE_WIDE_AG", "0")
    assert launches() == (12, 15)
    monkeypatch.setenv("DECODESCOPE_WIDE_BACK", "addmm")
    assert launches() == (11, 14)
    monkeypatch.setenv("DECODESCOPE_WIDE_AG", "1")
    assert launches() == (11, 13)
    monkeypatch.setenv("DECODESCOPE_WIDE_BACK", "add")
    assert launches() == (12, 14)
    monkeypatch.delenv("DECODESCOPE_WIDE_BACK")  # DECODESCOPE_WIDE_QNORM=1 (opt-in): q_b's norm
    monkeypatch.setenv("DECODESCOPE_WIDE_QNORM", "1")  # launch goes, the decode applies it
    assert launches() == (11, 12)


def test_merged_ag_conditions(monkeypatch):
    """On by default (off with ``DECODESCOPE_WIDE_AG=0``) at the kimi-k3 verify steps where the split kernel decodes; off where
    another kernel would (it reads ``a`` and ``g`` compact), for an FP8 cache and without the
    output gate; a bad value is a one-line error naming the variable."""
    cfg = get_config("kimi-k3", 8)
    assert al.merged_ag(cfg, 32, 8)
    monkeypatch.setenv("DECODESCOPE_WIDE_AG", "0")
    assert not al.merged_ag(cfg, 32, 8)
    monkeypatch.setenv("DECODESCOPE_WIDE_AG", "1")
    assert al.merged_ag(cfg, 32, 8) and al.merged_ag(get_config("kimi-k3", 16), 64, 8)
    monkeypatch.setenv("DECODESCOPE_MLA_KERNEL", "tc")
    assert not al.merged_ag(cfg, 32, 8)
    monkeypatch.delenv("DECODESCOPE_MLA_KERNEL")
    fp8 = dataclasses.replace(cfg, kv_cache_dtype="fp8_e4m3")
    assert not al.merged_ag(fp8, 32, 8)
    mla = dataclasses.replace(cfg.mla, output_gate=False)
    ungated = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mla=mla))
    assert not al.merged_ag(ungated, 32, 8)
    monkeypatch.setenv("DECODESCOPE_WIDE_AG", "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_WIDE_AG='yes': expected 0..1"):
        al.merged_ag(cfg, 32, 8)


def test_weights_adjacent_and_merged_rows():
    """``make_layer_weights`` keeps MLA's ``qkv_a`` and ``g_proj`` as adjacent row blocks of one
    tensor (same values as before: each drawn in turn from the layer's generator), so that
    ``merged_rows`` is a view of both; weights from elsewhere get one copy, equal."""
    cfg = get_config("tiny", 1)
    w = make_layer_weights(cfg, LayerSpec(1, "mla", "moe"), seed=4)
    a, g = w["qkv_a"], w["g_proj"]
    assert a.is_contiguous() and g.is_contiguous()
    assert a.shape == (cfg.mla_qkv_a_out, cfg.hidden) and g.shape == (cfg.mla_v_dim, cfg.hidden)
    m = al.merged_rows(w, ("qkv_a", "g_proj"))
    assert m.data_ptr() == a.data_ptr() and m.is_contiguous()
    assert torch.equal(m, torch.cat([a, g]))
    # the values as the generator drew them one after the other (before the two were merged)
    gen = torch.Generator().manual_seed(4 * 1_000_003 + 1 * 7919 + 17)
    torch.randn((cfg.hidden,), generator=gen)  # attn_norm
    torch.randn((cfg.hidden,), generator=gen)  # mlp_norm
    qa = torch.randn((cfg.mla_qkv_a_out, cfg.hidden), generator=gen, dtype=torch.bfloat16)
    qa.mul_(1.0 / cfg.hidden**0.5)
    assert torch.equal(qa, a)
    apart = {"qkv_a": a.clone(), "g_proj": g.clone()}
    c = al.merged_rows(apart, ("qkv_a", "g_proj"))
    assert c.data_ptr() not in (apart["qkv_a"].data_ptr(), a.data_ptr())
    assert torch.equal(c, m)


def test_split_plan_strided_a_g_compiles():
    """The split MLA decode kernel with ``a`` and ``g`` as column slices of one ``[rows,
    a + g]`` buffer compiles for sm_90a at TP8 32x8; its PTX addresses rows by the wider stride
    (bytes) instead of ``a``'s own width; strides narrower than a row, or odd, are refused."""
    cfg = get_config("kimi-k3", 8)
    p = ms.plan_for(cfg, 32, 8)
    na, ng = cfg.mla_qkv_a_out, cfg.mla_v_dim
    q = dataclasses.replace(p, lda=na + ng, ldg=na + ng)
    assert ms.compile_plan(q) is not None
    compact = itf.ptx_text(ms.MLADecodeSplit(p), *ms._fake_args(p))
    strided = itf.ptx_text(ms.MLADecodeSplit(q), *ms._fake_args(q))

    def n(ptx, v):
        return len(re.findall(rf"\b{v}\b", ptx))

    assert n(compact, 2 * na) > 0 and n(strided, 2 * na) == 0
    assert n(strided, 2 * (na + ng)) > n(compact, 2 * (na + ng))
    with pytest.raises(ValueError, match="a's row stride 100"):
        dataclasses.replace(p, lda=100)
    with pytest.raises(ValueError, match="g's row stride 1537"):
        dataclasses.replace(p, ldg=1537)


def test_split_call_derives_strides(monkeypatch):
    """``mla_decode_split`` reads the row strides off ``a`` and ``g``: compact tensors keep the
    plan (and its compiled kernel) of before; column slices of one buffer get ``lda`` / ``ldg``;
    a transposed ``a`` is refused."""
    cfg = get_config("kimi-k3", 16)
    plans = []

    def compiled(p):
        plans.append(p)
        return lambda *a: None

    monkeypatch.setattr(ms, "compile_plan", compiled)
    monkeypatch.setattr(ms, "workspace", lambda p, dev: (None, None, None, None))
    na, ng, rows = cfg.mla_qkv_a_out, cfg.mla_v_dim, 64 * 8
    w = {"kv_a_norm": None, "w_uk": None, "w_uv": None}
    q = torch.empty(rows, cfg.mla_q_b_out, dtype=torch.bfloat16)
    cache = torch.empty(1, dtype=torch.bfloat16)
    ms.mla_decode_split(cfg, w, torch.empty(rows, na, dtype=torch.bfloat16), q,
                        torch.empty(rows, ng, dtype=torch.bfloat16), cache, None, 8)  # fmt: skip
    ag = torch.empty(rows, na + ng, dtype=torch.bfloat16)
    ms.mla_decode_split(cfg, w, ag[:, :na], q, ag[:, na:], cache, None, 8)
    assert plans[0] == ms.plan_for(cfg, 64, 8) and (plans[0].lda, plans[0].ldg) == (0, 0)
    assert (plans[1].lda, plans[1].ldg) == (na + ng, na + ng)
    assert dataclasses.replace(plans[1], lda=0, ldg=0) == plans[0]
    with pytest.raises(ValueError, match="unit column strides"):
        ms.mla_decode_split(cfg, w, torch.empty(na, rows, dtype=torch.bfloat16).t(), q,
                            ag[:, na:], cache, None, 8)  # fmt: skip


def test_folded_q_b_conditions(monkeypatch):
    """``DECODESCOPE_WIDE_QNORM`` (opt-in, session 39): off unless asked; on at the kimi-k3
    verify steps where the split kernel decodes (the kernel that applies the rstd); off where
    another kernel would and for an FP8 cache; a bad value is a one-line error."""
    cfg = get_config("kimi-k3", 8)
    assert not al.folded_q_b(cfg, 32, 8)
    monkeypatch.setenv("DECODESCOPE_WIDE_QNORM", "1")
    assert al.folded_q_b(cfg, 32, 8) and al.folded_q_b(get_config("kimi-k3", 16), 64, 8)
    monkeypatch.setenv("DECODESCOPE_MLA_KERNEL", "tc")
    assert not al.folded_q_b(cfg, 32, 8)
    monkeypatch.delenv("DECODESCOPE_MLA_KERNEL")
    assert not al.folded_q_b(dataclasses.replace(cfg, kv_cache_dtype="fp8_e4m3"), 32, 8)
    monkeypatch.setenv("DECODESCOPE_WIDE_QNORM", "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_WIDE_QNORM='yes': expected 0..1"):
        al.folded_q_b(cfg, 32, 8)
