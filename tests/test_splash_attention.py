"""Numerics of the splash kernel in Pallas interpret mode on CPU.

Every kernel call here runs ``interpret=True``: Pallas executes the kernel body with XLA
on the host, grid step by grid step, and pads partial blocks with NaN, so a padded key or
query that leaks into a valid output shows up as a NaN or a large error.

References are float64 NumPy softmax attention computed from the very inputs the kernel
sees (for bf16: the bf16-rounded values), so the tolerances measure the kernel, not the
input quantisation:

* f32: ``atol = rtol = 1e-5`` (``TOL``; the sharded and padded-key comparisons against
  float32 JAX references use 2e-5). f32 unit roundoff is 6e-8; the score dot products
  (head_dim <= 128 terms), the folded ``scale * log2(e)``, exp2 and the sums over <= 512
  keys add up to a few 1e-7 relative (observed max ~1e-6), so 1e-5 leaves a 10x margin
  while an unmasked padded key, a wrong max shift or a dropped tile is >1e-3.
* bf16: ``atol = rtol = 1e-2`` (``TOL``). bf16 has 8 significant bits (unit roundoff 2^-9 =
  2e-3). q is rounded after the scale fold, P is rounded to bf16 for the MXU and the
  output is rounded once more: ~3 roundings of 2e-3 on values of O(1) (observed max
  ~6e-3). 1e-2 is bf16 resolution with margin; errors from masking bugs are O(0.1).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import contextlib  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import custom_splash_attention as csa  # noqa: E402
from splash import kernel as splash_kernel  # noqa: E402

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
SMALL = csa.BlockSizes(block_q=128, block_kv=256, block_kv_compute=128)


def _inputs(shape_q, kv_len, dtype, seed=0, k_offset=0.0):
    rng = np.random.default_rng(seed)
    b, h, _, d = shape_q
    q = rng.standard_normal(shape_q)
    k = rng.standard_normal((b, h, kv_len, d)) + k_offset
    v = rng.standard_normal((b, h, kv_len, d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def _ref64(q, k, v, *, scale=None, valid=None):
    """float64 softmax attention; rows with no valid key give zeros."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if valid is not None:
        s = np.where(valid, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    o = np.einsum("bhqk,bhkd->bhqd", p, v)
    return np.where(denom > 0, o / np.where(denom > 0, denom, 1.0), 0.0)


def _check(out, want, dtype, what=""):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert out.shape == want.shape
    assert np.all(np.isfinite(out)), f"{what}: non-finite output"
    tol = TOL[dtype]
    err = np.max(np.abs(out - want))
    np.testing.assert_allclose(out, want, atol=tol, rtol=tol, err_msg=f"{what} max err {err}")
    return err


def _window_valid(q_len, kv_len, w):
    i = np.arange(q_len)[:, None]
    j = np.arange(kv_len)[None, :]
    return np.abs(i - j) <= w


# ---------------------------------------------------------------------------------------
# Plain attention over lengths, head dims, block sizes and dtypes
# ---------------------------------------------------------------------------------------

CASES = [
    # (batch, heads, q_len, kv_len, head_dim, block_sizes)
    pytest.param(1, 2, 256, 256, 128, csa.BlockSizes(128, 128, 128), id="multiple-d128"),
    pytest.param(2, 1, 300, 300, 64, SMALL, id="ragged300-d64"),
    pytest.param(1, 2, 300, 512, 128, SMALL, id="cross512-d128"),
    pytest.param(1, 1, 200, 77, 64, None, id="kv77-shorter-than-block-default-blocks"),
    pytest.param(1, 1, 260, 700, 128, csa.BlockSizes(256, 512, 256), id="ragged-700-2blocks"),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("b,h,q_len,kv_len,d,bs", CASES)
def test_matches_float64_reference(b, h, q_len, kv_len, d, bs, dtype):
    q, k, v = _inputs((b, h, q_len, d), kv_len, dtype, seed=q_len + kv_len)
    options = csa.AttentionOptions() if bs is None else csa.AttentionOptions(block_sizes=bs)
    out = csa.splash_attention(q, k, v, options=options, interpret=True)
    assert out.dtype == dtype and out.shape == q.shape
    _check(out, _ref64(q, k, v), dtype, "splash")


def test_custom_scale():
    q, k, v = _inputs((1, 1, 130, 64), 130, jnp.float32, seed=3)
    out = csa.splash_attention(q, k, v, scale=0.3, options=csa.AttentionOptions(block_sizes=SMALL),
                               interpret=True)
    _check(out, _ref64(q, k, v, scale=0.3), jnp.float32, "scale=0.3")


# ---------------------------------------------------------------------------------------
# Padded keys
# ---------------------------------------------------------------------------------------


def test_padded_keys_are_masked():
    """Zero-padding K/V without a mask (a known port's bug) is far off; ours is exact.

    kv_len = 300 with block_kv = 256 leaves 212 padded keys in the last block. Zero keys
    score 0, so unmasked they take a share of the softmax and pull the output towards 0.
    """
    q, k, v = _inputs((1, 2, 300, 64), 300, jnp.float32, seed=11)
    want = _ref64(q, k, v)
    pad = ((0, 0), (0, 0), (0, 512 - 300), (0, 0))
    unmasked = _ref64(q, np.pad(np.asarray(k), pad), np.pad(np.asarray(v), pad))
    unmasked_err = np.max(np.abs(unmasked - want))
    ours = csa.splash_attention(q, k, v, options=csa.AttentionOptions(block_sizes=SMALL),
                                interpret=True)
    ours_err = _check(ours, want, jnp.float32, "padded keys")
    assert unmasked_err > 100 * TOL[jnp.float32], unmasked_err
    assert ours_err < TOL[jnp.float32] < unmasked_err / 100


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,valid,bs", [
    (300, 283, SMALL),  # tail inside the last block
    (512, 300, SMALL),  # a whole block past valid_kv_len is never visited
    (777, 641, csa.BlockSizes(256, 512, 256)),  # odd lengths, a partial compute sub-tile
    (200, 200, SMALL),  # nothing padded
])
def test_valid_kv_len_equals_sliced_keys(n, valid, bs, dtype):
    """Keys past ``valid_kv_len`` are padding: the result equals attention over the sliced
    K and V, whatever the padding holds (here large values, which would dominate the
    softmax if any leaked). Padded query rows stay finite."""
    q, k, v = _inputs((1, 2, n, 64), n, dtype, seed=n + valid)
    k = k.at[:, :, valid:].set(30.0)
    v = v.at[:, :, valid:].set(1e4)
    out = csa.splash_attention(q, k, v, options=csa.AttentionOptions(block_sizes=bs),
                               interpret=True, valid_kv_len=valid)
    assert out.dtype == dtype and out.shape == q.shape
    _check(out, _ref64(q, k[:, :, :valid], v[:, :, :valid]), dtype, "valid_kv_len")


