"""The NVIDIA GPU attention backend ("cudnn") on CPU: which implementation each call gets
(``attention_implementation``), the query-chunked XLA attention against the float32
reference, the chunk size, the arguments cuDNN gets (run through JAX's XLA implementation of
the same API), the router, the self-check wiring, and ``--attention cudnn`` refused off GPU.
cuDNN itself runs only on a GPU: nothing here calls it."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from serve_util import cpu_xla_flags

import custom_splash_attention as csa
import splash.reference
from engine.run import runtime
from engine.run.config import resolve_attention_backend
from engine.run.errors import GenerationError, UsageError
from splash.chunked import DEFAULT_SCORE_BYTES, FREE_MEMORY_FRACTION

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16_TOL = 1e-2  # the project's bf16 tolerance (splash.reference.SELF_CHECK_TOLERANCE)


@dataclasses.dataclass(frozen=True)
class StrictlyBefore(csa.Mask):
    """Test-only mask: query i attends keys j < i (query 0 attends nothing: zeros)."""

    def tile_predicate(self, q_pos, kv_pos):
        return kv_pos < q_pos


def _qkv(shape, kv_len=None, dtype=jnp.float32, seed=0):
    b, h, s, d = shape
    kv_len = s if kv_len is None else kv_len
    ks = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(key, (b, h, n, d), jnp.float32).astype(dtype)
                 for key, n in zip(ks, (s, kv_len, kv_len), strict=True))


def _non_tail_keys(b, kv_len):
    """(b, kv_len) bool with padding in the middle of row 1, as HunyuanVideo-1.5's joint
    [video, ByT5, Qwen] mask: row 0 a tail, row 1 not."""
    pos = np.arange(kv_len)
    rows = [pos < kv_len - 5, (pos < kv_len - 12) | (pos >= kv_len - 4)]
    return jnp.asarray(np.stack(rows[:b]))


# --- (a) the dispatch table ---------------------------------------------------------------

MASKS = {"none": (None, "none"), "tail": (None, "tail"), "non_tail": (None, "data"),
         "local": (csa.LocalMask(4), "none"), "custom": (StrictlyBefore(), "none")}


@pytest.mark.parametrize("head_dim", [64, 128, 256, 80, 100, 384])
@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("backend", ["cudnn", "xla"])
def test_dispatch_table(backend, dtype, mask, head_dim):
    static, key_mask = MASKS[mask]
    got = csa.attention_implementation(backend, platform="gpu", dtype=jnp.dtype(dtype),
                                       head_dim=head_dim, mask=static, key_mask=key_mask,
                                       max_head_dim=256)
    cudnn_takes = (dtype != "float32" and head_dim % 8 == 0 and head_dim <= 256
                   and static is None)
    # "xla" never materialises the whole score matrix: always the chunked path.
    want = "cudnn" if backend == "cudnn" and cudnn_takes else "xla_chunked"
    assert got == want


def test_dispatch_head_dim_limit_and_platform():
    kw = dict(dtype=jnp.bfloat16, mask=None, key_mask="tail")
    assert csa.attention_implementation("cudnn", platform="gpu", head_dim=256,
                                        max_head_dim=128, **kw) == "xla_chunked"  # pre-Hopper
    assert csa.attention_implementation("cudnn", platform="gpu", head_dim=128,
                                        max_head_dim=128, **kw) == "cudnn"
    for platform in ("cpu", "tpu"):  # no cuDNN there
        assert csa.attention_implementation("cudnn", platform=platform, head_dim=128,
                                            **kw) == "xla_chunked"
    for backend in ("splash", "stock_splash"):
        assert csa.attention_implementation(backend, platform="tpu", head_dim=128,
                                            **kw) == backend
    with pytest.raises(ValueError, match="backend"):
        csa.attention_implementation("flash", platform="gpu", head_dim=128, **kw)
    with pytest.raises(ValueError, match="key_mask"):
        csa.attention_implementation("cudnn", platform="gpu", head_dim=128, dtype=jnp.bfloat16,
                                     key_mask="dense")


# --- (b) the chunked path against the float32 reference -----------------------------------

def _dense(kind, b, q_len, kv_len):
    """(key_mask, static_mask, the equivalent dense bool mask for reference_attention)."""
    key = _non_tail_keys(b, kv_len) if kind in ("keys", "keys+local") else None
    static = {"local": csa.LocalMask(5), "keys+local": csa.LocalMask(5),
              "custom": StrictlyBefore()}.get(kind)
    dense = jnp.ones((b, 1, q_len, kv_len), bool)
    if key is not None:
        dense = dense & key[:, None, None, :]
    if static is not None:
        dense = dense & static.dense(q_len, kv_len)[None, None]
    return key, static, dense


@pytest.mark.parametrize("kind", ["none", "keys", "local", "keys+local", "custom"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 50, 64])
def test_chunked_equals_reference_f32(kind, chunk):
    q, k, v = _qkv((2, 3, 50, 32))
    key, static, dense = _dense(kind, 2, 50, 50)
    want = csa.reference_attention(q, k, v, mask=dense)
    got = csa.chunked_attention(q, k, v, key_mask=key, static_mask=static, chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


def test_chunked_cross_attention_scale_and_bf16():
    q, k, v = _qkv((2, 3, 37, 32), kv_len=23)
    key, _, dense = _dense("keys", 2, 37, 23)
    want = csa.reference_attention(q, k, v, scale=0.3, mask=dense)
    got = csa.chunked_attention(q, k, v, scale=0.3, key_mask=key, chunk=10)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    got = csa.chunked_attention(qb, kb, vb, key_mask=key, static_mask=csa.LocalMask(3),
                                chunk=8)
    assert got.dtype == jnp.bfloat16
    f32 = (x.astype(jnp.float32) for x in (qb, kb, vb))  # the very bf16 values
    band = csa.LocalMask(3).dense(37, 23)[None, None]
    want = csa.reference_attention(*f32, mask=dense & band)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=BF16_TOL,
                               rtol=BF16_TOL)


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("dp", "tp", "sp"))


def test_chunked_under_8_device_mesh():
    """Batch over "dp", heads over "tp", under jit: XLA partitions it, results unchanged."""
    q, k, v = _qkv((2, 4, 40, 16))
    key, static, dense = _dense("keys+local", 2, 40, 40)
    mesh = _mesh()
    spec = NamedSharding(mesh, P("dp", "tp", None, None))
    qs, ks, vs = (jax.device_put(x, spec) for x in (q, k, v))
    keys = jax.device_put(key, NamedSharding(mesh, P("dp", None)))
    run = jax.jit(lambda q, k, v, m: csa.chunked_attention(q, k, v, key_mask=m,
                                                           static_mask=static, chunk=9))
    got = run(qs, ks, vs, keys)
    want = csa.reference_attention(q, k, v, mask=dense)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


# --- (c) the chunk size -------------------------------------------------------------------

@pytest.mark.parametrize("b,h,q_len,kv_len,budget", [
    (1, 1, 1000, 1000, 4000 * 7), (2, 40, 75600, 75600, 256 << 20), (1, 2, 50, 50, 1),
    (1, 1, 50, 50, 10 ** 12), (2, 12, 4096, 4096, 10 << 30)])
def test_chunk_rows_fits_budget(b, h, q_len, kv_len, budget):
    rows = csa.chunk_rows(b, h, q_len, kv_len, budget)
    assert 1 <= rows <= q_len
    assert rows == 1 or b * h * rows * kv_len * 4 <= budget
    if rows < q_len and rows > 1:  # not needlessly small: within one alignment step
        assert b * h * (rows + 128) * kv_len * 4 > budget or rows < 128


class _FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_score_budget_from_free_memory():
    stats = dict(bytes_limit=80 << 30, bytes_in_use=16 << 30)
    assert csa.score_budget_bytes(_FakeDevice(stats)) == int((64 << 30) * FREE_MEMORY_FRACTION)
    assert csa.score_budget_bytes(_FakeDevice(None)) == DEFAULT_SCORE_BYTES
    assert csa.score_budget_bytes(jax.devices("cpu")[0]) > 0
    with pytest.raises(ValueError, match="kv_len"):
        csa.chunk_rows(1, 1, 10, 0, 100)


# --- cuDNN's arguments, through JAX's XLA implementation of the same call ------------------

@pytest.mark.parametrize("keys", ["none", "tail_len", "non_tail"])
def test_cudnn_arguments_are_exact(keys):
    q, k, v = _qkv((2, 4, 30, 16))
    pos = jnp.arange(30)
    kw, dense = {}, jnp.ones((2, 1, 30, 30), bool)
    if keys == "tail_len":
        kw, dense = dict(valid_kv_len=21), jnp.broadcast_to(pos < 21, (2, 1, 30, 30))
    elif keys == "non_tail":
        real = _non_tail_keys(2, 30)
        kw, dense = dict(key_mask=real), dense & real[:, None, None, :]
    want = csa.reference_attention(q, k, v, mask=dense)
    got = csa.cudnn_attention(q, k, v, implementation="xla", **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    mesh = _mesh()
    spec = NamedSharding(mesh, P("dp", "tp", None, None))
    sharded = jax.jit(lambda q, k, v: csa.sharded_cudnn_attention(
        q, k, v, mesh=mesh, implementation="xla", **kw))
    got = sharded(*(jax.device_put(x, spec) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)


# --- (e) the router -----------------------------------------------------------------------

def _sdpa(env, q, k, v, mask=None):
    import torch

    with env:
        qx, kx, vx = env.to_xla((q, k, v))
        m = None if mask is None else env.to_xla(mask)
        out = torch.nn.functional.scaled_dot_product_attention(qx, kx, vx, attn_mask=m)
        return np.asarray(env.t2j_iso(out))


@pytest.mark.parametrize("mesh", [None, "2x2x2"])
def test_router_cudnn_float32_and_xla_take_chunked_path(torchax_env, monkeypatch, mesh):
    import torch

    calls = []
    real_chunked = csa.chunked_attention

    def spy(*args, **kwargs):
        calls.append(kwargs.get("chunk"))
        return real_chunked(*args, **kwargs)

    monkeypatch.setattr(csa, "chunked_attention", spy)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 48, 32, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 1, 48, dtype=torch.bool)
    mask[1, ..., 10:20] = False  # a key-padding mask that is not a tail
    options = csa.AttentionOptions(mask=csa.LocalMask(6), k_smoothing=True)
    band = csa.LocalMask(6).dense(48, 48)[None, None]
    qj, kj, vj = (jnp.asarray(x.numpy()) for x in (q, k, v))
    want = (csa.reference_attention(qj, kj, vj, mask=band),
            csa.reference_attention(qj, kj, vj, mask=band & jnp.asarray(mask.numpy())))
    for attention in ("xla", "cudnn"):
        csa.install_sdpa_override(torchax_env, attention=attention, options=options,
                                  mesh=None if mesh is None else _mesh())
        outs = (_sdpa(torchax_env, q, k, v), _sdpa(torchax_env, q, k, v, mask))
        for got, ref in zip(outs, want, strict=True):
            np.testing.assert_allclose(got, np.asarray(ref), atol=1e-5, rtol=1e-5)
    assert len(calls) == 4 and all(c is not None and 1 <= c <= 48 for c in calls)


# --- (4) the self-check and (3, d) the refusal off GPU ------------------------------------

def test_cudnn_self_check_wiring(monkeypatch):
    def through_xla(q, k, v, *, block_sizes, interpret):
        return csa.cudnn_attention(q, k, v, implementation="xla")

    monkeypatch.setattr(splash.reference, "_cudnn", through_xla)
    result = runtime.check_attention_kernel("cudnn", interpret=True)
    assert result["passed"] and result["backend"] == "cudnn"

    def broken(q, k, v, *, block_sizes, interpret):
        return through_xla(q, k, v, block_sizes=block_sizes, interpret=interpret) * 1.1

    monkeypatch.setattr(splash.reference, "_cudnn", broken)
    with pytest.raises(GenerationError, match="--attention cudnn: kernel self-check failed.*"
                                              "--attention xla"):
        runtime.check_attention_kernel("cudnn", interpret=True)


def test_resolve_attention_backend():
    assert [resolve_attention_backend("auto", p) for p in ("gpu", "tpu", "cpu")] == \
        ["cudnn", "splash", "xla"]
    assert csa.default_attention_backend() == "xla"  # this CPU host
    for platform in ("gpu", "tpu", "cpu"):
        assert resolve_attention_backend("xla", platform) == "xla"
    assert resolve_attention_backend("cudnn", "gpu") == "cudnn"
    assert resolve_attention_backend("splash", "cpu") == "splash"  # interpret mode
    with pytest.raises(UsageError, match=r"--attention='cudnn': needs an NVIDIA GPU "
                                         r"\(JAX's default backend here is cpu\)"):
        resolve_attention_backend("cudnn", "cpu")
    for kernel in ("splash", "stock_splash"):
        with pytest.raises(UsageError, match=f"--attention='{kernel}': a Pallas TPU kernel"):
            resolve_attention_backend(kernel, "gpu")


def test_cli_attention_cudnn_on_cpu_is_one_line(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=cpu_xla_flags(8))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "generate_flax.py"),
                           "--model_id", tiny_checkpoint, "--output_dir", str(out),
                           "--attention", "cudnn"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--attention='cudnn': needs an NVIDIA GPU" in lines[0], lines[0]
    assert "use --attention xla" in lines[0]
    assert not out.exists() or not os.listdir(out)
