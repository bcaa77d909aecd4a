"""The ``specialized`` workload on a CPU (no GPU needed): option validation, meta, the ranges
and launches each layer uses (a dry run with the CuTe kernels replaced by recorders), the same
weights / state / inputs as the standard workload, and the step's wiring computing the standard
function when each half is replaced by its torch reference.

The real kernels run in tests/test_specialized_step_gpu.py (H200)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
# the package's interface module first: it sets CUTE_DSL_ARCH (sm_90a) before cutlass loads, so
# that this file compiles for Hopper when it runs alone too
pytest.importorskip("decodescope.kernels.specialized.interface")

from decodescope import tracer  # noqa: E402
from decodescope.kernels.reference import rel_l2  # noqa: E402
from decodescope.kernels.specialized import step as S  # noqa: E402

TINY = {"preset": "tiny", "tp_shape": 1}


def test_registered():
    from decodescope.kernels.workloads import WORKLOADS

    assert WORKLOADS["specialized"] is S.specialized


def test_capture_child_finds_it():
    from decodescope.tracer.child import _find_workload

    assert _find_workload("specialized") is S.specialized


def test_plan_meta_tiny():
    p = S.plan(**TINY, batch=3, tokens_per_seq=2, layers="kda,mla", seed=5)
    m = p.meta
    assert m["workload"] == "specialized" and m["backend"] == "specialized"
    assert (m["preset"], m["batch"], m["tokens_per_seq"], m["tp_shape"], m["tp_world"]) == (
        "tiny", 3, 2, 1, 1,
    )  # fmt: skip
    assert set(m["layer_bytes"]) == {"kda", "mla"}
    assert all(v > 0 for v in m["layer_bytes"].values())
    cfg = json.loads(m["config_json"])
    assert cfg["layers"] == ["0:kda", "1:mla"]
    assert cfg["seed"] == 5
    assert cfg["op_impl"] and set(cfg["op_impl"].values()) == {"cute:decodescope"}
    assert any(k.startswith("attn.") for k in cfg["op_impl"])
    assert any(k.startswith("moe.") for k in cfg["op_impl"])
    assert cfg["launches"] == {"layer.0:kda": 7, "layer.1:mla": 8}
    assert cfg["launches_per_kind"] == {"kda": 7, "mla": 8}
    assert all(n <= 11 for n in cfg["launches"].values())  # issue 5's target
    assert cfg["ranges"] == p.range_names()


def test_plan_records_kernel_env(monkeypatch):
    """Kernel choices forced through DECODESCOPE_* variables are named in the run's config."""
    monkeypatch.setenv("DECODESCOPE_MOE_BACK", "simt")
    monkeypatch.setenv("DECODESCOPE_GIT_COMMIT", "abc1234")
    monkeypatch.setenv("DECODESCOPE_CAPTURE_OWNER", "1")  # the capture's handshake: not a choice
    cfg = json.loads(S.plan(**TINY).meta["config_json"])
    assert cfg["kernel_env"]["DECODESCOPE_MOE_BACK"] == "simt"
    assert "DECODESCOPE_GIT_COMMIT" not in cfg["kernel_env"]
    assert not [k for k in cfg["kernel_env"] if k.startswith("DECODESCOPE_CAPTURE_")]


def test_range_names_follow_the_scheme():
    p = S.plan(**TINY, layers="kda,mla,mla")
    names = p.range_names()
    assert list(names) == ["layer.0:kda", "layer.1:mla", "layer.2:mla"]
    for layer, ops in names.items():
        i = layer.split(":")[0]
        assert all(o.startswith(f"{i}.attn.") or o.startswith(f"{i}.moe.") for o in ops)
        blocks = [o.split(".")[2] for o in ops]
        assert blocks == sorted(blocks)  # attention first, then the MoE block
    assert "layer.1.attn.w_uk_bmm+cache_insert+mla_decode+w_uv_bmm+gate_mul" in names["layer.1:mla"]
    assert "layer.0.attn.conv1d+kda_recurrence+gated_norm" in names["layer.0:kda"]


@pytest.mark.parametrize(
    "opts, words",
    [
        ({"colour": "red"}, ["unknown option", "colour"]),
        ({"backend": "standard"}, ["backend"]),
        ({"batch": "x"}, ["batch", "integer"]),
        ({"batch": 0}, ["batch"]),
        ({"tokens_per_seq": 9}, ["tokens_per_seq"]),
        ({"preset": "nope"}, ["unknown preset"]),
        ({"tp_shape": 3}, ["tp_shape"]),
        ({"layers": "kda,xyz"}, ["unknown layer kind"]),
        ({"tp_world": 3}, ["tp_world=3", "two-rank"]),
        ({"tp_world": 2, "allreduce": "oneshot"}, ["allreduce", "fused"]),
        ({"tp_world": 2, "weights": "half"}, ["weights"]),
        # more than 64 tokens run in sequence chunks, at tp_world 1 only
        ({"layers": "dense,kda", "batch": 65, "tp_world": 2}, ["65 tokens", "tp_world 1 only"]),
        ({"expert_dtype": "mxfp4"}, ["MoE", "mxfp4"]),
        ({"batch": 65, "tokens_per_seq": 2, "tp_world": 2}, ["130 tokens", "tp_world 1"]),
    ],
)
def test_option_validation(opts, words):
    o = {**TINY, **opts}
    if "preset" in opts and opts["preset"] != "tiny":
        o.pop("tp_shape")
    with pytest.raises(ValueError) as ei:
        S.plan(**o)
    msg = str(ei.value)
    for w in words:
        assert w.lower() in msg.lower(), msg


def test_unusable_message_names_preset_and_shape():
    with pytest.raises(ValueError) as ei:
        S.plan(preset="kimi-k3", tp_shape=8, batch=64, tokens_per_seq=8, tp_world=2)
    msg = str(ei.value)
    assert "kimi-k3" in msg and "batch 64" in msg and "tokens_per_seq 8" in msg
    assert "512 tokens per step" in msg and "tp_world 1 only" in msg
    with pytest.raises(ValueError) as ei:
        S.plan(preset="kimi-k3", tp_shape=8, kv_cache_dtype="fp8_e4m3", layers="mla",
               expert_dtype="mxfp4")  # fmt: skip
    assert "expert" in str(ei.value)


@pytest.mark.parametrize("tp", [8, 16])
def test_launches_without_route_kernel(monkeypatch, tp):
    """The declared launches follow DECODESCOPE_MOE_T1_ROUTE: with ``w13`` the one-token
    experts run two kernels (no route launch), as the H200 traces of session 28 counted
    (notes/gpu-logs/s28/n3: KDA 9 -> 8, MLA 10 -> 9 kernels at TP16 batch 1)."""

    def launches(batch):
        return S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=1,
                      layers="dense,kda,mla").launches()  # fmt: skip

    monkeypatch.delenv("DECODESCOPE_MOE_T1_ROUTE", raising=False)
    base, eight = launches(1), launches(8)
    assert base == {"layer.0:dense": 5, "layer.1:kda": 9, "layer.2:mla": 10}
    monkeypatch.setenv("DECODESCOPE_MOE_T1_ROUTE", "w13")
    assert launches(1) == {k: v - (":dense" not in k) for k, v in base.items()}
    assert launches(8) == eight  # more than one token: the grouped experts' three launches