def test_valid_kv_len_validation():
    q, k, v = _inputs((1, 1, 128, 64), 128, jnp.float32)
    for bad in (0, 129, 12.5):
        with pytest.raises(ValueError, match=r"valid_kv_len: expected an int in \[1, 128\]"):
            csa.splash_attention(q, k, v, interpret=True, valid_kv_len=bad)


# ---------------------------------------------------------------------------------------
# Segment ids, window, k smoothing
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_segment_ids_with_empty_row(dtype):
    """Segments, incl. queries whose id no key has: those rows are zeros, not NaN."""
    b, h, q_len, kv_len, d = 2, 1, 200, 300, 64
    q, k, v = _inputs((b, h, q_len, d), kv_len, dtype, seed=5)
    q_ids = np.zeros((b, q_len), np.int32)
    q_ids[:, 60:] = 1
    q_ids[0, 150:170] = 7  # no key has id 7: empty rows
    kv_ids = np.zeros((b, kv_len), np.int32)
    kv_ids[:, 100:] = 1
    kv_ids[1, 250:] = 2
    valid = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    want = _ref64(q, k, v, valid=valid)
    for seg in (
        (jnp.asarray(q_ids), jnp.asarray(kv_ids)),
        csa.SegmentIds(jnp.asarray(q_ids), jnp.asarray(kv_ids)),
    ):
        out = csa.splash_attention(q, k, v, segment_ids=seg,
                                   options=csa.AttentionOptions(block_sizes=SMALL), interpret=True)
        _check(out, want, dtype, "segments")
        assert np.all(np.asarray(out[0, :, 150:170], np.float32) == 0.0)


@contextlib.contextmanager
def _kernel_spy():
    """Yields the list of ``real_kv_blocks`` each kernel trace got."""
    seen, real_kernel = [], splash_kernel._splash_kernel

    def spy(*args, **kwargs):
        seen.append(kwargs["real_kv_blocks"])
        return real_kernel(*args, **kwargs)

    splash_kernel._splash_kernel = spy
    try:
        yield seen
    finally:
        splash_kernel._splash_kernel = real_kernel


