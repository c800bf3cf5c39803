"""The mask protocol of the splash package (``splash.mask``, ``splash.mask_info``), in Pallas
interpret mode on CPU.

A mask is one frozen class: ``tile_predicate`` (and optionally ``block_classes``). The
kernel reads it only through the block classes and the predicate, so a mask defined here,
in the test file alone, must run exactly. References are ``reference_attention`` (float32,
HIGHEST precision) with the mask's dense form built independently in NumPy, on the very
inputs the kernel sees (bf16 inputs rounded first). Tolerances are those of
tests/test_splash_attention.py: f32 1e-5 (observed ~1e-6), bf16 1e-2 (~3 bf16 roundings of
O(1) values); a masking bug is O(0.1).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import ast  # noqa: E402
import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import custom_splash_attention as csa  # noqa: E402
from splash import kernel as splash_kernel  # noqa: E402
from splash.mask import EMPTY, FULL, PARTIAL, LocalMask, Mask  # noqa: E402
from splash.mask_info import build_mask_info  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


@dataclasses.dataclass(frozen=True)
class BlockDiagonalMask(Mask):
    """Test-only mask: tokens attend within consecutive groups of ``size`` positions. It
    relies on ``Mask``'s default ``block_classes`` (no closed form of its own)."""

    size: int

    def tile_predicate(self, q_pos, kv_pos):
        return q_pos // self.size == kv_pos // self.size


def _inputs(n, dtype, seed, heads=2, d=64):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((1, heads, n, d)), dtype) for _ in range(3))


def _reference(q, k, v, allowed: np.ndarray):
    """float32 attention over the exact inputs the kernel saw, with a dense (q, kv) mask."""
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    return np.asarray(csa.reference_attention(*f32, mask=jnp.asarray(allowed)[None, None]))


def _check(out, want, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, want, atol=TOL[dtype], rtol=TOL[dtype])


def _run(q, k, v, mask, bs, **kwargs):
    options = csa.AttentionOptions(block_sizes=bs, mask=mask)
    return csa.splash_attention(q, k, v, options=options, interpret=True, **kwargs)