def test_chunking(monkeypatch):
    assert S.chunking(64, 1) == (64, 1) and S.chunking(8, 8) == (8, 1)
    assert S.chunking(32, 8) == (8, 4) and S.chunking(64, 8) == (8, 8)
    assert S.chunking(9, 8) == (3, 3) and S.chunking(13, 8) == (1, 13)  # equal chunks
    monkeypatch.setenv(S.CHUNK_EXPERTS_ENV, "chunk")  # the whole layer per chunk
    p = S.plan(preset="kimi-k3", tp_shape=8, batch=32, tokens_per_seq=8)
    one = S.plan(preset="kimi-k3", tp_shape=8, batch=8, tokens_per_seq=8)
    assert p.chunk == (8, 4) and p.chunk_tokens == 64 and not p.experts_once
    # each chunk is the 8x8 step's launches; the ranges repeat per chunk, in order
    assert p.launches() == {k: 4 * v for k, v in one.launches().items()}
    assert p.range_names() == {k: v * 4 for k, v in one.range_names().items()}
    cfg = json.loads(p.meta["config_json"])
    assert cfg["chunks"] == {"sequences": 8, "chunks": 4, "experts": "chunk"}
    assert "each layer runs in 4 chunks of 8 sequences" in p.meta["notes"]
    assert "x4" in p.meta["notes"]
    assert json.loads(one.meta["config_json"])["chunks"] == {"sequences": 8, "chunks": 1}
    assert "chunks" not in one.meta["notes"] and not one.experts_once


@pytest.mark.parametrize("tp,batch,n", [(8, 32, 4), (16, 32, 4), (8, 64, 8), (16, 64, 8)])
def test_chunking_experts_once(monkeypatch, tp, batch, n):
    """The default for a chunked step: the attention ranges per chunk, then the MoE ranges
    once; the front and back ranges hold a launch per chunk, the experts range the grouped
    kernels' three launches over all tokens."""
    monkeypatch.delenv(S.CHUNK_EXPERTS_ENV, raising=False)
    monkeypatch.setenv(S.CHUNK_TOKEN_OPS_ENV, "chunk")  # session 20's layout (the A/B)
    p = S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=8)
    one = S.plan(preset="kimi-k3", tp_shape=tp, batch=8, tokens_per_seq=8)
    assert p.experts_once and not p.tokens_once and p.chunk == (8, n)
    for lay, ops in one.range_names().items():
        attn = [o for o in ops if ".attn." in o]
        moe = [o for o in ops if ".moe." in o]
        assert attn + moe == ops and len(moe) == 3
        assert p.range_names()[lay] == attn * n + moe
        # one chunk: attention + front + 3 expert kernels + back; the attention, front and
        # back launches n times, the expert kernels once
        att = one.launches()[lay] - 5
        assert p.launches()[lay] == n * (att + 2) + 3
    cfg = json.loads(p.meta["config_json"])
    assert cfg["chunks"] == {"sequences": 8, "chunks": n, "experts": "once"}
    assert "experts once over all tokens" in p.meta["notes"]
    monkeypatch.setenv(S.CHUNK_EXPERTS_ENV, "sometimes")
    with pytest.raises(ValueError, match="DECODESCOPE_CHUNK_EXPERTS='sometimes'"):
        S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=8)


def test_kimi_k2_moe_is_not_latent():
    with pytest.raises(ValueError, match="LatentMoE"):
        S.plan(preset="kimi-k2", tp_shape=8, layers="mla")


def test_kimi_k3_points_are_usable():
    for tp in (8, 16):
        for b, t in ((1, 1), (8, 1), (32, 1), (64, 1), (8, 8), (1, 8), (32, 8), (64, 8)):
            S.plan(preset="kimi-k3", tp_shape=tp, batch=b, tokens_per_seq=t)


def test_factory_without_cuda_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in (None, "cpu"):
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            S.specialized(**TINY, device=dev)
    # an invalid option is reported before the missing GPU
    with pytest.raises(ValueError, match="unknown option"):
        S.specialized(**TINY, bogus=1)


# -- the model on a CPU -----------------------------------------------------------------------


def _model(batch=2, tokens=2, layers="kda,mla", seed=0, front_norm=0):
    p = S.plan(**TINY, batch=batch, tokens_per_seq=tokens, layers=layers, seed=seed,
               front_norm=front_norm)  # fmt: skip
    m = S.SpecializedModel(p.cfg, p.specs, batch, tokens, seed=seed, device="cpu",
                           front_norm=p.front_norm)  # fmt: skip
    return p, m


@pytest.mark.parametrize("front_norm", [0, 1])
def test_dry_run_ranges_and_launches(monkeypatch, front_norm):
    """Every launch goes through interface.compiled: record the range path open at each."""
    from decodescope.kernels.specialized import interface as itf

    calls: list[tuple[str, str]] = []

    def fake_compiled(key, build):
        return lambda *a, **k: calls.append((tracer.current_path(), str(key[0])))

    monkeypatch.setattr(itf, "compiled", fake_compiled)
    p, m = _model(batch=2, tokens=2, layers="kda,mla", front_norm=front_norm)
    with tracer.range("step"):
        m.step()
    assert tracer.current_path() == ""
    want = [f"step/{lay}/{op}" for lay, ops in p.range_names().items() for op in ops]
    assert [c[0] for c in calls] == want  # one launch per fused-op range, in order
    assert m.launches() == p.launches()
    per_layer: dict[str, int] = {}
    for path, _ in calls:
        lay = path.split("/")[1]
        per_layer[lay] = per_layer.get(lay, 0) + 1
    assert per_layer == p.launches()
    want_n = {"layer.0:kda": 7, "layer.1:mla": 8}
    assert p.launches() == {k: v - front_norm for k, v in want_n.items()}
    names = [c[0] for c in calls]
    if front_norm:
        assert not any(n.endswith(".attn.residual_norm") for n in names)
        assert "step/layer.0:kda/layer.0.moe.residual_norm+router+latent_down+shared_experts" in (
            names
        )
    else:
        assert "step/layer.0:kda/layer.0.attn.residual_norm" in names


@pytest.mark.parametrize("front_norm", [0, 1])
@pytest.mark.parametrize("once", ["once", "chunk"])
def test_dry_run_chunked_ranges_and_launches(monkeypatch, once, front_norm):
    """A chunked step (tiny shapes, the token limit lowered to 8): every launch goes through
    interface.compiled under the range the plan names, in order, and the launch counts of the
    plan, the model and the trace agree, with the experts once over all 16 tokens or per
    chunk (``DECODESCOPE_CHUNK_EXPERTS``)."""
    from decodescope.kernels.specialized import interface as itf

    calls: list[tuple[str, str]] = []

    def fake_compiled(key, build):
        return lambda *a, **k: calls.append((tracer.current_path(), str(key[0])))

    monkeypatch.setattr(itf, "compiled", fake_compiled)
    monkeypatch.setattr(S, "MAX_STEP_TOKENS", 8)
    monkeypatch.setenv(S.CHUNK_EXPERTS_ENV, once)
    monkeypatch.setenv(S.CHUNK_TOKEN_OPS_ENV, "chunk")  # the front / back per chunk
    p, m = _model(batch=16, tokens=1, layers="kda,mla", front_norm=front_norm)
    assert m.chunks == 2 and m.experts_once == p.experts_once == (once == "once")
    with tracer.range("step"):
        m.step()
    # a range per op (the plan's, in order); the experts range holds three launches, and with
    # the experts once the front and back ranges one per chunk
    assert _launches_by_range(p, [c[0] for c in calls]) == p.launches() == m.launches()
    experts = [k for path, k in calls if "moe.grouped_topk" in path]
    n_expert_runs = 1 if once == "once" else 2
    assert experts == ["moe_grouped_route", "moe_grouped_w13", "moe_grouped_w2"] * (
        2 * n_expert_runs
    )  # two MoE layers