def _real_prefix_case(pad, seed=3):
    """Self-attention-style ids (real = 1, padding = 0 over ``pad``), one query whose id no
    key has, and a key that makes one query's max jump by ~90 base-2 units inside an
    all-real block (the lazy shift's exact redo runs there)."""
    b, n = 2, 700
    q, k, v = _inputs((b, 1, n, 64), n, jnp.float32, seed=seed)
    k = np.asarray(k).copy()
    k[0, 0, 450] = 8 * np.asarray(q)[0, 0, 200]
    ids = np.ones((b, n), np.int32)
    if pad:
        ids[:, pad[0]:pad[1]] = csa.REAL_SEGMENT_ID - 1
    q_ids = ids.copy()
    q_ids[1, 5] = 3
    want = _ref64(q, k, v, valid=q_ids[:, None, :, None] == ids[:, None, None, :])
    return (q, jnp.asarray(k), v), (jnp.asarray(q_ids), jnp.asarray(ids)), want


@pytest.mark.parametrize("pad,before,real_blocks", [
    ((600, 700), 600, 2),  # padding at the end: blocks 0, 1 all real, the last one mixed
    (None, 700, 3),  # nothing can be padding: every block, the ragged last one too
    ((300, 340), 300, 1),  # padding in the middle: block 1 must take the exact compare
], ids=["end", "none", "middle"])
def test_real_keys_before_is_exact(pad, before, real_blocks):
    """Static block classification (issue #26): kv blocks wholly before ``real_keys_before``
    skip the id compare; every row (padded queries and an id no key has included) stays
    equal to the float64 reference."""
    (q, k, v), seg, want = _real_prefix_case(pad)
    bs = csa.BlockSizes(128, 256, 128)  # 3 kv blocks of 256, the last one ragged (188)
    with _kernel_spy() as seen:
        out = csa.splash_attention(q, k, v, segment_ids=seg,
                                   options=csa.AttentionOptions(block_sizes=bs), interpret=True,
                                   real_keys_before=before)
    assert set(seen) == {real_blocks}
    _check(out, want, jnp.float32, f"real_keys_before={before}")
    assert np.all(np.asarray(out[1, :, 5]) == 0.0)


def test_real_keys_before_skips_the_compare():
    """A broken promise (padding at 300-340 declared real) lets real queries attend the
    padding: proof that the all-real blocks really read no ids."""
    (q, k, v), seg, want = _real_prefix_case((300, 340))
    out = csa.splash_attention(
        q, k, v, segment_ids=seg,
        options=csa.AttentionOptions(block_sizes=csa.BlockSizes(128, 256, 128)),
        interpret=True, real_keys_before=700)
    assert np.max(np.abs(np.asarray(out, np.float64) - want)) > 0.1


@pytest.mark.parametrize("window", [0, 40, 200])
def test_window(window):
    q_len = kv_len = 390
    q, k, v = _inputs((1, 2, q_len, 64), kv_len, jnp.float32, seed=window)
    bs = csa.BlockSizes(128, 128, 128)
    options = csa.AttentionOptions(block_sizes=bs, mask=csa.LocalMask(window))
    out = csa.splash_attention(q, k, v, options=options, interpret=True)
    want = _ref64(q, k, v, valid=_window_valid(q_len, kv_len, window))
    _check(out, want, jnp.float32, f"window {window}")


def test_window_with_segments_bf16():
    q_len = kv_len = 300
    q, k, v = _inputs((1, 1, q_len, 128), kv_len, jnp.bfloat16, seed=9)
    ids = np.where(np.arange(q_len) < 170, 0, 1).astype(np.int32)[None]
    valid = _window_valid(q_len, kv_len, 64) & (ids[0][:, None] == ids[0][None, :])
    out = csa.splash_attention(
        q, k, v, options=csa.AttentionOptions(block_sizes=SMALL, mask=csa.LocalMask(64)),
        segment_ids=(ids, ids), interpret=True
    )
    _check(out, _ref64(q, k, v, valid=valid), jnp.bfloat16, "window+segments")


def test_k_smoothing_is_exact_f32():
    # A large common offset on K: smoothing removes it, the result must not change.
    q, k, v = _inputs((1, 2, 200, 64), 300, jnp.float32, seed=4, k_offset=3.0)
    out = csa.splash_attention(
        q, k, v, options=csa.AttentionOptions(block_sizes=SMALL, k_smoothing=True),
        interpret=True)
    _check(out, _ref64(q, k, v), jnp.float32, "k_smoothing")


