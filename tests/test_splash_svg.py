"""Sparse VideoGen's mask, token orders, width and routing (``splash/svg.py``), in Pallas
interpret mode on CPU.

References, independent of the code under test: dense masks built in NumPy (the temporal one
with SVG's own reshape/permute of ``get_attention_mask``, svg/models/wan/utils.py @ 5ce7b01),
float32 attention (``reference_attention``), and a NumPy port of SVG's ``sample_mse`` plus
``torch.argmin`` (svg/models/wan/attention.py @ 5ce7b01; NumPy's argmin also takes the first
of equal values). Tolerances as tests/test_splash_mask.py.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import custom_splash_attention as csa  # noqa: E402
from splash import svg  # noqa: E402
from splash.mask import EDGE, EMPTY, PARTIAL, Mask  # noqa: E402
from splash.mask_info import build_mask_info  # noqa: E402

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
F, P = 5, 39  # frames x positions: N = 195, odd (ragged last blocks)


def _dense(n, window, anchor):
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    return (np.abs(i - j) <= window) | (j < anchor)


def _temporal_dense(window, anchor):
    """The mask on position-major order, mapped to frame-major as SVG's get_attention_mask
    maps its temporal mask (reshape (P, F, P, F), permute (1, 0, 3, 2))."""
    m = _dense(F * P, window, anchor)
    return m.reshape(P, F, P, F).transpose(1, 0, 3, 2).reshape(F * P, F * P)


def _inputs(dtype, seed, heads=2, d=64):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((1, heads, F * P, d)), dtype)
                 for _ in range(3))


def _reference(q, k, v, allowed):
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    return np.asarray(csa.reference_attention(*f32, mask=jnp.asarray(allowed)[None, None]))


def test_width_is_svgs_rule():
    """Wan 720p x 81 (21 x 3,600 tokens) at s = 0.3: 12,416 tokens (3.45 frames, the notes'
    figure); s = 1 keeps the whole sequence; out of range is refused."""
    assert svg.band_tokens(0.3, 21, 3600) == 12416
    assert svg.sparsity_to_width(1.0, 21, 3600) == pytest.approx(21.0)
    with pytest.raises(ValueError, match="sparsity: expected"):
        svg.sparsity_to_width(0.0, 21, 3600)


@pytest.mark.parametrize("window,anchor", [(0, 0), (40, 39), (129, 300), (1000, 10)])
@pytest.mark.parametrize("shape", [(391, 391, 128, 128, 0), (200, 391, 128, 256, 150)])
def test_closed_form_classes_equal_the_default(window, anchor, shape):
    """The closed form against the protocol's exhaustive default, an edge class counting
    as PARTIAL (the default knows no edges)."""
    q_len, kv_len, bq, bkv, offset = shape
    mask = svg.AnchoredBandMask(window, anchor)
    got = mask.block_classes(q_len, kv_len, bq, bkv, q_offset=offset)
    np.testing.assert_array_equal(
        np.where(got >= EDGE, PARTIAL, got),
        Mask.block_classes(mask, q_len, kv_len, bq, bkv, q_offset=offset))


def _edge_predicates(q, kv, w, a):
    """NumPy: the mask and its three edges (upper, lower, anchor), as the kernel's edge
    masks define them."""
    return ((np.abs(q - kv) <= w) | (kv < a),
            [kv - q <= w, q - kv <= w, np.broadcast_to(kv < a, (q.shape[0], kv.shape[1]))])


def test_edge_classes_are_exact():
    """Every tile the closed form classes ``EDGE + k`` has edge mask k's predicate equal
    to the mask's on each of its pairs (brute force over random tilings; every edge class
    occurs), and the edge masks are those predicates."""
    q, kv = np.arange(300)[:, None], np.arange(280)[None, :]
    mask = svg.AnchoredBandMask(70, 40)
    want, edges = _edge_predicates(q, kv, 70, 40)
    for edge, ref in zip(mask.edge_masks(), edges, strict=True):
        np.testing.assert_array_equal(np.broadcast_to(edge.tile_predicate(q, kv), ref.shape), ref)
    rng, seen = np.random.default_rng(0), set()
    for _ in range(150):
        q_len, kv_len, w, a = (int(x) for x in rng.integers([50, 50, 0, 0], [400, 400, 200, 150]))
        bq, bkv, off = (int(x) for x in rng.integers([1, 1, 0], [64, 64, 100]))
        classes = svg.AnchoredBandMask(w, a).block_classes(q_len, kv_len, bq, bkv, q_offset=off)
        q, kv = off + np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        want, edges = _edge_predicates(q, kv, w, a)
        # Each pair's tile class, then per edge class: its mask equals the mask there.
        per_pair = classes[np.arange(q_len)[:, None] // bq, np.arange(kv_len)[None, :] // bkv]
        for k, edge in enumerate(edges):
            where = per_pair == EDGE + k
            np.testing.assert_array_equal(edge[where], want[where])
            seen |= {EDGE + k} if where.any() else set()
    assert seen == {svg.UPPER_EDGE, svg.LOWER_EDGE, svg.ANCHOR_EDGE}


def test_visited_tiles_are_the_non_empty_tiles():
    """Band plus a far anchor: each q block visits exactly its non-empty kv blocks (not the
    range between), e.g. q block 6 visits [0, 5, 6, 7]."""
    n, bs = 1024, csa.BlockSizes(128, 128, 128)
    mask = svg.AnchoredBandMask(64, 128)
    info = build_mask_info(mask, n, n, bs)
    lay, row = info.layout, info.table[0]
    nq, steps = lay.num_q_blocks, lay.num_kv_steps
    count = row[1:1 + nq]
    visits = row[1 + nq:1 + nq + nq * steps].reshape(nq, steps)
    busy = Mask.block_classes(mask, n, n, 128, 128) != EMPTY
    for i in range(nq):
        want = np.flatnonzero(busy[i])
        assert count[i] == len(want)
        np.testing.assert_array_equal(visits[i, :count[i]], want)
    np.testing.assert_array_equal(visits[6], [0, 5, 6, 7])
    assert steps == 4 < n // 128  # the grid's kv axis: 4 steps, not 8


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pattern", ["spatial", "temporal"])
def test_kernel_equals_dense_reference(dtype, pattern):
    """Spatial: the mask on frame-major tokens. Temporal: q, k, v permuted to position-major
    in the graph, the same mask, the output permuted back. Anchor = frame_size keys."""
    q, k, v = _inputs(dtype, seed=3 if pattern == "spatial" else 4)
    mask = svg.AnchoredBandMask(50, P)
    options = csa.AttentionOptions(block_sizes=csa.BlockSizes(128, 128, 128), mask=mask)
    if pattern == "spatial":
        out = csa.splash_attention(q, k, v, options=options, interpret=True)
        allowed = _dense(F * P, 50, P)
    else:
        pm = [svg.to_position_major(x, F, P) for x in (q, k, v)]
        out = svg.to_frame_major(csa.splash_attention(*pm, options=options, interpret=True),
                                 F, P)
        allowed = _temporal_dense(50, P)
    out = np.asarray(jnp.asarray(out, jnp.float32))
    np.testing.assert_allclose(out, _reference(q, k, v, allowed), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernel_edge_branches_equal_dense_reference(dtype):
    """N = 643 (odd) at 128-blocks, band 150, anchor 100: the table has tiles of every edge
    class, the ragged last sub-tile is PARTIAL, and the kernel equals float32 attention."""
    n, bs = 643, csa.BlockSizes(128, 128, 128)
    mask = svg.AnchoredBandMask(150, 100)
    lay, row = (lambda i: (i.layout, i.table[0]))(build_mask_info(mask, n, n, bs))
    classes = row[1 + lay.num_q_blocks * (1 + lay.num_kv_steps):]
    assert {svg.UPPER_EDGE, svg.LOWER_EDGE, svg.ANCHOR_EDGE, PARTIAL} <= set(classes.tolist())
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 2, n, 64)), dtype) for _ in range(3))
    out = csa.splash_attention(q, k, v, options=csa.AttentionOptions(block_sizes=bs, mask=mask),
                               interpret=True)
    np.testing.assert_allclose(np.asarray(jnp.asarray(out, jnp.float32)),
                               _reference(q, k, v, _dense(n, 150, 100)), atol=TOL[dtype],
                               rtol=TOL[dtype])


def _svg_rule(q, k, v, rows, masks, p_dtype=np.float64):
    """NumPy port of SVG's sample_mse + argmin over [spatial, temporal] (float64; the
    scores and the probabilities rounded to ``p_dtype``, as SVG's bf16 run rounds its
    matmul and softmax outputs)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = q[:, :, rows] @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = s.astype(p_dtype).astype(np.float64)

    def attend(scores):
        e = np.exp(scores - scores.max(axis=-1, keepdims=True))
        return (e / e.sum(axis=-1, keepdims=True)).astype(p_dtype).astype(np.float64) @ v

    golden = attend(s)
    mses = [np.mean((attend(np.where(m[rows], s, -np.inf)) - golden) ** 2, axis=(2, 3))
            for m in masks]
    return np.argmin(np.stack(mses), axis=0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_routing_equals_svgs_rule_with_ties(dtype):
    """Head 0 attends by position (same position in every frame): temporal; head 1 by frame:
    spatial; heads 2-3 random; head 4 has zero values (every pattern's rows equal full
    attention's exactly: a tie) and picks spatial, as torch.argmin does; a window covering the whole
    sequence ties every head. bf16 inputs: the rule on the same bf16 values, scores and
    probabilities in bf16 (``route`` rounds them to the inputs' dtype, as SVG's sample_mse
    does in the model's)."""
    rng = np.random.default_rng(0)
    d, n = 16, F * P
    pos = np.tile(rng.standard_normal((P, d)), (F, 1)) * 3  # by position
    frm = np.repeat(rng.standard_normal((F, d)), P, axis=0) * 3  # by frame
    q = np.stack([pos, frm, *rng.standard_normal((2, n, d)), rng.standard_normal((n, d))])
    k = np.stack([pos, frm, *rng.standard_normal((2, n, d)), rng.standard_normal((n, d))])
    v = rng.standard_normal((5, n, d))
    v[4] = 0.0  # every pattern's rows are exactly full attention's (0): a tie
    q, k, v = (np.asarray(jnp.asarray(x[None], dtype).astype(jnp.float32)) for x in (q, k, v))
    rows = svg.sample_rows(n, 64, seed=1)
    p_dtype = np.float64 if dtype == jnp.float32 else jnp.bfloat16
    for window in (20, 10 * n):
        mask = svg.AnchoredBandMask(window, P)
        masks = (_dense(n, window, P), _temporal_dense(window, P))
        want = _svg_rule(q, k, v, rows, masks, p_dtype)
        got = np.asarray(svg.route(*(jnp.asarray(x, dtype) for x in (q, k, v)), rows, mask, F,
                                   P))
        np.testing.assert_array_equal(got, want)
        if window == 20:
            assert want[0, 0] == svg.TEMPORAL and want[0, 1] == svg.SPATIAL
            assert want[0, 4] == svg.SPATIAL  # the tie
        else:
            assert (want == svg.SPATIAL).all()


def test_orders_round_trip():
    x = jnp.arange(2 * F * P * 3).reshape(2, F * P, 3)
    pm = svg.to_position_major(x, F, P)
    np.testing.assert_array_equal(np.asarray(svg.to_frame_major(pm, F, P)), np.asarray(x))
    t = np.arange(F * P)
    np.testing.assert_array_equal(np.asarray(pm[0, :, 0]) // 3,
                                  t[np.argsort(svg.position_major_index(t, F, P))])


def test_chunk_gathers_equal_numpy_indexing():
    """``chunk_rows`` reads rows of (C, B, H, s, D) chunks by whole-sequence position and
    ``rows_to_chunks`` writes rows into that form, as NumPy fancy indexing says."""
    rng = np.random.default_rng(3)
    c, b, h, s, d = 3, 2, 4, 7, 5
    merged = rng.standard_normal((b, h, c * s, d)).astype(np.float32)
    chunks = np.moveaxis(merged.reshape(b, h, c, s, d), 2, 0)  # chunk c = rows [c s, (c+1) s)
    index = np.stack([rng.permutation(c * s) for _ in range(b * h)]).reshape(b, h, c * s)
    want = np.take_along_axis(merged, index[..., None], axis=2)
    got = np.asarray(svg.chunk_rows(jnp.asarray(chunks), jnp.asarray(index)))
    np.testing.assert_array_equal(got, want)
    back = np.asarray(svg.rows_to_chunks(jnp.asarray(merged), jnp.asarray(index), c))
    np.testing.assert_array_equal(np.moveaxis(back, 0, 2).reshape(b, h, c * s, d), want)


def test_sparse_attention_on_chunks_equals_merged():
    """Ulysses hands ``sparse_attention`` its received shards unmerged; the routing, both
    permutations and the result equal the call on the merged sequences (the kernel's
    padded-tail form: 3 chunks of 67 rows for N = 195)."""
    q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, 6), (0, 0))) for x in _inputs(jnp.float32, 7, 4))
    scope = svg.SparseScope(0.3, F, P, (0, 1))
    calls = []

    def attend(q, k, v, mask, valid_kv_len=None):
        calls.append((np.asarray(q), np.asarray(k), np.asarray(v), valid_kv_len))
        return q * 2.0 + k - v  # row-wise: the data movement is what is under test

    want = svg.sparse_attention(q, k, v, scope, attend)
    chunked = [jnp.moveaxis(x.reshape(1, 4, 3, 67, 64), 2, 0) for x in (q, k, v)]
    got = svg.sparse_attention(*chunked, scope, attend)
    assert got.shape == (3, 1, 4, 67, 64)
    np.testing.assert_array_equal(np.asarray(jnp.moveaxis(got, 0, 2).reshape(want.shape)),
                                  np.asarray(want))
    for a, b in zip(calls[0], calls[1], strict=True):
        np.testing.assert_array_equal(a, b)  # the same permuted rows reached the kernel
    assert calls[0][3] == F * P