def _launches_by_range(p, paths: list[str]) -> dict[str, int]:
    """The recorded launches' range paths open once per op of the plan, in its order (a range
    may hold several launches); returns the launches per layer."""
    uniq = [x for i, x in enumerate(paths) if i == 0 or x != paths[i - 1]]
    assert uniq == [f"step/{lay}/{op}" for lay, ops in p.range_names().items() for op in ops]
    per_layer: dict[str, int] = {}
    for path in paths:
        lay = path.split("/")[1]
        per_layer[lay] = per_layer.get(lay, 0) + 1
    return per_layer


def test_front_norm_option(monkeypatch):
    monkeypatch.delenv(S.FRONT_NORM_ENV, raising=False)
    assert S.plan(**TINY, batch=16, front_norm="auto").front_norm
    assert not S.plan(**TINY, batch=17, front_norm="auto").front_norm
    assert not S.plan(**TINY).front_norm  # default: the halves as they stand
    assert S.plan(**TINY, front_norm="1").front_norm
    with pytest.raises(ValueError, match="front_norm"):
        S.plan(**TINY, front_norm="maybe")
    cfg = json.loads(S.plan(**TINY, front_norm=1).meta["config_json"])
    assert cfg["front_norm"] is True
    # DECODESCOPE_FRONT_NORM: the option's default (a recorded knob, so bench can A/B it)
    monkeypatch.setenv(S.FRONT_NORM_ENV, "1")
    cfg = json.loads(S.plan(**TINY).meta["config_json"])
    assert cfg["front_norm"] is True and cfg["kernel_env"].get(S.FRONT_NORM_ENV) == "1"
    assert not S.plan(**TINY, front_norm=0).front_norm  # the option wins
    monkeypatch.setenv(S.FRONT_NORM_ENV, "auto")
    assert S.plan(**TINY, batch=16).front_norm and not S.plan(**TINY, batch=17).front_norm
    monkeypatch.setenv(S.FRONT_NORM_ENV, "yes please")
    with pytest.raises(ValueError, match="DECODESCOPE_FRONT_NORM='yes please': expected 0, 1"):
        S.plan(**TINY)
    assert "moe.residual_norm+router+latent_down+shared_experts" in cfg["op_impl"]
    # 1 token: the expert part is experts_t1's three launches (the default since s10/r2)
    assert cfg["launches"] == {"layer.0:kda": 8, "layer.1:mla": 9}


def test_fp8_cache_is_accepted():
    S.plan(**TINY, kv_cache_dtype="fp8_e4m3")


def test_same_weights_state_inputs_as_standard():
    from decodescope.kernels.standard.model import StandardModel

    p, m = _model(batch=2, tokens=1, seed=7)
    std = StandardModel(p.cfg, p.specs, 2, 1, seed=7, device="cpu")
    for a, b in zip(m.weights, std.weights, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for a, b in zip(m.states, std.states, strict=True):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True)
    assert torch.equal(m.x_in, std.x_in) and torch.equal(m.r_in, std.r_in)
    m.refresh()
    std.refresh()
    assert torch.equal(m.x_in, std.x_in) and torch.equal(m.r_in, std.r_in)
    # the halves use the model's own state tensors (updated in place)
    for a, st in zip(m.attn, m.states, strict=True):
        assert a.state is st


def test_layer_bytes_from_routing():
    from decodescope.kernels import bytes as kbytes

    p, m = _model(batch=4, tokens=1)
    k = p.cfg.moe.top_k
    for moe in m.moe:
        moe.topk_ids.copy_(torch.arange(4 * k, dtype=torch.int32).view(4, k) % 8)
    lb, distinct = S.layer_bytes_meta(p.cfg, p.specs, 4, 1, m.selected_experts())
    assert distinct == {"layer.0": 8, "layer.1": 8}
    assert lb["kda"] == kbytes.layer_bytes(p.cfg, "kda", 4, 1, 8)
    assert lb["mla"] == kbytes.layer_bytes(p.cfg, "mla", 4, 1, 8)


def _rel(a, b, rows=None):
    a, b = a.double(), b.double()
    if rows is not None:
        a, b = a[rows], b[rows]
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("once", [False, True])
@pytest.mark.parametrize("front_norm", [0, 1])
@pytest.mark.parametrize(
    "batch, tokens, max_tokens", [(3, 1, 64), (2, 3, 64), (4, 1, 2), (3, 2, 2), (2, 3, 3)]
)
def test_wiring_with_reference_halves_matches_standard(
    monkeypatch, batch, tokens, max_tokens, front_norm, once
):
    """Each half replaced by its chained torch reference (attention_ref, moe_block_ref): the
    step's wiring (buffers, residual stream, state in place, layer order; with front_norm, the
    attention half without its RMSNorm launch and the MoE half normalizing r_out; with a token
    limit below the step's tokens, the sequence chunks: rows, state and cache views; ``once``:
    the MoE half once over all rows after every chunk's attention half) must give the standard
    model's step on the CPU."""
    from decodescope.kernels.specialized import attention_layers as al
    from decodescope.kernels.specialized import moe_block as mb
    from decodescope.kernels.specialized import rmsnorm as rms
    from decodescope.kernels.standard.model import StandardModel

    monkeypatch.setattr(S, "MAX_STEP_TOKENS", max_tokens)  # chunks on the tiny shapes
    monkeypatch.setattr(S, "experts_once", lambda cfg, b, t: once and S.chunking(b, t)[1] > 1)
    monkeypatch.setenv(S.CHUNK_TOKEN_OPS_ENV, "chunk")  # the halves replaced here are per chunk
    p, m = _model(batch=batch, tokens=tokens, layers="kda,mla,kda", seed=3, front_norm=front_norm)
    assert (m.per, m.chunks) == S.chunking(batch, tokens) == p.chunk
    assert (m.chunks > 1) == (batch * tokens > max_tokens)
    assert m.experts_once == p.experts_once == (once and m.chunks > 1)
    if m.experts_once:  # one block per layer over all rows, its front / back per chunk
        n = batch * tokens
        assert all(len(b) == 1 and (b[0].N, b[0].chunks) == (n, m.chunks) for b in m.moe_c)
    w_of = {
        id(b): w for blocks, w in zip(m.moe_c, m.weights, strict=True) for b in blocks
    }  # every chunk's block

    def attn_forward(self, x_in, r_in, r_out, h_out):
        r, h, ns = al.attention_ref(self.cfg, self.spec, self.w, self.state, x_in, r_in, self.T)
        r_out.copy_(r)
        h_out.copy_(h)
        for k, v in ns.items():
            self.state[k].copy_(v)

    def attn_stages(self, x_in, r_in, r_out, h_out):
        def body():  # everything up to o_proj's residual epilogue: r_out only
            r, _, ns = al.attention_ref(self.cfg, self.spec, self.w, self.state, x_in, r_in,
                                        self.T)  # fmt: skip
            r_out.copy_(r)
            for k, v in ns.items():
                self.state[k].copy_(v)

        def norm():
            raise AssertionError("front_norm must skip the attention's residual_norm launch")

        return [("body", body), ("residual_norm", norm)]

    def moe_forward(self, h, out):
        o, ids = mb.moe_block_ref(self.cfg, w_of[id(self)], h)
        out.copy_(o)
        self.topk_ids.copy_(ids)

    def moe_forward_norm(self, r, out):
        h = rms.rmsnorm_ref(r, w_of[id(self)]["mlp_norm"], self.cfg.eps)
        moe_forward(self, h, out)

    monkeypatch.setattr(al.SpecializedAttention, "forward", attn_forward)
    monkeypatch.setattr(al.SpecializedAttention, "stages", attn_stages)
    monkeypatch.setattr(mb.SpecializedMoE, "forward", moe_forward)
    monkeypatch.setattr(mb.SpecializedMoE, "forward_norm", moe_forward_norm)
    std = StandardModel(p.cfg, p.specs, batch, tokens, seed=3, device="cpu")
    m.step()
    std.step()
    _assert_step_matches(p, m, std, batch, tokens)