@pytest.mark.parametrize("offset", [8.0, 512.0])
def test_k_smoothing_bf16_within_tolerance(offset):
    """A large component shared by all keys: smoothed bf16 stays at bf16 resolution.

    The reference is the exact attention of the bf16 inputs. Scores are f32 in the
    kernel and the rounding of q times the shared component is a per-row constant that
    softmax cancels, so smoothing does not have to (and does not measurably) lower the
    error here; it must not raise it past bf16 resolution either, even though it re-rounds
    K after the f32 subtraction.
    """
    rng = np.random.default_rng(int(offset))
    q, k, v = (rng.standard_normal((1, 2, 256, 128)) for _ in range(3))
    k = k + offset * rng.standard_normal((1, 2, 1, 128))
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    out = csa.splash_attention(
        q, k, v, options=csa.AttentionOptions(block_sizes=SMALL, k_smoothing=True),
        interpret=True)
    _check(out, _ref64(q, k, v), jnp.bfloat16, f"k_smoothing offset {offset}")


def test_k_smoothing_mean_over_attendable_keys_only():
    """Keys in a segment no query has (e.g. padding) must not move the mean."""
    q, k, v = _inputs((1, 1, 128, 64), 200, jnp.float32, seed=12)
    k = k.at[:, :, 150:].set(1e4)  # huge padding keys, never attended
    q_ids = jnp.zeros((1, 128), jnp.int32)
    kv_ids = jnp.where(jnp.arange(200) < 150, 0, 5)[None].astype(jnp.int32)
    smoothed = csa._smooth_keys(k, csa.SegmentIds(q_ids, kv_ids))
    real_mean = np.asarray(k[:, :, :150]).mean(axis=2, keepdims=True)
    np.testing.assert_allclose(
        np.asarray(smoothed[:, :, :150]), np.asarray(k[:, :, :150]) - real_mean, atol=1e-4
    )
    valid = np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :]
    out = csa.splash_attention(
        q, k, v, options=csa.AttentionOptions(block_sizes=SMALL, k_smoothing=True),
        segment_ids=(q_ids, kv_ids), interpret=True
    )
    _check(out, _ref64(q, k, v, valid=valid), jnp.float32, "k_smoothing+segments")


# ---------------------------------------------------------------------------------------
# Second reference: JAX's stock splash kernel
# ---------------------------------------------------------------------------------------


