"""``DECODESCOPE_FAST_SIGMOID``: the kernels' sigmoid without the IEEE division's branch (sm_90a
PTX compiled on the CPU). Off (``0``), a kernel's sigmoids are IEEE reciprocals (``rcp.rn.f32``,
a slow path behind a branch in SASS); ``1``, one ``rcp.approx.ftz.f32`` each and no ``rcp.rn``;
``rn`` (session 34), the approximate reciprocal plus the division's own Newton step and range
select (:func:`utils.recip_ge1`), no branch. The default's PTX is unchanged by the knob's code
(``scripts/ptx_snapshot.py``: 112 of 112 cases identical, sessions 31 and 34). On the GPU:
``1`` passed the whole step (s33); ``rn``'s bit equality with the division is
``test_sigmoid_rn_equals_division_gpu`` (staged)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass.cute as cute
import pytest
import torch

from decodescope.kernels.config import get_config
from decodescope.kernels.specialized import experts_t1 as et
from decodescope.kernels.specialized import interface as itf  # sets CUTE_DSL_ARCH first
from decodescope.kernels.specialized import kda_decode as kda
from decodescope.kernels.specialized import utils


@pytest.fixture
def fs_env(monkeypatch):
    for v in (utils.FAST_SIGMOID_ENV, kda.VSPLIT_ENV, kda.CHAIN_ENV, kda.OCC_ENV, kda.STAGE_ENV):
        monkeypatch.delenv(v, raising=False)
    return monkeypatch


def _ptx(batch: int, tokens: int) -> str:
    p = kda.plan_for(get_config("kimi-k3", 16), batch, tokens)
    return itf.ptx_text(kda.make_op(p), *kda._fake_args(p))


@pytest.mark.parametrize("batch,tokens", [(64, 8), (1, 1)])  # the one-CTA kernel, the split
def test_fast_sigmoid_ptx(fs_env, batch, tokens):
    off = _ptx(batch, tokens)
    fs_env.setenv(utils.FAST_SIGMOID_ENV, "1")
    on = _ptx(batch, tokens)
    assert "rcp.rn.f32" in off and "rcp.approx" not in off
    assert "rcp.rn.f32" not in on and on.count("rcp.approx") == off.count("rcp.rn.f32")


@pytest.mark.parametrize("batch,tokens", [(64, 8), (1, 1)])
def test_sigmoid_rn_ptx(fs_env, batch, tokens):
    """``rn``: each IEEE reciprocal becomes one ``recip_ge1`` block (approximate reciprocal, two
    FMAs, a range select); no ``rcp.rn`` is left, other divisions stay."""
    off = _ptx(batch, tokens)
    fs_env.setenv(utils.FAST_SIGMOID_ENV, "rn")
    on = _ptx(batch, tokens)
    n = off.count("rcp.rn.f32")
    assert n > 0 and "rcp.rn.f32" not in on and on.count("div.rn") == off.count("div.rn")
    assert on.count("rcp.approx.ftz.f32") == n
    assert on.count("setp.lt.f32 p, ") == n and on.count("selp.f32") >= n


def _route_ptx() -> str:
    cfg = get_config("kimi-k3", 16)
    e = cfg.moe
    op, args = et.build_route(e.num_experts, e.top_k, cfg.expert_dim, 5248, 2.5)
    return itf.ptx_text(op, *args)


def test_route_sigmoid_follows_knob(fs_env):
    """The one-token route's scores (``route_topk`` through ``moe_common.sigmoid``) follow the
    knob too: before session 34 ``moe_common`` had its own division, which ``1`` left alone."""
    off = _route_ptx()
    fs_env.setenv(utils.FAST_SIGMOID_ENV, "rn")
    on = _route_ptx()
    n = off.count("rcp.rn.f32")
    assert n >= 896 // 32  # a lane's 28 scores (and the fallback's rounds)
    assert "rcp.rn.f32" not in on and on.count("rcp.approx.ftz.f32") == n


def test_fast_sigmoid_bad_value(fs_env):
    assert utils.fast_sigmoid_enabled() is False and utils.sigmoid_mode() == "div"
    fs_env.setenv(utils.FAST_SIGMOID_ENV, "rn")
    assert utils.sigmoid_mode() == "rn" and utils.fast_sigmoid_enabled() is False
    fs_env.setenv(utils.FAST_SIGMOID_ENV, "yes")
    with pytest.raises(ValueError, match="DECODESCOPE_FAST_SIGMOID='yes'"):
        utils.fast_sigmoid_enabled()


class _Sig:
    """``y[i] = sigmoid(x[i])`` (``utils.sigmoid`` in the mode set when traced), 256 per CTA."""

    def __init__(self, n: int):
        self.n = n

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream: cuda.CUstream):
        self.kernel(mX, mY).launch(grid=[self.n // 256, 1, 1], block=[256, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor):
        i = cute.arch.block_idx()[0] * 256 + cute.arch.thread_idx()[0]
        mY[i] = utils.sigmoid(mX[i])


def _sig_fn(n: int):
    return itf.compile_only(_Sig(n), itf.fake(torch.float32, (n,)),
                            itf.fake(torch.float32, (n,)), itf.env_stream())  # fmt: skip


def test_sigmoid_kernel_compiles(fs_env):
    """The GPU test's kernel, both modes, on the CPU (CI)."""
    assert _sig_fn(1024) is not None
    fs_env.setenv(utils.FAST_SIGMOID_ENV, "rn")
    assert _sig_fn(1024) is not None