def _assert_step_matches(p, m, std, batch, tokens) -> None:
    """After one step of each: the specialized model's outputs and states against the standard
    model's, on the rows whose routing agrees in every layer (a near-tie may flip one; the tiny
    shapes rarely do)."""
    ok = torch.ones(batch * tokens, dtype=torch.bool)
    sel = m.selected_experts()
    for i, lay in enumerate(std.layers):
        a = torch.sort(sel[m.specs[i].index].long(), 1).values
        b = torch.sort(lay.topk_ids.long(), 1).values
        ok &= (a == b).all(1)
    ok = ok.view(batch, tokens).all(1)
    assert ok.float().mean() >= 0.5, "routing differs in most sequences"
    rows = ok.repeat_interleave(tokens)
    # three layers of bf16 differences (the CPU standard path keeps BF16 router logits)
    assert _rel(m.x_out, std.x_out, rows) < 3e-2
    assert _rel(m.r_out, std.r_out, rows) < 3e-2
    ctx = p.cfg.context_len
    for i, (a, b) in enumerate(zip(m.states, std.states, strict=True)):
        # layer 0's state depends on the step's inputs only; a deeper KDA state amplifies its
        # input's difference (u = beta * (v - k.S) cancels), so it gets a looser bound
        tol = 2e-2 if i == 0 else 1.5e-1
        for k in a:
            ga, gb = a[k][ok], b[k][ok]
            if k == "kv_cache":
                ga, gb = ga[:, ctx:], gb[:, ctx:]
            assert _rel(ga, gb) < tol, (i, k)


# -- scripts/gpu_steps.py's comparison, on the CPU with reference halves -----------------------


def _gpu_steps():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "gpu_steps.py"
    spec = importlib.util.spec_from_file_location("gpu_steps", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference_halves(monkeypatch, m):
    from decodescope.kernels.specialized import attention_layers as al
    from decodescope.kernels.specialized import moe_block as mb

    w_of = {id(b): w for blocks, w in zip(m.moe_c, m.weights, strict=True) for b in blocks}

    def attn_forward(self, x_in, r_in, r_out, h_out):
        r, h, ns = al.attention_ref(self.cfg, self.spec, self.w, self.state, x_in, r_in, self.T)
        r_out.copy_(r)
        h_out.copy_(h)
        for k, v in ns.items():
            self.state[k].copy_(v)

    def moe_forward(self, h, out):
        o, ids = mb.moe_block_ref(self.cfg, w_of[id(self)], h)
        out.copy_(o)
        self.topk_ids.copy_(ids)

    monkeypatch.setattr(al.SpecializedAttention, "forward", attn_forward)
    monkeypatch.setattr(mb.SpecializedMoE, "forward", moe_forward)


@pytest.mark.parametrize(
    "batch, tokens, max_tokens", [(4, 1, 64), (2, 3, 64), (4, 2, 2), (2, 3, 3)]
)
def test_gpu_steps_compare_on_cpu(monkeypatch, batch, tokens, max_tokens):
    from decodescope.kernels.standard.model import StandardModel

    monkeypatch.setattr(S, "MAX_STEP_TOKENS", max_tokens)  # < batch x tokens: sequence chunks
    monkeypatch.setenv(S.CHUNK_TOKEN_OPS_ENV, "chunk")  # the halves replaced below
    g = _gpu_steps()
    p, m = _model(batch=batch, tokens=tokens, layers="kda,mla", seed=11)
    assert m.chunks == S.chunking(batch, tokens)[1]
    _reference_halves(monkeypatch, m)
    std = StandardModel(p.cfg, p.specs, batch, tokens, seed=11, device="cpu")
    assert g.same_weights(std, m)
    # the CPU standard path keeps BF16 router logits: more near-ties than on the GPU
    r = g.compare_step(std, m, batch, tokens, m.step, seed=5, tie=0.05, min_rows=0.0)
    assert r["ok"], [c for c in r["checks"] if not c["ok"]]
    names = {c["check"] for c in r["checks"]}
    assert {"x_out", "r_out", "layer0.kda_state", "layer0.conv_state",
            "layer1.kv_cache new rows", "x_out written"} <= names  # fmt: skip
    # a step that writes nothing is caught by the poison
    bad = g.compare_step(std, m, batch, tokens, lambda: None, seed=6, tie=0.05, min_rows=0.0)
    assert not bad["ok"]
    failed = {c["check"] for c in bad["checks"] if not c["ok"]}
    assert {"x_out written", "r_out written", "layer1.kv_cache new rows written"} <= failed
    rec = {"tp": 1, "batch": batch, "tokens": tokens, "status": "FAIL", "launches": m.launches(),
           "draws": [{"mode": "eager", **r}, {"mode": "graph", **bad}]}  # fmt: skip
    t = g.table([rec])
    assert "| FAIL |" in t and "x_out written" in t


def test_gpu_steps_flags_a_routing_bug(monkeypatch):
    """A routing difference that is no near-tie (an expert far below the k-th score) fails."""
    from decodescope.kernels.standard.model import StandardModel

    g = _gpu_steps()
    p, m = _model(batch=4, tokens=1, layers="kda,mla", seed=11)
    _reference_halves(monkeypatch, m)
    std = StandardModel(p.cfg, p.specs, 4, 1, seed=11, device="cpu")

    def wrong_routing():
        m.step()
        lay = std.layers[0]
        score = torch.sigmoid(lay.logits.float()) + lay.w["router_bias"].float()
        m.moe[0].topk_ids[0, 0] = int(torch.argmin(score[0]))  # the least likely expert

    r = g.compare_step(std, m, 4, 1, wrong_routing, seed=5, tie=0.05, min_rows=0.0)
    failed = {c["check"] for c in r["checks"] if not c["ok"]}
    assert "routing differences are near-ties" in failed
    assert r["routing_rows_agree"][0] <= 3


def test_warmup_names_the_failing_half(monkeypatch):
    from decodescope.kernels.specialized import interface as itf

    def fake_compiled(key, build):
        if str(key[0]) == "moe_experts":
            raise RuntimeError("no such kernel today")
        return lambda *a, **k: None

    monkeypatch.setattr(itf, "compiled", fake_compiled)
    _, m = _model(batch=2, tokens=1)
    with pytest.raises(ValueError) as ei:
        m.warmup()
    msg = str(ei.value)
    assert "MoE of layer.0:kda" in msg and "no such kernel today" in msg and "tiny" in msg


@pytest.mark.slow
def test_every_kernel_of_the_step_compiles_for_sm90a(monkeypatch):
    """The kernels the tiny step launches (both front_norm modes), compiled for sm_90a with
    the very keys the step uses (CUTE_DSL_ARCH set by the package; no GPU), none launched."""
    from decodescope.kernels.specialized import interface as itf

    real = itf.compiled
    keys: list[str] = []

    def compile_only(key, build):
        real(key, build)
        keys.append(str(key[0]))
        return lambda *a, **k: None

    monkeypatch.setattr(itf, "compiled", compile_only)
    for fn in (0, 1):
        _, m = _model(batch=2, tokens=2, layers="kda,mla", front_norm=fn)
        m.warmup()
    # the back end on tensor cores from 1 token (back_mma.back_variant; the SIMT
    # up_proj_shared_add stays the fallback for shapes BackMma refuses); the front on tensor
    # cores, with front_norm its variant with the RMSNorm in it (FrontMmaNorm)
    assert {"skinny_gemm", "kda_decode", "mla_decode", "rmsnorm", "moe_front_mma",
            "moe_front_mma_norm", "moe_experts", "moe_back_mma"} <= set(keys)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("tp, batch, tokens", [(8, 1, 1), (16, 8, 8)])
def test_kimi_k3_step_kernels_compile(monkeypatch, tp, batch, tokens):
    """The full-size step's kernels compile for sm_90a on a CPU: weights, state and buffers on
    the meta device (shapes only, no memory), every launch compiled with its real key."""
    from decodescope.kernels import weights as W
    from decodescope.kernels.specialized import interface as itf

    monkeypatch.setattr(W, "_gen", lambda device, seed: None)
    monkeypatch.setattr(
        W, "_randn", lambda shape, g, device, std, dtype=torch.bfloat16: torch.empty(
            shape, device="meta", dtype=dtype)
    )  # fmt: skip
    real = itf.compiled
    keys = []

    def compile_only(key, build):
        if keys and keys[-1] == key:  # asked again right away (cached in real use)
            return lambda *a, **k: None
        real(key, build)
        keys.append(key)
        return lambda *a, **k: None

    monkeypatch.setattr(itf, "compiled", compile_only)
    p = S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=tokens)
    m = S.SpecializedModel(p.cfg, p.specs, batch, tokens, device="meta")
    m.warmup()
    # a GEMM on cuBLAS (DECODESCOPE_TILE_CUBLAS, from 32 tokens by default) compiles nothing
    on_cublas = sum(p._on_cublas(s, o) for s in p.specs for o in p.op_names(s))
    per_layer = sum(2 if s.attn == "kda" else 1 for s in p.specs)  # o_proj; KDA's in_proj
    assert on_cublas == (0 if batch * tokens < 32 else per_layer)
    assert len(keys) + on_cublas == sum(p.launches().values()) == sum(m.launches().values())
    assert all(n <= 11 for n in p.launches().values())  # issue 5's target