def test_matches_stock_splash_kernel():
    from jax.experimental.pallas.ops.tpu import splash_attention as stock

    b, h, s, d = 2, 2, 256, 128
    q, k, v = _inputs((b, h, s, d), s, jnp.float32, seed=21)
    scale = 1.0 / math.sqrt(d)
    stock_bs = stock.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128)
    for window in (None, 50):
        if window is None:
            mask = stock.MultiHeadMask([stock.FullMask((s, s))] * h)
        else:
            mask = stock.MultiHeadMask(
                [stock.LocalMask((s, s), window_size=(window, window), offset=0)] * h
            )
        kernel = stock.make_splash_mha(
            mask, block_sizes=stock_bs, head_shards=1, q_seq_shards=1, interpret=True
        )
        # The stock kernel takes (heads, len, head_dim) and applies no softmax scale.
        want = jax.vmap(kernel)(q * scale, k, v)
        options = csa.AttentionOptions(block_sizes=csa.BlockSizes(128, 128, 128),
                                       mask=None if window is None else csa.LocalMask(window))
        ours = csa.splash_attention(q, k, v, options=options, interpret=True)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(want), atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_q=0), "block_q: expected a positive int, got 0"),
        (dict(block_q=100), "block_q: expected a multiple of 128, got 100"),
        (
            dict(block_kv=384, block_kv_compute=256),
            "block_kv: expected a multiple of block_kv_compute=256, got 384",
        ),
        (dict(block_kv_compute=-128), "block_kv_compute: expected a positive int, got -128"),
    ],
)
def test_block_sizes_validation(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        csa.BlockSizes(**kwargs)
    # The error carries the field, so callers map it to their own flag without parsing text.
    assert info.value.field == match.split(":")[0]
    assert info.value.value == kwargs[info.value.field]


def test_block_size_fitting():
    fit = csa._fit_block_sizes
    # Wan 14B 720p: the defaults are already the balanced blocks for 75,600 tokens.
    assert fit(csa.BlockSizes(), 75600, 75600) == csa.BlockSizes(3328, 2816, 256)
    # Short sequences clamp every block.
    assert fit(csa.BlockSizes(), 200, 77) == csa.BlockSizes(256, 128, 128)
    # Cross-attention with 512 text tokens: one KV block of two compute tiles.
    assert fit(csa.BlockSizes(), 75600, 512) == csa.BlockSizes(3328, 512, 256)
    # Same block count, less padding: 1000 tokens in 2 blocks of 512.
    assert fit(csa.BlockSizes(768, 768, 256), 1000, 1000) == csa.BlockSizes(512, 512, 256)


def test_input_validation():
    q, k, v = _inputs((1, 1, 128, 64), 128, jnp.float32)
    with pytest.raises(ValueError, match="window_size"):
        csa.splash_attention(q, k, v, options=csa.AttentionOptions(mask=csa.LocalMask(-1)),
                             interpret=True)
    with pytest.raises(ValueError, match="segment_ids"):
        csa.splash_attention(
            q, k, v, segment_ids=(jnp.zeros((1, 5), jnp.int32), jnp.zeros((1, 128), jnp.int32))
        )
    with pytest.raises(ValueError, match="v: expected the shape of k"):
        csa.splash_attention(q, k, v[:, :, :64], interpret=True)


# ---------------------------------------------------------------------------------------
# Sharded wrapper on 8 CPU devices
# ---------------------------------------------------------------------------------------


def _mesh(dp, tp, sp):
    devices = jax.devices()
    if len(devices) < dp * tp * sp:
        pytest.skip(
            f"needs {dp * tp * sp} devices (XLA_FLAGS="
            f"--xla_force_host_platform_device_count=8), have {len(devices)}"
        )
    return Mesh(np.array(devices[: dp * tp * sp]).reshape(dp, tp, sp), ("dp", "tp", "sp"))


@pytest.mark.parametrize(
    "mesh_shape,heads,kv_len,window",
    [
        ((2, 4, 1), 4, 256, None),  # sp == 1: heads over tp
        ((2, 2, 2), 4, 200, None),  # cross-attention shape: q sequence over sp, K/V whole
        ((1, 4, 2), 4, 256, None),  # heads % (tp*sp) != 0: q sequence over sp
        ((1, 4, 2), 4, 200, 30),  # sequence-parallel window needs each shard's q offset
        ((2, 2, 2), 4, 256, None),  # self-attention: Ulysses all-to-all over sp
        ((1, 2, 4), 8, 256, 30),  # Ulysses with a window (whole sequences: no offset)
    ],
)
def test_sharded_matches_unsharded(mesh_shape, heads, kv_len, window):
    mesh = _mesh(*mesh_shape)
    q, k, v = _inputs((2, heads, 256, 64), kv_len, jnp.float32, seed=31)
    bs = csa.BlockSizes(128, 128, 128)
    options = csa.AttentionOptions(block_sizes=bs,
                                   mask=None if window is None else csa.LocalMask(window))
    want = csa.splash_attention(q, k, v, options=options, interpret=True)
    got = jax.jit(
        lambda q, k, v: csa.sharded_splash_attention(
            q, k, v, mesh=mesh, options=options, interpret=True
        )
    )(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


def test_ulysses_layout_is_four_all_to_alls():
    # Inputs laid out as the sequence-parallel residual stream leaves them: the wrapper must
    # re-shard with all-to-alls only (no gathers of whole sequences).
    mesh = _mesh(2, 2, 2)
    spec = NamedSharding(mesh, P("dp", "tp", "sp", None))
    q, k, v = (jax.device_put(x, spec) for x in _inputs((2, 4, 256, 64), 256, jnp.float32))
    fn = jax.jit(lambda q, k, v: csa.sharded_splash_attention(
        q, k, v, mesh=mesh, options=csa.AttentionOptions(block_sizes=csa.BlockSizes(128, 128, 128)),
        interpret=True))
    hlo = fn.lower(q, k, v).compile().as_text()
    count = {op: len(re.findall(rf" {op}(-start)?\(", hlo))
             for op in ("all-to-all", "all-gather", "all-reduce", "collective-permute")}
    assert count == {"all-to-all": 4, "all-gather": 0, "all-reduce": 0,
                     "collective-permute": 0}, count
    assert fn(q, k, v).sharding.spec == P("dp", "tp", "sp", None)


@pytest.mark.parametrize("sp", [2, 4, 8])
def test_ulysses_chunks_outermost_equals_in_place_all_to_all(sp):
    # The wrapper's all-to-all runs on (sp, B, H/sp, S/sp, D); the reference is the in-place
    # form it replaced (split heads, concatenate the sequence), and its exact inverse.
    mesh = _mesh(8 // sp, 1, sp)
    x = jnp.arange(8 // sp * 8 * 24 * 4, dtype=jnp.float32).reshape(8 // sp, 8, 24, 4)
    x = jax.device_put(x, NamedSharding(mesh, P("dp", None, "sp", None)))

    def both(x):
        want = jax.lax.all_to_all(x, "sp", split_axis=1, concat_axis=2, tiled=True)
        got = csa._ulysses_to_heads(x, sp)
        return got, want, csa._ulysses_to_tokens(got, sp)

    spec = P("dp", None, "sp", None)
    got, want, back = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(spec,),
                                            out_specs=(spec, spec, spec)))(x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))


@pytest.mark.parametrize("mesh_shape,kv_len", [((1, 4, 2), 128), ((1, 2, 4), 256)],
                         ids=["q-sequence", "ulysses"])
def test_sharded_segment_ids(mesh_shape, kv_len):
    mesh = _mesh(*mesh_shape)
    q, k, v = _inputs((2, 8, 256, 64), kv_len, jnp.float32, seed=32)
    q_ids = jnp.asarray(np.repeat([[0, 1]], 128, axis=1).repeat(2, axis=0), jnp.int32)
    kv_ids = jnp.asarray(np.repeat([[0, 1]], kv_len // 2, axis=1).repeat(2, axis=0), jnp.int32)
    want = _ref64(
        q, k, v, valid=np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :]
    )
    got = csa.sharded_splash_attention(
        q,
        k,
        v,
        mesh=mesh,
        segment_ids=(q_ids, kv_ids),
        options=csa.AttentionOptions(block_sizes=csa.BlockSizes(128, 128, 128)),
        interpret=True,
    )
    _check(got, want, jnp.float32, "sharded segments")


@pytest.mark.parametrize("mesh_shape", [(1, 4, 2), (2, 2, 2)], ids=["q-sequence", "ulysses"])
def test_sharded_real_keys_before(mesh_shape):
    """Under sp the kernel sees the whole key sequence in every layout, so the global
    position applies unchanged: padding at the end (as sp padding), exact on every row."""
    mesh = _mesh(*mesh_shape)
    heads = 4 if mesh_shape == (1, 4, 2) else 8  # 4 over tp*sp=8 forces the q-sequence layout
    n, pad_from = 512, 460
    q, k, v = _inputs((2, heads, n, 64), n, jnp.float32, seed=33)
    ids = np.ones((2, n), np.int32)
    ids[:, pad_from:] = 0
    want = _ref64(q, k, v, valid=ids[:, None, :, None] == ids[:, None, None, :])
    with _kernel_spy() as seen:
        got = csa.sharded_splash_attention(
            q, k, v, mesh=mesh, segment_ids=(jnp.asarray(ids), jnp.asarray(ids)),
            options=csa.AttentionOptions(block_sizes=csa.BlockSizes(128, 128, 128)),
            interpret=True, real_keys_before=pad_from)
    assert set(seen) == {pad_from // 128}  # blocks 0-2 all real, block 3 holds the padding
    _check(got, want, jnp.float32, "sharded real_keys_before")


@pytest.mark.parametrize("mesh_shape,heads", [((2, 2, 2), 8), ((1, 4, 2), 4), ((2, 4, 1), 4)],
                         ids=["ulysses", "q-sequence", "heads"])
def test_sharded_valid_kv_len(mesh_shape, heads):
    """Every layout hands the kernel whole key sequences, so the global ``valid_kv_len``
    applies unchanged: real rows equal attention over the sliced keys."""
    mesh = _mesh(*mesh_shape)
    n, valid = 256, 230
    q, k, v = _inputs((2, heads, n, 64), n, jnp.float32, seed=34)
    v = v.at[:, :, valid:].set(1e4)
    got = jax.jit(lambda q, k, v: csa.sharded_splash_attention(
        q, k, v, mesh=mesh, options=csa.AttentionOptions(block_sizes=csa.BlockSizes(128, 128, 128)),
        interpret=True, valid_kv_len=valid))(q, k, v)
    _check(got, _ref64(q, k[:, :, :valid], v[:, :, :valid]), jnp.float32, "sharded valid")


def test_sdpa_declared_tail_padding_uses_valid_kv_len(torchax_env):
    """Declared sp padding at the keys' tail, no mask: the override gives our kernel
    ``valid_kv_len`` and no segment ids (the kernel's id-compare path never runs), and real
    rows equal torch's SDPA over the real keys; XLA masks the same keys."""
    import torch

    s, valid = 300, 271
    q, k, v = _torch_inputs(s, s, seed=9)
    v[:, :, valid:] = 1e4
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, :valid], k[:, :, :valid], v[:, :, :valid]).numpy()
    for attention in ("splash", "xla"):
        csa.install_sdpa_override(torchax_env, attention=attention, mesh=_mesh(2, 2, 2),
                                  options=csa.AttentionOptions(
                                      block_sizes=csa.BlockSizes(128, 128, 128)),
                                  interpret=True)
        token = csa.pad_self_attention_keys(s, valid)
        flag = csa._IN_SELF_ATTENTION.set(True)
        seen, real_kernel = [], splash_kernel._splash_kernel

        def spy(*args, seen=seen, real_kernel=real_kernel, **kwargs):
            seen.append((kwargs["kv_len"], args[4] is not None))  # (kv_len, segment ids?)
            return real_kernel(*args, **kwargs)

        splash_kernel._splash_kernel = spy
        try:
            got = _run_sdpa(torchax_env, q, k, v)
        finally:
            splash_kernel._splash_kernel = real_kernel
            csa._IN_SELF_ATTENTION.reset(flag)
            csa.unpad_self_attention_keys(token)
        assert set(seen) == ({(valid, False)} if attention == "splash" else set())
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got[:, :, :valid], want, atol=2e-5, rtol=2e-5)