BLOCKS = [csa.BlockSizes(128, 128, 128), csa.BlockSizes(128, 256, 128),
          csa.BlockSizes(256, 512, 256)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bs", BLOCKS, ids=lambda b: f"{b.block_q}-{b.block_kv}")
@pytest.mark.parametrize("window", [0, 45, 300])
def test_local_mask_matches_dense_band(dtype, bs, window):
    n = 391  # odd: a ragged last q block and a straddling last key sub-tile
    q, k, v = _inputs(n, dtype, seed=window)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    _check(_run(q, k, v, LocalMask(window), bs), _reference(q, k, v, np.abs(i - j) <= window),
           dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bs", BLOCKS[:2], ids=lambda b: f"{b.block_q}-{b.block_kv}")
@pytest.mark.parametrize("size", [100, 128, 200])
def test_test_only_mask_is_exact(dtype, bs, size):
    """A mask defined in this file, with no kernel edit: equal to dense float32 attention."""
    n = 301
    q, k, v = _inputs(n, dtype, seed=size)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    _check(_run(q, k, v, BlockDiagonalMask(size), bs),
           _reference(q, k, v, i // size == j // size), dtype)


def test_test_only_mask_with_segment_ids_and_valid_kv_len():
    """The protocol composes with the data masks: segment ids and a key tail by length."""
    n, valid = 301, 280
    q, k, v = _inputs(n, jnp.float32, seed=4, heads=1)
    ids = np.where(np.arange(n) < 150, 1, 2).astype(np.int32)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = (i // 64 == j // 64) & (ids[:, None] == ids[None, :])
    seg = (jnp.asarray(ids)[None], jnp.asarray(ids)[None])
    _check(_run(q, k, v, BlockDiagonalMask(64), BLOCKS[1], segment_ids=seg),
           _reference(q, k, v, allowed), jnp.float32)
    _check(_run(q, k, v, BlockDiagonalMask(64), BLOCKS[1], valid_kv_len=valid),
           _reference(q, k, v, (i // 64 == j // 64) & (j < valid)), jnp.float32)


def test_test_only_mask_under_q_sequence_sharding():
    """q sharded over "sp" (heads % (tp*sp) != 0): each shard's mask rows use global query
    positions, so the sharded result equals the unsharded one."""
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip("needs 8 devices (--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(devices[:8]).reshape(1, 4, 2), ("dp", "tp", "sp"))
    q, k, v = _inputs(256, jnp.float32, seed=7, heads=4)
    options = csa.AttentionOptions(block_sizes=BLOCKS[0], mask=BlockDiagonalMask(96))
    want = csa.splash_attention(q, k, v, options=options, interpret=True)
    got = jax.jit(lambda q, k, v: csa.sharded_splash_attention(
        q, k, v, mesh=mesh, options=options, interpret=True))(q, k, v)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [0, 1, 100, 129, 1000])
@pytest.mark.parametrize("shape", [(391, 391, 128, 128, 0), (300, 700, 256, 128, 0),
                                   (200, 391, 128, 256, 150)])
def test_local_mask_closed_form_equals_the_default_classes(window, shape):
    """LocalMask's O(blocks) classes equal the protocol's exhaustive default."""
    q_len, kv_len, bq, bkv, offset = shape
    mask = LocalMask(window)
    fast = mask.block_classes(q_len, kv_len, bq, bkv, q_offset=offset)
    slow = Mask.block_classes(mask, q_len, kv_len, bq, bkv, q_offset=offset)
    np.testing.assert_array_equal(fast, slow)
    assert set(np.unique(slow)) <= {EMPTY, PARTIAL, FULL}


def test_mask_info_visits_exactly_the_busy_blocks():
    """Per q block: its non-empty kv blocks in order; the straddling key sub-tile is at
    least PARTIAL (the tail mask), later ones EMPTY."""
    n, bs = 391, csa.BlockSizes(128, 256, 128)
    info = build_mask_info(LocalMask(40), n, n, bs)
    lay, row = info.layout, info.table[0]
    nq = lay.num_q_blocks
    count = row[1:1 + nq]
    visits = row[1 + nq:1 + nq + nq * lay.num_kv_steps].reshape(nq, lay.num_kv_steps)
    classes = row[1 + nq + nq * lay.num_kv_steps:].reshape(nq, lay.num_kv_steps, lay.num_sub)
    np.testing.assert_array_equal(visits[:, 0], [0, 0, 0, 1])
    np.testing.assert_array_equal(count, [1, 2, 2, 1])
    np.testing.assert_array_equal(visits, [[0, 0], [0, 1], [0, 1], [1, 1]])
    assert lay.num_kv_steps == 2
    # q block 3 (rows 384-390) meets keys 344-390: block 1, sub-tile 0 (256-383) partial,
    # sub-tile 1 (384-511) straddles kv_len = 391: partial, not full.
    np.testing.assert_array_equal(classes[3], [[PARTIAL, PARTIAL], [EMPTY, EMPTY]])
    # q block 0 (rows 0-127) with w=40: keys 0-167, i.e. sub-tiles 0 (partial), 1 (partial).
    np.testing.assert_array_equal(classes[0, 0], [PARTIAL, PARTIAL])


def test_masks_are_frozen_hashable_values():
    assert LocalMask(3) == LocalMask(3) and hash(LocalMask(3)) == hash(LocalMask(3))
    assert LocalMask(3) != LocalMask(4) and BlockDiagonalMask(3) != LocalMask(3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        LocalMask(3).window_size = 4
    with pytest.raises(ValueError, match="window_size: expected"):
        LocalMask(-1)
    i, j = np.arange(7)[:, None], np.arange(9)[None, :]
    np.testing.assert_array_equal(np.asarray(LocalMask(2).dense(7, 9)), np.abs(i - j) <= 2)


def test_describe_calls_records_and_can_replace_the_kernel():
    q, k, v = _inputs(300, jnp.float32, seed=1, heads=1)
    seen = []

    def hook(call, inputs):
        seen.append(call)
        return jnp.zeros(call.out_shape.shape, call.out_shape.dtype)

    options = csa.AttentionOptions(block_sizes=BLOCKS[1], mask=LocalMask(40))
    with splash_kernel.describe_calls(hook):
        out = csa.splash_attention(q, k, v, options=options, interpret=True)
    assert np.all(np.asarray(out) == 0.0)
    (call,) = seen
    assert call.grid == (1, 1, 3, 2) and call.mask == LocalMask(40)
    assert call.block_sizes == csa.BlockSizes(128, 256, 128) and call.kv_len == 300
    # Outside the block the kernel runs again.
    assert np.any(np.asarray(csa.splash_attention(q, k, v, options=options, interpret=True)))


def test_package_never_imports_the_public_face_engine_or_families():
    wrong = []
    for path in sorted((ROOT / "splash").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            wrong += [f"{path.name}: {n}" for n in names
                      if n.split(".")[0] in ("custom_splash_attention", "engine", "families")]
    assert not wrong
