"""The model config: Kimi K3 per-rank shapes as vLLM shards them, the layer mix, validation."""

from __future__ import annotations

import pytest

from decodescope.kernels.config import (
    KIMI_K3,
    PRESETS,
    Config,
    ConfigError,
    KDAConfig,
    MoEConfig,
    get_config,
    layer_mix,
)
from decodescope.kernels.standard.model import parse_layers


@pytest.mark.parametrize(
    "tp, in_proj, heads, g_proj, q_b, expert_inter, shared_inter",
    [
        (1, 49376, 96, 12288, 18432, 3072, 6144),
        (2, 24752, 48, 6144, 9216, 1536, 3072),
        (8, 6288, 12, 1536, 2304, 384, 768),
        (16, 3216, 6, 768, 1152, 192, 384),
    ],
)
def test_kimi_k3_per_rank_shapes(tp, in_proj, heads, g_proj, q_b, expert_inter, shared_inter):
    c = get_config("kimi-k3", tp)
    assert c.kda_in_proj_out == in_proj  # DESIGN.md: 6288 x 7168 at TP8, 3216 x 7168 at TP16
    assert c.kda_heads == heads and c.mla_heads == heads
    assert c.mla_v_dim == g_proj  # g_proj 1536 x 7168 at TP8
    assert c.mla_q_b_out == q_b  # q_b 2304 x 1536 at TP8
    assert c.expert_inter == expert_inter and c.shared_inter == shared_inter
    assert c.mla_qkv_a_out == 2112  # replicated
    assert c.expert_dim == 3584 and c.moe.num_experts == 896 and c.moe.top_k == 16
    assert c.mla.latent_dim == 576
    assert sum(v for k, v in c.kda_in_proj_sizes.items() if k != "pad") <= in_proj
    assert in_proj % 16 == 0


def test_layer_mix_is_the_models_pattern():
    mix = layer_mix(KIMI_K3)
    assert len(mix) == 93
    mla = [s.index + 1 for s in mix if s.attn == "mla"]
    assert mla == [*range(4, 93, 4), 93]
    assert sum(s.attn == "kda" for s in mix) == 69
    assert [s.kind for s in mix[:5]] == ["dense", "kda", "kda", "mla", "kda"]
    assert sum(s.kind == "dense" for s in mix) == 1
    assert [s.kind for s in layer_mix(KIMI_K3, 4)] == ["dense", "kda", "kda", "mla"]
    k2 = layer_mix(PRESETS["kimi-k2"])
    assert all(s.attn == "mla" for s in k2) and k2[0].kind == "dense"


def test_presets_build_at_their_tp_shapes():
    for name, model in PRESETS.items():
        for tp in model.tp_shapes:
            c = get_config(name, tp)
            assert c.tp == tp and c.preset == name
            assert c.layer_mix(2)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: get_config("kimi-k3", 3), "tp_shape"),
        (lambda: Config(KIMI_K3, tp=5), "not divisible by tp=5"),
        (lambda: Config(KIMI_K3, tp=0), "positive"),
        (lambda: get_config("kimi-k4", 8), "unknown preset"),
        (lambda: get_config("kimi-k3", "eight"), "integer"),
        (lambda: get_config("kimi-k3", 8, kv_cache_dtype="int4"), "kv_cache_dtype"),
        (lambda: get_config("kimi-k3", 8, expert_dtype="fp16"), "expert_dtype"),
        (lambda: get_config("kimi-k3", 8, context_len=0), "context_len"),
        (
            lambda: Config(KIMI_K3.__class__(**{**KIMI_K3.__dict__, "moe": MoEConfig(top_k=900)})),
            "top_k",
        ),
        (
            lambda: Config(KIMI_K3.__class__(**{**KIMI_K3.__dict__, "moe": MoEConfig(n_group=5)})),
            "n_group",
        ),
        (
            lambda: Config(
                KIMI_K3.__class__(**{**KIMI_K3.__dict__, "kda": KDAConfig(num_heads=100)}), tp=8
            ),
            "KDA heads",
        ),
        (lambda: layer_mix(KIMI_K3, 94), "n_layers"),
    ],
)
def test_impossible_configs_say_why(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def test_parse_layers():
    c = get_config("tiny", 1)
    assert [s.kind for s in parse_layers(c, "kda,mla,dense")] == ["kda", "mla", "dense"]
    assert [s.index for s in parse_layers(c, "kda,mla")] == [0, 1]
    assert [s.kind for s in parse_layers(c, "mix:4")] == ["dense", "kda", "kda", "mla"]
    assert len(parse_layers(c, "mix")) == c.model.num_layers
    with pytest.raises(ConfigError, match="unknown layer kind"):
        parse_layers(c, "kda,ssm")
    with pytest.raises(ConfigError, match="no KDA"):
        parse_layers(get_config("kimi-k2", 8), "kda")


def test_config_is_frozen():
    c = get_config("tiny", 1)
    with pytest.raises(AttributeError):
        c.tp = 2  # type: ignore[misc]
    assert c.replace(context_len=16).context_len == 16