def test_sdpa_real_keys_position():
    """Where the SDPA override says keys are real: a key-padding mask alone, nowhere; a
    family's ``real_keys_before`` bounds it; declared sp padding starts at its valid
    length; with both, the smaller."""
    q = k = jnp.zeros((2, 1, 200, 8))
    mask = jnp.ones((2, 1, 1, 200), bool)
    assert csa._real_keys(q, k, None)[2] == 200
    assert csa._real_keys(q, k, mask)[2] == 0
    with csa.real_keys_before(150):
        assert csa._real_keys(q, k, mask)[2] == 150
    token = csa.pad_self_attention_keys(200, 180)
    flag = csa._IN_SELF_ATTENTION.set(True)
    try:
        assert csa._real_keys(q, k, None)[2] == 180
        with csa.real_keys_before(190):
            assert csa._real_keys(q, k, mask)[2] == 180
        with csa.real_keys_before(150):
            assert csa._real_keys(q, k, mask)[2] == 150
    finally:
        csa._IN_SELF_ATTENTION.reset(flag)
        csa.unpad_self_attention_keys(token)


def test_sharded_validation():
    mesh = _mesh(1, 4, 2)
    q, k, v = _inputs((1, 6, 128, 64), 128, jnp.float32)
    with pytest.raises(ValueError, match="heads: expected a multiple of mesh axis tp=4, got 6"):
        csa.sharded_splash_attention(q, k, v, mesh=mesh, interpret=True)


