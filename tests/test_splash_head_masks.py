"""Per-head masks (``HeadMasks`` + ``mask_index``, issue 53) in Pallas interpret mode on CPU.

One kernel call carries a few static masks; an int32 (batch, heads) index, data, picks one
per (batch, head). References, independent of the kernel: dense masks built in NumPy (SVG's
temporal mask mapped back to frame-major with the reshape/permute of SVG's
``get_attention_mask``, svg/models/wan/utils.py @ 5ce7b01, as tests/test_splash_svg.py
does), float32 attention (``reference_attention``) on the very inputs the kernel sees, and
the masks' exhaustive block classes (``Mask.block_classes``). Tolerances as
tests/test_splash_mask.py: f32 1e-5, bf16 1e-2 (a wrong mask is O(0.1)).
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import custom_splash_attention as csa  # noqa: E402
from splash import kernel as splash_kernel  # noqa: E402
from splash import svg  # noqa: E402
from splash.mask import EMPTY, HeadMasks, LocalMask, Mask  # noqa: E402
from splash.mask_info import build_head_mask_info  # noqa: E402

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
BS = csa.BlockSizes(128, 128, 128)
F, P = 9, 71  # frames x positions: N = 639, odd; 5 kv blocks of 128, the last ragged
N = F * P
# Spatial and temporal masks of different widths, so the index must pick the right tables
# (SVG uses one width for both) and the lighter mask pads its q blocks with skip steps.
SPATIAL, TEMPORAL = svg.AnchoredBandMask(30, P), svg.AnchoredBandMask(300, P)
INDEX_SETS = {"all-spatial": [[0, 0], [0, 0]], "all-temporal": [[1, 1], [1, 1]],
              "mixed": [[0, 1], [1, 0]]}


def _inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(3))


def _band(n, window, anchor):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (np.abs(i - j) <= window) | (j < anchor)


def _temporal_dense(window, anchor):
    """The mask on position-major tokens, as a frame-major (N, N) mask (SVG's mapping)."""
    return _band(N, window, anchor).reshape(P, F, P, F).transpose(1, 0, 3, 2).reshape(N, N)


def _reference(q, k, v, allowed):
    """float32 attention with a dense (batch, heads, q, kv) mask."""
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    return np.asarray(csa.reference_attention(*f32, mask=jnp.asarray(allowed)))


def _check(out, want, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, want, atol=TOL[dtype], rtol=TOL[dtype])


def _per_head(index, x, y):
    """x where index == 0, y where 1, per (batch, head) of (B, H, N, D) arrays."""
    return jnp.where((index == 1)[:, :, None, None], y, x)


@pytest.mark.parametrize("dtype,masks", [
    (jnp.float32, (SPATIAL, TEMPORAL)), (jnp.bfloat16, (SPATIAL, TEMPORAL)),
    (jnp.float32, (svg.svg_mask(0.3, F, P),) * 2)], ids=["f32", "bf16", "f32-svg-widths"])
def test_svg_patterns_per_head_equal_dense_reference(dtype, masks):
    """SVG's two patterns in one call: temporal heads' q, k, v permuted position-major in
    the graph (and the output back), every head's mask from the index (last case: SVG's own
    setting, one width for both). All-spatial, all-temporal and mixed index sets run
    through one compiled function: no retrace."""
    q, k, v = _inputs((2, 2, N, 64), dtype, seed=11)
    options = csa.AttentionOptions(block_sizes=BS, mask=HeadMasks(masks))
    traces = []

    def call(q, k, v, index):
        traces.append(1)
        pm = [_per_head(index, x, svg.to_position_major(x, F, P)) for x in (q, k, v)]
        out = csa.splash_attention(*pm, options=options, interpret=True, mask_index=index)
        return _per_head(index, out, svg.to_frame_major(out, F, P))

    run = jax.jit(call)
    dense = np.stack([_band(N, masks[0].window, P), _temporal_dense(masks[1].window, P)])
    for index in INDEX_SETS.values():
        index = np.asarray(index, np.int32)
        _check(run(q, k, v, jnp.asarray(index)), _reference(q, k, v, dense[index]), dtype)
    assert len(traces) == 1 and run._cache_size() == 1, "a new mask_index recompiled"


def test_head_masks_with_segment_ids_and_valid_kv_len():
    """Per-head masks compose with the data masks: segment ids (key padding, different per
    batch row) and a key tail by length. Masks of two classes in one order."""
    n, valid = 391, 350
    masks = HeadMasks((svg.AnchoredBandMask(40, 50), LocalMask(100), LocalMask(0)))
    index = np.asarray([[2, 0, 1], [1, 1, 0]], np.int32)
    q, k, v = _inputs((2, 3, n, 64), jnp.float32, seed=5)
    ids = np.ones((2, n), np.int32)
    ids[0, 300:], ids[1, 120:200] = 0, 0
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    dense = np.stack([_band(n, 40, 50), np.abs(i - j) <= 100, i == j])[index]
    options = csa.AttentionOptions(block_sizes=csa.BlockSizes(128, 256, 128), mask=masks)
    seg = (jnp.asarray(ids), jnp.asarray(ids))
    out = csa.splash_attention(q, k, v, options=options, interpret=True, segment_ids=seg,
                               mask_index=jnp.asarray(index))
    _check(out, _reference(q, k, v, dense & (ids[:, None, :, None] == ids[:, None, None, :])),
           jnp.float32)
    out = csa.splash_attention(q, k, v, options=options, interpret=True, valid_kv_len=valid,
                               mask_index=jnp.asarray(index))
    _check(out, _reference(q, k, v, dense & (j < valid)), jnp.float32)


def _mesh(dp, tp, sp):
    devices = jax.devices()
    if len(devices) < dp * tp * sp:
        pytest.skip(f"needs {dp * tp * sp} devices (--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(devices[:dp * tp * sp]).reshape(dp, tp, sp), ("dp", "tp", "sp"))


@pytest.mark.parametrize("mesh_shape,batch,heads", [((1, 2, 4), 1, 8), ((2, 4, 1), 2, 4),
                                                    ((1, 4, 2), 1, 4)],
                         ids=["ulysses", "tp-dp", "q-sequence"])
def test_sharded_head_masks_equal_dense_reference(mesh_shape, batch, heads):
    """The index is sharded as q's batch and heads: Ulysses (heads over tp x sp after the
    all-to-all), heads over tp with batch over dp, and q's sequence over sp (global query
    positions in each shard's table). An irregular index: a wrong head slice fails."""
    mesh = _mesh(*mesh_shape)
    n = 256
    masks = HeadMasks((svg.AnchoredBandMask(20, 64), LocalMask(90)))
    index = np.random.default_rng(1).integers(0, 2, (batch, heads)).astype(np.int32)
    index[0, :2] = [1, 0]
    q, k, v = _inputs((batch, heads, n, 64), jnp.float32, seed=21)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    dense = np.stack([_band(n, 20, 64), np.abs(i - j) <= 90])[index]
    options = csa.AttentionOptions(block_sizes=BS, mask=masks)
    got = jax.jit(lambda q, k, v, index: csa.sharded_splash_attention(
        q, k, v, mesh=mesh, options=options, interpret=True, mask_index=index))(
        q, k, v, jnp.asarray(index))
    _check(got, _reference(q, k, v, dense), jnp.float32)


def test_visited_tiles_are_the_chosen_masks_non_empty_tiles():
    """Walk the kernel's own index maps and tile classes over every (batch, head, q block,
    kv step) with the host tables: each (batch, head) fetches exactly the kv blocks its
    mask needs, computes exactly its non-empty sub-tiles, and a lighter mask's extra steps
    fetch nothing new (the block before) and compute nothing."""
    n, bs = 2300, csa.BlockSizes(256, 256, 128)
    masks = (svg.AnchoredBandMask(150, 230), LocalMask(40))  # SVG-like, and a narrow band
    info = build_head_mask_info(masks, n, n, bs)
    lay = info.layout
    index = np.asarray([[0, 1, 1], [1, 0, 0]], np.int32)
    heads = index.shape[1]
    table, flat_index = info.table.reshape(-1), index.reshape(-1)
    kv_spec = splash_kernel._specs(bs, 64, lay, HeadMasks(masks), False, 0, 9, heads)[1]
    steps = [m_info.num_kv_steps for m_info in
             (build_head_mask_info((m,), n, n, bs) for m in masks)]
    assert lay.num_kv_steps == max(steps) and min(steps) < max(steps)
    for b, h in np.ndindex(index.shape):
        mask = masks[index[b, h]]
        sub = Mask.block_classes(mask, n, n, bs.block_q, bs.block_kv_compute)
        for i in range(lay.num_q_blocks):
            fetched, computed = [], np.zeros(sub.shape[1], bool)
            for j in range(lay.num_kv_steps):
                kv = int(kv_spec.index_map(b, h, i, j, table, flat_index)[2])
                new = not fetched or kv != fetched[-1]
                fetched += [kv] if new else []
                for c in range(lay.num_sub):
                    cls = lay.tile_class(table, i, j, c, index[b, h])
                    assert new or cls == EMPTY, "a repeated (skip) step computed"
                    computed[kv * lay.num_sub + c] |= cls != EMPTY
            busy = (sub[i] != EMPTY)
            np.testing.assert_array_equal(fetched, np.flatnonzero(
                busy.reshape(-1, lay.num_sub).any(axis=1)))
            np.testing.assert_array_equal(computed, busy)
        alone = build_head_mask_info((mask,), n, n, bs).visited(0)
        visited = info.visited(0, index[b, h])
        np.testing.assert_array_equal(visited[:, :alone.shape[1]], alone)
        assert (visited[:, alone.shape[1]:] == -1).all()  # the padding: skip steps


def test_mask_index_errors():
    q = k = v = jnp.zeros((2, 3, 128, 64), jnp.float32)
    hm = csa.AttentionOptions(mask=HeadMasks((LocalMask(1), LocalMask(2))))
    cases = [
        (hm, None, r"mask_index: expected an int32 array of shape \(2, 3\) with HeadMasks "
                   r"in options.mask, got None"),
        (hm, jnp.zeros((3, 2), jnp.int32), r"mask_index: expected an int32 array of shape "
                                          r"\(2, 3\), got int32 \(3, 2\)"),
        (hm, jnp.zeros((2, 3), jnp.float32), r"got float32 \(2, 3\)"),
        (csa.AttentionOptions(mask=LocalMask(1)), jnp.zeros((2, 3), jnp.int32),
         r"mask_index: expected None without HeadMasks in options.mask, got an array of "
         r"shape \(2, 3\)"),
    ]
    for options, index, match in cases:
        with pytest.raises(ValueError, match=match):
            csa.splash_attention(q, k, v, options=options, interpret=True, mask_index=index)
    for bad in ((), [LocalMask(1)] * 9, (LocalMask(1), "band")):
        with pytest.raises(ValueError, match="HeadMasks.masks: expected a tuple of 1 to 8"):
            HeadMasks(bad)
    with pytest.raises(ValueError, match="options.mask: expected None or a Mask for the SDPA"):
        csa.install_sdpa_override(None, attention="splash", options=hm)
    assert HeadMasks([LocalMask(1)]) == HeadMasks((LocalMask(1),))  # hashable, static