def test_gpu_steps_redraws_when_ties_hide_every_row(monkeypatch):
    """Batch 1 and a near-tie flip in layer 0: no row left to compare, nothing else wrong: the
    draw is inconclusive and drawn again; never enough conclusive draws fails the mode."""
    from decodescope.kernels.standard.model import StandardModel

    g = _gpu_steps()
    p, m = _model(batch=1, tokens=1, layers="kda,mla", seed=11)
    _reference_halves(monkeypatch, m)
    std = StandardModel(p.cfg, p.specs, 1, 1, seed=11, device="cpu")
    k = p.cfg.moe.top_k

    def next_best_expert():
        m.step()
        lay = std.layers[0]
        score = torch.sigmoid(lay.logits.float()) + lay.w["router_bias"].float()
        order = torch.argsort(score[0], descending=True)
        ids = m.moe[0].topk_ids[0]
        ids[ids == order[k - 1].to(ids.dtype)] = int(order[k])  # swap the k-th for the next

    out = g.run_draws(std, m, 1, 1, next_best_expert, "eager", 2, 100, tie=1.0, min_rows=0.25)
    assert [d["mode"] for d in out] == ["eager-inconclusive"] * 6 + ["eager-too-few"]
    assert not out[-1]["ok"]
    ok = g.run_draws(std, m, 1, 1, m.step, "eager", 2, 100, tie=0.05, min_rows=0.25)
    assert [d["mode"] for d in ok if d["mode"] == "eager"] == ["eager", "eager"]


def test_gpu_steps_run_case_plumbing_on_cpu(monkeypatch):
    """scripts/gpu_steps.py's run_case end to end on a CPU: the real factories (the GPU check
    of the specialized one bypassed, its halves replaced by their references), a stand-in for
    the CUDA graph; then the table."""
    import types

    g = _gpu_steps()
    monkeypatch.setattr(S, "_require_gpu", lambda dev: None)
    real_init = S.SpecializedModel.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        _reference_halves(monkeypatch, self)

    monkeypatch.setattr(S.SpecializedModel, "__init__", init)
    monkeypatch.setattr(g, "capture_graph", lambda step: types.SimpleNamespace(replay=step))
    rec = g.run_case("tiny", 1, 3, 1, "kda,mla", seed=0, draws=1, tie=0.05)
    assert rec["status"] == "PASS", rec.get("error") or rec
    assert rec["same_weights"] and rec["launches"] == {"layer.0:kda": 7, "layer.1:mla": 8}
    assert [d["mode"] for d in rec["draws"] if "-" not in d["mode"]] == ["eager", "graph"]
    t = g.table([rec])
    assert "| PASS |" in t and "1/1 PASS" in t
    bad = g.run_case("tiny", 1, 3, 9, "kda,mla", seed=0, draws=1)
    assert bad["status"] == "UNUSABLE" and "tokens_per_seq" in bad["error"]


# -- the token-parallel ops once over all rows (DECODESCOPE_CHUNK_TOKEN_OPS=once) ---------------


def _wide(monkeypatch, limit: int = 8, decode: str = "chunk") -> None:
    """Tiny shapes with the token limit of every kernel (the step's chunks and the tile GEMM's
    rows) lowered to ``limit``, the token-parallel ops once over all rows, the decode kernels
    per chunk (``decode``: ``DECODESCOPE_CHUNK_DECODE``)."""
    from decodescope.kernels.specialized import tile_gemm as tg

    monkeypatch.setattr(S, "MAX_STEP_TOKENS", limit)
    monkeypatch.setattr(tg, "TILE_MAX_M", limit)
    monkeypatch.setenv(S.CHUNK_EXPERTS_ENV, "once")
    monkeypatch.setenv(S.CHUNK_TOKEN_OPS_ENV, "once")
    monkeypatch.setenv(S.CHUNK_DECODE_ENV, decode)