# ---------------------------------------------------------------------------------------
# torch SDPA override through torchax
# ---------------------------------------------------------------------------------------


def _torch_inputs(q_len, kv_len, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 4, n, 64, generator=g) for n in (q_len, kv_len, kv_len))


def _run_sdpa(env, q, k, v, **kwargs):
    import torch

    with env:
        qx, kx, vx = env.to_xla((q, k, v))
        if "attn_mask" in kwargs and kwargs["attn_mask"] is not None:
            kwargs["attn_mask"] = env.to_xla(kwargs["attn_mask"])
        out = torch.nn.functional.scaled_dot_product_attention(qx, kx, vx, **kwargs)
        return np.asarray(env.t2j_iso(out))


@pytest.mark.parametrize(
    "attention,mesh_shape", [("splash", None), ("splash", (2, 2, 2)), ("xla", None)]
)
def test_sdpa_override_matches_torch(torchax_env, attention, mesh_shape):
    import torch

    mesh = None if mesh_shape is None else _mesh(*mesh_shape)
    csa.install_sdpa_override(
        torchax_env,
        attention=attention,
        mesh=mesh,
        options=csa.AttentionOptions(block_sizes=csa.BlockSizes(128, 128, 128)),
        interpret=True,
    )
    q, k, v = _torch_inputs(200, 150, seed=1)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.2).numpy()
    got = _run_sdpa(torchax_env, q, k, v, scale=0.2)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