@pytest.mark.gpu
def test_sigmoid_rn_equals_division_gpu(fs_env):
    """``rn`` against the division, bit for bit, wherever ``1 + exp(-x) < 2^126`` (x > -87.3):
    2^22 random logits (N(0, 4), the router's and the gates' range and beyond) plus a sweep
    of -87.3..88; below, ``rn`` gives 0 where the division gives a denormal or 0."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    n, m = 1 << 22, 4096
    g = torch.Generator().manual_seed(34)
    x = torch.cat([4 * torch.randn(n // 2, generator=g),
                   torch.linspace(-87.3, 88.0, n // 2)]).cuda()  # fmt: skip
    low = torch.linspace(-100.0, -87.4, m, device="cuda")
    fns = {}
    for mode in ("0", "rn"):
        fs_env.setenv(utils.FAST_SIGMOID_ENV, mode)
        fns[mode] = (_sig_fn(n), _sig_fn(m))
    out = {}
    for mode, (fn, fn_low) in fns.items():
        y, y_low = torch.full_like(x, float("nan")), torch.full_like(low, float("nan"))
        fn(x, y)
        fn_low(low, y_low)
        out[mode] = (y, y_low)
    torch.cuda.synchronize()
    (y_div, low_div), (y_rn, low_rn) = out["0"], out["rn"]
    assert torch.equal(y_div.view(torch.int32), y_rn.view(torch.int32))
    assert float(low_rn.abs().max()) == 0.0
    assert float(low_div.min()) >= 0.0 and float(low_div.max()) < 1.2e-38  # denormals or 0


def test_auto_follows_step_tokens(fs_env):
    """The default (``auto``, session 35): ``rn`` inside a step of 2 tokens or more, the
    division at one token and outside any step; ``0`` / ``rn`` / ``1`` set it everywhere."""
    assert utils.sigmoid_mode() == "div"
    with utils.sigmoid_tokens(1):
        assert utils.sigmoid_mode() == "div"
    with utils.sigmoid_tokens(utils.SIGMOID_RN_FROM_TOKENS):
        assert utils.sigmoid_mode() == "rn"
        with utils.sigmoid_tokens(1):  # nested: the innermost step
            assert utils.sigmoid_mode() == "div"
        assert utils.sigmoid_mode() == "rn"
    assert utils.sigmoid_mode() == "div"
    for v, want in (("auto", "rn"), ("0", "div"), ("rn", "rn"), ("1", "approx")):
        fs_env.setenv(utils.FAST_SIGMOID_ENV, v)
        with utils.sigmoid_tokens(64):
            assert utils.sigmoid_mode() == want
    fs_env.setenv(utils.FAST_SIGMOID_ENV, "rn")
    with utils.sigmoid_tokens(1):
        assert utils.sigmoid_mode() == "rn"


def test_auto_ptx_is_div_at_one_token_rn_from_two(fs_env):
    """What ``auto`` compiles: at one token exactly the division's PTX, from 8 tokens exactly
    ``rn``'s (the KDA decode at 1x1 and 8x1, TP16)."""
    for (batch, tokens), n in (((1, 1), 1), ((8, 1), 8)):
        fs_env.setenv(utils.FAST_SIGMOID_ENV, "0")
        div = _ptx(batch, tokens)
        fs_env.setenv(utils.FAST_SIGMOID_ENV, "rn")
        rn = _ptx(batch, tokens)
        fs_env.delenv(utils.FAST_SIGMOID_ENV)
        with utils.sigmoid_tokens(n):
            auto = _ptx(batch, tokens)
        assert div != rn
        assert auto == (div if n == 1 else rn)


def test_compile_cache_keys_the_mode(fs_env, monkeypatch):
    """``interface.compiled`` keys each kernel by the sigmoid's mode too: the same shapes traced
    in a one-token step and in an 8-token step are two kernels, and a repeat is a cache hit."""
    built = []
    monkeypatch.setattr(itf, "compile_only", lambda op, *a: (op, utils.sigmoid_mode()))
    monkeypatch.setattr(itf, "_CACHE", {})

    def build():
        built.append(utils.sigmoid_mode())
        return "op", ()

    key = ("test_fast_sigmoid", 1)
    with utils.sigmoid_tokens(1):
        assert itf.compiled(key, build) == ("op", "div")
    with utils.sigmoid_tokens(8):
        assert itf.compiled(key, build) == ("op", "rn")
        assert itf.compiled(key, build) == ("op", "rn")
    assert itf.compiled(key, build) == ("op", "div")
    assert built == ["div", "rn"]


def test_specialized_model_steps_set_tokens(fs_env, monkeypatch):
    """``SpecializedModel`` runs its warm-up and its steps inside ``sigmoid_tokens(N)``, so a
    batch-8 model's kernels are traced with ``rn`` and a batch-1 model's with the division."""
    from decodescope.kernels import weights as W
    from decodescope.kernels.specialized import step as S

    monkeypatch.setattr(W, "_gen", lambda device, seed: None)  # shapes only, on the meta device
    monkeypatch.setattr(
        W, "_randn", lambda shape, g, device, std, dtype=torch.bfloat16: torch.empty(
            shape, device="meta", dtype=dtype)
    )  # fmt: skip
    seen = []
    monkeypatch.setattr(
        S.SpecializedModel,
        "_layer",
        lambda self, i, x, r, guarded: seen.append((self.N, utils.sigmoid_mode())),
    )
    for batch in (1, 8):
        p = S.plan(tp_shape=16, batch=batch, layers="kda")
        m = S.SpecializedModel(p.cfg, p.specs, batch, 1, device="meta")
        m.warmup()
        m.step()
    assert seen == [(1, "div"), (1, "div"), (8, "rn"), (8, "rn")]
    assert utils.sigmoid_mode() == "div"