@pytest.mark.parametrize("tp,batch,n", [(8, 32, 4), (16, 64, 8)])
def test_chunking_token_ops_once(monkeypatch, tp, batch, n):
    """Session 21's default for a chunked step (``DECODESCOPE_CHUNK_DECODE=chunk`` since
    session 22): every range once per layer, the decode range holding a launch per chunk; the
    projections and the MoE front / back on cuBLAS; the record and the notes say so."""
    monkeypatch.delenv(S.CHUNK_TOKEN_OPS_ENV, raising=False)
    monkeypatch.delenv(S.CHUNK_EXPERTS_ENV, raising=False)
    monkeypatch.setenv(S.CHUNK_DECODE_ENV, "chunk")
    p = S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=8, layers="dense,kda,mla")
    one = S.plan(preset="kimi-k3", tp_shape=tp, batch=8, tokens_per_seq=8, layers="kda,mla")
    assert p.experts_once and p.tokens_once
    for i, kind in ((1, "kda"), (2, "mla")):
        ops = [o.split(".", 2)[2] for o in p.range_names()[f"layer.{i}:{kind}"]]
        assert ops == [o.split(".", 2)[2] for o in one.range_names()[f"layer.{i - 1}:{kind}"]]
    # KDA: norm + in_proj, n decodes, o_proj, norm; front, 3 experts, the back's norm (with
    # the shared sum's side cast) + GEMM adding into the output (DECODESCOPE_WIDE_BACK=addmm,
    # the default since session 39)
    assert p.launches()["layer.1:kda"] == 4 + n + 6
    # MLA: qkv_a and g_proj in one GEMM (each chunk's decode is the split kernel too), q_b
    assert p.launches()["layer.2:mla"] == 2 + 2 + n + 2 + 6
    cfg = json.loads(p.meta["config_json"])
    assert cfg["chunks"] == {"sequences": 8, "chunks": n, "experts": "once", "token_ops": "once",
                             "dense": "once"}  # fmt: skip
    impl = cfg["op_impl"]
    for op in S.WIDE_CUBLAS_OPS:
        if op in impl:
            assert impl[op].startswith("torch:cublas"), op
    assert impl["attn.conv1d+kda_recurrence+gated_norm"] == S.CUTE
    assert "the decode kernels (KDA recurrence, MLA decode) run in" in p.meta["notes"]
    assert "the dense MLP and the experts once over all tokens" in p.meta["notes"]
    # the dense layer (since session 22): its attention as a KDA layer's, then gate_up (cuBLAS),
    # the SiTU launch and down (cuBLAS), every range once
    kda = [o.replace("layer.1.", "layer.0.") for o in p.range_names()["layer.1:kda"][:4]]
    dense = [f"layer.0.mlp.{o}" for o in ("gate_up", "act", "down")]
    assert p.range_names()["layer.0:dense"] == kda + dense
    assert p.launches()["layer.0:dense"] == 4 + n + 3
    assert cfg["chunks"]["dense"] == "once" and cfg["launches"]["layer.0:dense"] == 7 + n
    assert impl["mlp.gate_up"].startswith("torch:cublas") and impl["mlp.act"] == S.CUTE
    assert impl["mlp.down"].startswith("torch:cublas")
    assert one_dense(tp) != kda + dense  # at 64 tokens the fused dense kernels as before
    monkeypatch.setenv(S.CHUNK_TOKEN_OPS_ENV, "always")
    with pytest.raises(ValueError, match="DECODESCOPE_CHUNK_TOKEN_OPS='always'"):
        S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=8)
    monkeypatch.setenv(S.CHUNK_TOKEN_OPS_ENV, "once")
    monkeypatch.setenv(S.CHUNK_EXPERTS_ENV, "chunk")  # needs the experts once
    assert not S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=8).tokens_once
    monkeypatch.delenv(S.CHUNK_EXPERTS_ENV)
    assert not S.plan(preset="kimi-k3", tp_shape=tp, batch=8, tokens_per_seq=8).tokens_once


@pytest.mark.parametrize("tp,batch", [(8, 32), (16, 64)])
def test_chunk_decode_once_plan(monkeypatch, tp, batch):
    """The default since session 22 (DECODESCOPE_CHUNK_DECODE unset or ``once``): the decode
    kernels in one launch over every sequence, so every range of a layer holds one launch but
    the experts'; the record and the notes say so; the knob is validated and needs the
    token-parallel ops once."""
    monkeypatch.delenv(S.CHUNK_TOKEN_OPS_ENV, raising=False)
    monkeypatch.delenv(S.CHUNK_EXPERTS_ENV, raising=False)
    monkeypatch.delenv(S.CHUNK_DECODE_ENV, raising=False)
    p = S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=8, layers="dense,kda,mla")
    assert p.tokens_once and p.decode_once and p.decode_launches == 1
    # the back in two launches, MLA's qkv_a and g_proj in one GEMM (the defaults since s39)
    assert p.launches() == {"layer.0:dense": 4 + 1 + 3, "layer.1:kda": 4 + 1 + 6,
                            "layer.2:mla": 2 + 2 + 1 + 2 + 6}  # fmt: skip
    cfg = json.loads(p.meta["config_json"])
    assert cfg["chunks"]["decode"] == "once" and S.CHUNK_DECODE_ENV not in cfg["kernel_env"]
    assert "every kernel runs once over all tokens" in p.meta["notes"]
    monkeypatch.setenv(S.CHUNK_DECODE_ENV, "chunk")
    q = S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=8, layers="kda")
    assert not q.decode_once and q.decode_launches == batch // 8
    assert "decode" not in json.loads(q.meta["config_json"])["chunks"]
    monkeypatch.setenv(S.CHUNK_DECODE_ENV, "all")
    with pytest.raises(ValueError, match="DECODESCOPE_CHUNK_DECODE='all'"):
        S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=8)
    monkeypatch.setenv(S.CHUNK_DECODE_ENV, "once")
    monkeypatch.setenv(S.CHUNK_TOKEN_OPS_ENV, "chunk")  # needs the token-parallel ops once
    assert not S.plan(preset="kimi-k3", tp_shape=tp, batch=batch, tokens_per_seq=8).decode_once


def one_dense(tp):
    return S.plan(preset="kimi-k3", tp_shape=tp, batch=8, tokens_per_seq=8,
                  layers="dense").range_names()["layer.0:dense"]  # fmt: skip


def _record_launches(monkeypatch) -> list[tuple[str, str]]:
    """Every launch of a step recorded as ``(range path, kind)`` instead of run: the CuTe
    kernels through ``interface.compiled`` (their key's name), the cuBLAS GEMMs and the MoE
    back's add through their module functions."""
    from decodescope.kernels.specialized import interface as itf
    from decodescope.kernels.specialized import moe_block as mb
    from decodescope.kernels.specialized import tile_gemm as tg

    calls: list[tuple[str, str]] = []

    def rec(name):
        return lambda *a, **k: calls.append((tracer.current_path(), name))

    monkeypatch.setattr(itf, "compiled", lambda key, build: rec(str(key[0])))
    monkeypatch.setattr(tg, "_cublas_gemm", rec("cublas"))
    monkeypatch.setattr(tg, "mm_f32", rec("cublas_f32"))
    monkeypatch.setattr(mb, "add_round", rec("add"))
    return calls


@pytest.mark.parametrize("back,ag,qf", [(None, False, False), ("add", False, False),
                                        ("addmm", False, False), (None, True, False),
                                        ("addmm", True, False), (None, True, True)])  # fmt: skip