def test_sdpa_override_masked_fallback(torchax_env):
    import torch

    csa.install_sdpa_override(torchax_env, attention="splash", interpret=True)
    q, k, v = _torch_inputs(64, 64, seed=2)
    mask = torch.rand(64, 64, generator=torch.Generator().manual_seed(3)) > 0.3
    F = torch.nn.functional
    for kwargs in (dict(attn_mask=mask), dict(is_causal=True), dict(attn_mask=torch.randn(64, 64))):
        want = F.scaled_dot_product_attention(q, k, v, **kwargs).numpy()
        got = _run_sdpa(torchax_env, q, k, v, **kwargs)
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("attention,mesh_shape,mask_heads", [
    ("splash", None, 1), ("splash", (2, 2, 2), 4), ("stock_splash", (2, 2, 1), 1),
    ("xla", None, 4),
])
def test_sdpa_override_key_padding_mask_is_exact(torchax_env, attention, mesh_shape,
                                                 mask_heads):
    """A boolean (B, 1 or H, 1, S) key-padding mask (HunyuanVideo-1.5's text padding) takes
    the kernels through segment ids: real queries equal torch's masked SDPA, padded query
    rows stay finite (stock SDPA gives NaN for a fully masked row; diffusers' dense mask
    makes such rows), and a padded key's value cannot reach a real query."""
    import torch

    mesh = None if mesh_shape is None else _mesh(*mesh_shape)
    csa.install_sdpa_override(torchax_env, attention=attention, mesh=mesh,
                              options=csa.AttentionOptions(
                                  block_sizes=csa.BlockSizes(128, 128, 128)),
                              interpret=True)
    s = 200  # odd tail: not a multiple of the 128 blocks
    q, k, v = _torch_inputs(s, s, seed=4)
    real = torch.ones(2, s, dtype=torch.bool)
    real[0, 150:] = False  # sample 0: 50 padded tokens at the end
    real[1, 37:41] = False  # sample 1: padding in the middle
    mask = real[:, None, None, :].expand(2, mask_heads, 1, s)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).numpy()
    got = _run_sdpa(torchax_env, q, k, v, attn_mask=mask)
    assert np.isfinite(got).all()
    rows = real.numpy()
    np.testing.assert_allclose(got.transpose(0, 2, 1, 3)[rows],
                               want.transpose(0, 2, 1, 3)[rows], atol=2e-5, rtol=2e-5)
    v_poisoned = v.clone()
    v_poisoned[~real[:, None, :].expand(2, 4, s)] = 1e4
    poisoned = _run_sdpa(torchax_env, q, k, v_poisoned, attn_mask=mask)
    np.testing.assert_allclose(poisoned.transpose(0, 2, 1, 3)[rows],
                               got.transpose(0, 2, 1, 3)[rows], atol=2e-5, rtol=2e-5)


def test_sdpa_override_real_keys_before_under_sp(torchax_env):
    """HunyuanVideo-1.5's route under sp: a family-declared ``real_keys_before`` (video
    tokens first, padding only in the text) and declared sp padding, through the sharded
    kernel on dp2 x tp2 x sp2. The kernel gets the smaller position (2 all-real kv blocks of
    128) and real rows equal torch's masked SDPA."""
    import torch

    csa.install_sdpa_override(torchax_env, attention="splash", mesh=_mesh(2, 2, 2),
                              options=csa.AttentionOptions(
                                  block_sizes=csa.BlockSizes(128, 128, 128)),
                              interpret=True)
    s, video = 400, 300  # [video tokens 0-299 (sp padding from 290), text 300-399]
    q, k, v = _torch_inputs(s, s, seed=8)
    real = torch.ones(2, s, dtype=torch.bool)
    real[:, 290:300] = False  # sp padding, declared below
    real[0, 350:] = False  # text padding, in the mask
    real[1, 320:330] = False
    mask = real.clone()
    mask[:, 290:300] = True  # the family's mask knows nothing of sp padding
    token = csa.pad_self_attention_keys(300, 290)
    flag = csa._IN_SELF_ATTENTION.set(True)
    try:
        with _kernel_spy() as seen, csa.real_keys_before(video):
            got = _run_sdpa(torchax_env, q, k, v, attn_mask=mask[:, None, None, :])
    finally:
        csa._IN_SELF_ATTENTION.reset(flag)
        csa.unpad_self_attention_keys(token)
    assert set(seen) == {290 // 128}
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=real[:, None, None, :]).numpy()
    rows = real.numpy()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.transpose(0, 2, 1, 3)[rows],
                               want.transpose(0, 2, 1, 3)[rows], atol=2e-5, rtol=2e-5)


def test_key_padding_mask_builds_no_dense_mask(torchax_env):
    """Through the Splash kernel the compiled program holds no (S, S) array at all."""
    import jax
    import torch
    from torchax import interop

    csa.install_sdpa_override(torchax_env, attention="splash",
                              options=csa.AttentionOptions(
                                  block_sizes=csa.BlockSizes(128, 128, 128)),
                              interpret=True)
    s = 300

    def attend(q, k, v, real):
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=real[:, None, None, :])

    args = [jax.ShapeDtypeStruct((1, 2, s, 64), jax.numpy.float32)] * 3 + [
        jax.ShapeDtypeStruct((1, s), jax.numpy.bool_)]
    hlo = jax.jit(interop.jax_view(attend)).lower(*args).as_text()
    assert f"{s},{s}" not in hlo.replace(" ", "")


def test_sdpa_override_rejects_unknown_backend(torchax_env):
    with pytest.raises(ValueError, match="attention: expected one of"):
        csa.install_sdpa_override(torchax_env, attention="flash")