def test_dry_run_token_ops_once(monkeypatch, back, ag, qf):
    """Every launch (CuTe kernels through interface.compiled, the cuBLAS GEMMs and the back's
    add through their module functions) under the range the plan names, in order; the plan's,
    the model's and the trace's launch counts agree. ``DECODESCOPE_WIDE_BACK=addmm``: the back's
    add rides in the RMSNorm launch (the shared sum's rounding) and the GEMM's epilogue, one
    launch fewer per MoE layer. ``ag``: MLA's qkv_a and g_proj in one GEMM
    (``attention_layers.merged_ag`` forced on: the tiny preset's decode is not the split
    kernel's), one launch fewer per MLA layer. ``qf``: q_b on the raw q_a, its norm launch gone
    (``attention_layers.folded_q_b`` forced on, ``DECODESCOPE_WIDE_QNORM``)."""
    from decodescope.kernels.specialized import attention_layers as al

    calls = _record_launches(monkeypatch)
    _wide(monkeypatch)
    if back is not None:
        monkeypatch.setenv("DECODESCOPE_WIDE_BACK", back)
    if ag:
        monkeypatch.setattr(al, "merged_ag", lambda cfg, batch, tokens: True)
    raws = []
    if qf:  # the decode asked for q_raw (the split kernel's, which the tiny preset cannot plan)
        monkeypatch.setattr(al, "folded_q_b", lambda cfg, batch, tokens: True)

        def decode(cfg, w, a, q, g, cache, out, T, q_raw=False):
            raws.append(q_raw)
            calls.append((tracer.current_path(), "mla_decode"))

        monkeypatch.setattr(al._mla, "mla_decode", decode)
    p, m = _model(batch=16, tokens=1, layers="kda,mla")
    assert m.chunks == 2 and m.tokens_once and p.tokens_once
    with tracer.range("step"):
        m.step()
    per_layer = _launches_by_range(p, [c[0] for c in calls])
    fewer = 1 if back in ("addmm", None) else 0  # addmm: the default since session 39
    assert per_layer == p.launches() == m.launches() == {"layer.0:kda": 13 - fewer,
                                                         "layer.1:mla": 16 - fewer - ag - qf}  # fmt: skip
    kinds = [k for path, k in calls if path.startswith("step/layer.0:kda/layer.0.attn.")]
    assert kinds == ["rmsnorm", "cublas", "kda_decode", "kda_decode", "cublas", "rmsnorm"]
    mla = [k for path, k in calls if path.startswith("step/layer.1:mla/layer.1.attn.")]
    proj = ["rmsnorm", "cublas"] + ([] if ag else ["cublas"])
    q_b = ["cublas"] if qf else ["rmsnorm", "cublas"]
    assert mla == proj + q_b + ["mla_decode", "mla_decode", "cublas", "rmsnorm"]
    assert (m.attn_all[1].w_ag is not None) == ag and (m.attn_all[1].w_qb is not None) == qf
    assert raws == ([True] * 2 if qf else [])  # one decode per chunk
    moe = [k for path, k in calls if "layer.1.moe." in path]
    route = ["cublas_f32", "moe_grouped_route", "moe_grouped_w13", "moe_grouped_w2"]
    assert moe == route + (["rmsnorm", "cublas"] if fewer else ["rmsnorm", "cublas_f32", "add"])
    assert json.loads(p.meta["config_json"])["launches"] == per_layer
    if back is not None:  # a set knob is recorded, the default is not
        assert json.loads(p.meta["config_json"])["kernel_env"]["DECODESCOPE_WIDE_BACK"] == back


def test_wide_back_knob_is_checked(monkeypatch):
    """A bad ``DECODESCOPE_WIDE_BACK`` is a one-line error naming the variable, when the step
    is planned, before any kernel runs."""
    from decodescope.kernels.specialized import moe_block as mb

    _wide(monkeypatch)
    monkeypatch.setenv("DECODESCOPE_WIDE_BACK", "fused")
    with pytest.raises(ValueError, match="DECODESCOPE_WIDE_BACK='fused': expected one of"):
        _model(batch=16, tokens=1, layers="kda")
    monkeypatch.setenv("DECODESCOPE_WIDE_BACK", "addmm")
    assert mb.wide_back() == "addmm" and mb.wide_back_launches() == 2
    monkeypatch.delenv("DECODESCOPE_WIDE_BACK")  # the default since session 39
    assert mb.wide_back() == "addmm" and mb.wide_back_launches() == 2
    monkeypatch.setenv("DECODESCOPE_WIDE_BACK", "add")
    assert mb.wide_back() == "add" and mb.wide_back_launches() == 3


@pytest.mark.parametrize("decode", ["chunk", "once"])
def test_dry_run_token_ops_once_dense(monkeypatch, decode):
    """A dense layer in a chunked step: its attention as a KDA layer's over all rows (the
    decode per chunk, or once over all sequences), then gate_up (cuBLAS), the SiTU launch and
    down (cuBLAS), each under its range; plan, model and trace agree."""
    calls = _record_launches(monkeypatch)
    _wide(monkeypatch, decode=decode)
    p, m = _model(batch=16, tokens=1, layers="dense,kda")
    assert m.chunks == 2 and m.tokens_once and m.attn_all[0] is not None
    with tracer.range("step"):
        m.step()
    per_layer = _launches_by_range(p, [c[0] for c in calls])
    assert per_layer == p.launches() == m.launches()
    decodes = ["kda_decode"] * (1 if decode == "once" else 2)
    assert per_layer["layer.0:dense"] == 7 + len(decodes)
    dense = [k for path, k in calls if path.startswith("step/layer.0:dense/")]
    assert dense == ["rmsnorm", "cublas", *decodes, "cublas", "rmsnorm", "cublas", "situ_mul",
                     "cublas"]  # fmt: skip


def test_token_ops_once_dense_with_reference_kernels_matches_standard(monkeypatch):
    """The dense layer's all-rows path (cuBLAS GEMMs as torch matmuls on the CPU, the RMSNorm,
    the KDA recurrence per chunk and the SiTU launch as their references) equals the standard
    model's dense layer, then a KDA layer on top (reference experts)."""
    from decodescope.kernels.specialized import attention_layers as al
    from decodescope.kernels.specialized import dense_mlp as dm
    from decodescope.kernels.specialized import moe_block as mb
    from decodescope.kernels.specialized import rmsnorm as rms
    from decodescope.kernels.specialized import situ_mul as sm
    from decodescope.kernels.standard.model import StandardModel

    _wide(monkeypatch, limit=4)
    acts = []

    def norm(x, w, y, eps, residual=None, residual_out=None):
        if residual is not None:
            residual_out.copy_((x.float() + residual.float()).to(torch.bfloat16))
        y.copy_(rms.rmsnorm_ref(x, w, eps, residual=residual))

    def kda(cfg, w, proj, s, c, out, T):
        o, s2, c2 = al._kda.kda_decode_ref(cfg, w, proj, s, c, T)
        out.copy_(o)
        s.copy_(s2)
        c.copy_(c2)

    def situ(gu, act, betas):
        acts.append(tuple(act.shape))
        act.copy_(sm.situ_mul_ref(gu, betas))

    w_of = {}

    def moe_forward(self, h, out):
        o, ids = mb.moe_block_ref(self.cfg, w_of[id(self)], h)
        out.copy_(o)
        self.topk_ids.copy_(ids)

    monkeypatch.setattr(rms, "rmsnorm", norm)
    monkeypatch.setattr(al._kda, "kda_decode", kda)
    monkeypatch.setattr(sm, "situ_mul", situ)
    monkeypatch.setattr(mb.SpecializedMoE, "forward", moe_forward)
    batch, tokens = 8, 1
    p, m = _model(batch=batch, tokens=tokens, layers="dense,kda", seed=6)
    assert m.tokens_once and m.chunks == 2 and isinstance(m.dense[0], dm.DenseMLPAllTokens)
    w_of.update({id(b[0]): w for b, w in zip(m.moe_c, m.weights, strict=True) if b is not None})
    std = StandardModel(p.cfg, p.specs, batch, tokens, seed=6, device="cpu")
    m.step()
    std.step()
    assert acts == [(batch * tokens, p.cfg.dense_inter)]  # one activation launch, all rows
    # layer 0 alone (no routing yet): its state, then the whole step on rows routed alike
    for k in m.states[0]:
        assert _rel(m.states[0][k], std.states[0][k]) < 2e-2, k
    a = torch.sort(m.moe[1].topk_ids.long(), 1).values
    b = torch.sort(std.layers[1].topk_ids.long(), 1).values
    ok = (a == b).all(1)
    assert ok.float().mean() >= 0.5, "routing differs in most rows"
    assert _rel(m.x_out, std.x_out, ok) < 3e-2
    assert _rel(m.r_out, std.r_out, ok) < 3e-2
    # the wide MLP alone against its chained references, on the layer's own h
    w0 = m.weights[0]
    h = m.hs[0]
    out = torch.empty_like(h)
    m.dense[0].forward(h, out)
    assert _rel(out, dm.dense_mlp_wide_ref(p.cfg, w0, h)) < 1e-2


@pytest.mark.parametrize("back,ag,qf", [("add", False, False), ("addmm", True, False),
                                        ("addmm", True, True)])  # fmt: skip
@pytest.mark.parametrize("decode", ["chunk", "once"])
@pytest.mark.parametrize("batch, tokens", [(16, 1), (4, 3), (6, 2)])
def test_token_ops_once_with_reference_kernels_matches_standard(monkeypatch, batch, tokens,
                                                                decode, back, ag, qf):  # fmt: skip
    """The all-rows path itself (the cuBLAS projections as torch matmuls on the CPU), with each
    CuTe kernel replaced by its torch reference (the RMSNorm launches, the KDA recurrence and
    MLA decode per chunk on row and state views, the grouped experts from the front's FP32
    output): the step equals the standard model's on the CPU. ``back``:
    ``DECODESCOPE_WIDE_BACK`` (``addmm``: the norm launch's side cast of the shared sum, then
    the up-projection adding into the layer's output); ``ag``: MLA's qkv_a and g_proj in one
    GEMM, the decode reading ``a`` and ``g`` as column slices of its output (forced on: the
    tiny preset's decode is not the split kernel's); ``qf``: q_b on the raw q_a with its norm
    weight folded in, the decode scaling the scores by q_a's rstd (``q_raw``, forced on)."""
    from decodescope.kernels.specialized import attention_layers as al
    from decodescope.kernels.specialized import moe_block as mb
    from decodescope.kernels.specialized import moe_experts as me
    from decodescope.kernels.specialized import rmsnorm as rms
    from decodescope.kernels.specialized import router_topk as rt
    from decodescope.kernels.standard.model import StandardModel

    _wide(monkeypatch, limit=4)
    monkeypatch.setenv(S.CHUNK_DECODE_ENV, decode)  # once: the decode kernels over all rows
    monkeypatch.setenv("DECODESCOPE_WIDE_BACK", back)
    if ag:
        monkeypatch.setattr(al, "merged_ag", lambda cfg, batch, tokens: True)
    if qf:
        monkeypatch.setattr(al, "folded_q_b", lambda cfg, batch, tokens: True)
    decodes, sides, strides, raws = [], [], [], []

    def norm(x, w, y, eps, residual=None, residual_out=None, side_in=None, side_out=None):
        if residual is not None:
            residual_out.copy_((x.float() + residual.float()).to(torch.bfloat16))
        y.copy_(rms.rmsnorm_ref(x, w, eps, residual=residual))
        if side_in is not None:
            sides.append(tuple(side_in.shape))
            side_out.copy_(side_in.to(torch.bfloat16))

    def kda(cfg, w, proj, s, c, out, T):
        decodes.append(proj.shape[0])
        o, s2, c2 = al._kda.kda_decode_ref(cfg, w, proj, s, c, T)
        out.copy_(o)
        s.copy_(s2)
        c.copy_(c2)

    def mla(cfg, w, a, q, g, cache, out, T, q_raw=False):
        decodes.append(a.shape[0])
        strides.append((a.stride(0), g.stride(0)))
        raws.append(q_raw)
        o, cache2 = al._mla.mla_decode_ref(cfg, w, a, q, g, cache, T, q_raw=q_raw)
        if q_raw:  # each decode on its own equals the normalized q's (the step's tolerance
            # would hide a dropped rstd: the tiny preset's q_a has an rms near 1)
            qn = al._op.q_b_proj_ref(cfg, w, a)
            want, _ = al._mla.mla_decode_ref(cfg, w, a, qn, g, cache, T)
            assert rel_l2(o, want) < 2e-2
        out.copy_(o)
        cache.copy_(cache2)

    def experts(self):
        E, L = self.cfg.moe.num_experts, self.cfg.expert_dim
        y = self.y_front
        ids, tw = rt.router_topk_ref(y[:, :E], self.bias, self.top_k, self.scaling)
        acc, sh = me.moe_experts_ref(y[:, E : E + L], y[:, E + L :], ids, tw, self.w13, self.w2,
                                     self.shared_w2, self.beta, self.lbeta)  # fmt: skip
        self.acc.copy_(acc)
        self.shared_out.copy_(sh)
        self.topk_ids.copy_(ids)

    monkeypatch.setattr(rms, "rmsnorm", norm)
    monkeypatch.setattr(al._kda, "kda_decode", kda)
    monkeypatch.setattr(al._mla, "mla_decode", mla)
    monkeypatch.setattr(mb.SpecializedMoE, "experts", experts)
    p, m = _model(batch=batch, tokens=tokens, layers="kda,mla,kda", seed=3)
    assert m.tokens_once and m.chunks > 1 and all(a is not None for a in m.attn_all)
    assert all(b[0].wide for b in m.moe_c)
    std = StandardModel(p.cfg, p.specs, batch, tokens, seed=3, device="cpu")
    m.step()
    std.step()
    if decode == "once":
        assert m.decode_once and decodes == [batch * tokens] * 3
    else:  # each decode kernel per chunk
        assert not m.decode_once and decodes == [m.per * tokens] * (3 * m.chunks)
    assert sides == ([(batch * tokens, p.cfg.hidden)] * 3 if back == "addmm" else [])
    na, ng = p.cfg.mla_qkv_a_out, p.cfg.mla_v_dim
    assert set(strides) == {(na + ng, na + ng) if ag else (na, ng)}
    assert set(raws) == {qf}
    _assert_step_matches(p, m, std, batch, tokens)


@pytest.mark.parametrize("env,want", [(None, "0"), ("1", "1"), ("auto", "auto")])
def test_gpu_steps_front_norm_default(monkeypatch, env, want):
    """``scripts/gpu_steps.py --front-norm`` defaults to ``DECODESCOPE_FRONT_NORM`` (else 0), so
    a run with the variable set checks the step it names (session 27's part 22 ran with ``0``)."""
    if env is None:
        monkeypatch.delenv("DECODESCOPE_FRONT_NORM", raising=False)
    else:
        monkeypatch.setenv("DECODESCOPE_FRONT_NORM", env)
    assert _gpu_steps().parser().parse_args([]).front_norm == want
