"""Sparse VideoGen (SVG 1) in kernel terms: its one mask, its two token orders, its width
rule and its per-head routing rule.

Source: svg-project/Sparse-VideoGen @ 5ce7b01 (read, not copied):
- ``svg/models/wan/utils.py`` ``generate_temporal_head_mask_mod``: the sparse path's one block
  mask, ``|q - kv| <= round_up_128(multiplier * frame_size)`` or ``kv < frame_size``, applied
  to every head on its own token order; ``sparsity_to_width``: the multiplier (in frames).
- ``svg/models/wan/placement.py`` ``ref_wan_sparse_head_placement``: spatial heads keep the
  frame-major order, temporal heads are reordered position-major (the (frame, position)
  grid transposed) before that mask and back after.
- ``svg/models/wan/attention.py`` ``sample_mse`` and ``attention_core_logic``: per (batch,
  head) the MSE, over the sampled query rows and the head dimension, between the rows under
  each pattern and the rows of full attention; ``torch.argmin`` over [spatial, temporal]
  (a tie picks spatial, the first). ``svg/models/wan/inference.py``: 64 rows.

So the anchor is the first ``frame_size`` keys of the head's own order: frame 0 for a spatial
head; for a temporal head (position-major) the first ``frame_size / num_frames`` positions of
every frame. That is what SVG's sparse kernel runs, and what this module reproduces.

The temporal order is a permutation in the graph (``to_position_major``). One kernel call
can run both patterns: ``HeadMasks((spatial, temporal))`` with ``route``'s (batch, heads)
index as the call's ``mask_index`` (``SPATIAL`` = 0, ``TEMPORAL`` = 1), the temporal heads'
q, k, v permuted position-major in the graph first.

In the model graph (``--sparse svg``): ``sparse_scope(SparseScope(...))`` declares, while a
step program is traced, that its self-attention calls are sparse; the SDPA override then
runs ``sparse_attention`` (route, permute the temporal heads position-major with one row
gather per tensor, one single-mask kernel call with ``svg_mask``, permute back; under Ulysses
on the all-to-all's unmerged shards, ``chunk_rows`` / ``rows_to_chunks``), and a
scanned block stack splits its scan at ``SparseScope.layers`` (``layer_segments``), the
layers outside running dense.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from splash.kernel import softmax_scale
from splash.mask import EDGE, EMPTY, FULL, PARTIAL, Mask

# SVG's sparse mask rounds its band half-width up to this many tokens (its flex block).
WIDTH_ROUND = 128
# Query rows SVG samples per head to route (``inference.py``: num_sampled_rows=64).
NUM_SAMPLED_ROWS = 64
SPATIAL, TEMPORAL = 0, 1


def sparsity_to_width(sparsity: float, num_frames: int, frame_size: int,
                      context_length: int = 0) -> float:
    """SVG's band half-width in frames for ``sparsity`` (the fraction of scores kept, in
    (0, 1]): w = N (1 - sqrt(1 - s')) / frame_size with N the sequence length and s' the
    fraction left after the text context's rows and columns (none for Wan: 0).

    Raises:
        ValueError: ``sparsity`` outside (0, 1].
    """
    if not 0.0 < sparsity <= 1.0:
        raise ValueError(f"sparsity: expected a fraction in (0, 1], got {sparsity!r}")
    n = context_length + num_frames * frame_size
    kept = (sparsity * n * n - 2 * n * context_length) / (n * n)
    return n * (1 - math.sqrt(1 - kept)) / frame_size


def band_tokens(sparsity: float, num_frames: int, frame_size: int) -> int:
    """The mask's ``window``: ``sparsity_to_width`` frames in tokens, rounded up to 128 as
    SVG's ``temporal_mask_mod`` does."""
    width = sparsity_to_width(sparsity, num_frames, frame_size) * frame_size
    return int(math.ceil(width / WIDTH_ROUND) * WIDTH_ROUND)


@dataclasses.dataclass(frozen=True)
class KeysWithin(Mask):
    """Query ``i`` attends key ``j`` iff ``j - i <= window``: a band's upper edge alone
    (``AnchoredBandMask``'s edge mask 0)."""

    window: int

    def tile_predicate(self, q_pos, kv_pos):
        return kv_pos - q_pos <= self.window


@dataclasses.dataclass(frozen=True)
class KeysFrom(Mask):
    """Query ``i`` attends key ``j`` iff ``i - j <= window``: a band's lower edge alone
    (``AnchoredBandMask``'s edge mask 1)."""

    window: int

    def tile_predicate(self, q_pos, kv_pos):
        return q_pos - kv_pos <= self.window


@dataclasses.dataclass(frozen=True)
class KeysBefore(Mask):
    """Query ``i`` attends key ``j`` iff ``j < anchor``: the anchor alone
    (``AnchoredBandMask``'s edge mask 2)."""

    anchor: int

    def tile_predicate(self, q_pos, kv_pos):
        return kv_pos < self.anchor


# AnchoredBandMask's edge classes (splash.mask.EDGE + k, k as in ``edge_masks``).
UPPER_EDGE, LOWER_EDGE, ANCHOR_EDGE = EDGE, EDGE + 1, EDGE + 2


@dataclasses.dataclass(frozen=True)
class AnchoredBandMask(Mask):
    """Query ``i`` attends key ``j`` iff ``|i - j| <= window`` or ``j < anchor`` (positions
    in the call's token order). SVG's mask with ``anchor`` = frame_size.

    Raises:
        ValueError: ``window`` or ``anchor`` is not an int >= 0.
    """

    window: int
    anchor: int

    def __post_init__(self):
        for name in ("window", "anchor"):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {x!r}")
            object.__setattr__(self, name, int(x))

    def tile_predicate(self, q_pos, kv_pos):
        return (jnp.abs(q_pos - kv_pos) <= self.window) | (kv_pos < self.anchor)

    def block_classes(self, q_len: int, kv_len: int, block_q: int, block_kv: int, *,
                      q_offset: int = 0) -> np.ndarray:
        w, a = self.window, self.anchor
        q_lo = q_offset + np.arange(0, q_len, block_q, dtype=np.int64)[:, None]
        q_hi = np.minimum(q_lo + block_q, q_offset + q_len) - 1
        kv_lo = np.arange(0, kv_len, block_kv, dtype=np.int64)[None, :]
        kv_hi = np.minimum(kv_lo + block_kv, kv_len) - 1
        band_empty = band_empty_from(kv_lo, kv_hi, q_lo, q_hi, w)
        empty = band_empty & (kv_lo >= a)
        # Full: the keys at or past the anchor (if any) are all inside every row's band.
        rest_lo = np.maximum(kv_lo, a)
        full = (rest_lo > kv_hi) | (np.maximum(q_hi - rest_lo, kv_hi - q_lo) <= w)
        # One boundary crosses a partly covered tile: with no anchor key in it, the band's
        # upper edge alone (every pair within the lower one) or its lower edge alone; with
        # anchor keys, the anchor alone when no key past it is in any row's band.
        no_anchor = kv_lo >= a
        upper = no_anchor & (q_hi - kv_lo <= w)
        lower = no_anchor & (kv_hi - q_lo <= w)
        anchor = ~no_anchor & band_empty_from(rest_lo, kv_hi, q_lo, q_hi, w)
        part = np.select([upper, lower, anchor], [UPPER_EDGE, LOWER_EDGE, ANCHOR_EDGE],
                         PARTIAL)
        return np.where(empty, EMPTY, np.where(full, FULL, part)).astype(np.int8)

    def edge_masks(self) -> tuple:
        return (KeysWithin(self.window), KeysFrom(self.window), KeysBefore(self.anchor))


def band_empty_from(k_lo, k_hi, q_lo, q_hi, w):
    """True where no key of [k_lo, k_hi] is within ``w`` of any query of [q_lo, q_hi]
    (NumPy, broadcast)."""
    return (k_lo > q_hi + w) | (k_hi < q_lo - w)


def svg_mask(sparsity: float, num_frames: int, frame_size: int) -> AnchoredBandMask:
    """SVG's mask for one video: the band of ``band_tokens`` and the first frame_size keys."""
    return AnchoredBandMask(band_tokens(sparsity, num_frames, frame_size), frame_size)


def to_position_major(x, num_frames: int, frame_size: int):
    """(..., F * P, D) frame-major tokens -> position-major ((P, F) order); any array type."""
    lead, d = x.shape[:-2], x.shape[-1]
    y = x.reshape(*lead, num_frames, frame_size, d)
    return jnp.swapaxes(y, -3, -2).reshape(*lead, num_frames * frame_size, d)


def to_frame_major(x, num_frames: int, frame_size: int):
    """The inverse of ``to_position_major``."""
    lead, d = x.shape[:-2], x.shape[-1]
    y = x.reshape(*lead, frame_size, num_frames, d)
    return jnp.swapaxes(y, -3, -2).reshape(*lead, num_frames * frame_size, d)


def position_major_index(t, num_frames: int, frame_size: int):
    """Frame-major token index ``t`` -> its index in the position-major order."""
    return (t % frame_size) * num_frames + t // frame_size


def sample_rows(seq_len: int, count: int = NUM_SAMPLED_ROWS, seed: int = 0) -> np.ndarray:
    """``count`` query rows in [0, seq_len), drawn once on the host (SVG draws
    ``torch.randint`` rows per call; a fixed draw keeps the compiled step static)."""
    rng = np.random.default_rng(seed)
    return np.sort(rng.integers(0, seq_len, size=min(count, seq_len))).astype(np.int32)


def as_chunks(x) -> jax.Array:
    """``x`` as (C, batch, heads, N'/C, head_dim) sequence chunks, chunk outermost: a 5-D
    ``x`` as it is (Ulysses' received shards, unmerged), a 4-D one as its one chunk."""
    return x if x.ndim == 5 else x[None]


def chunk_rows(x, index) -> jax.Array:
    """Rows of chunked ``x`` (C, B, H, s, D) at ``index`` (B, H, M), positions in the whole
    sequence (chunk c holds [c s, (c + 1) s)): (B, H, M, D), one gather reading the chunks
    where they lie (no merge copy first: 0.24 ms per tensor per Wan 14B 720p layer on v6e,
    estimated). In bounds by construction, promised: XLA otherwise adds a select (0.7 ms of
    copies per such layer)."""
    s = x.shape[3]
    at = jnp.stack([index // s, index % s], axis=-1)  # (B, H, M, 2): (chunk, row)
    dims = jax.lax.GatherDimensionNumbers(
        offset_dims=(3,), collapsed_slice_dims=(0, 3), start_index_map=(0, 3),
        operand_batching_dims=(1, 2), start_indices_batching_dims=(0, 1))
    return jax.lax.gather(x, at, dims, (1, 1, 1, 1, x.shape[4]),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def rows_to_chunks(x, index, chunks: int) -> jax.Array:
    """(C, B, H, N'/C, D) chunks of ``x`` (B, H, N', D) reordered: chunk c's row j is
    ``x[b, h, index[b, h, c N'/C + j]]``. One gather written in the layout Ulysses' return
    all-to-all sends (no transposing copy after it)."""
    b, h, n, _ = x.shape
    at = jnp.moveaxis(index.reshape(b, h, chunks, n // chunks), 2, 0)[..., None]
    dims = jax.lax.GatherDimensionNumbers(
        offset_dims=(4,), collapsed_slice_dims=(2,), start_index_map=(2,),
        operand_batching_dims=(0, 1), start_indices_batching_dims=(1, 2))
    return jax.lax.gather(x, at, dims, (1, 1, 1, x.shape[3]),
                          mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def route(q, k, v, rows, mask: AnchoredBandMask, num_frames: int, frame_size: int,
          scale: float | None = None) -> jax.Array:
    """SVG's per-head pattern choice on the sampled ``rows`` (frame-major positions).

    Args:
        q, k, v: (batch, heads, N', head_dim), or the same as (C, batch, heads, N'/C,
            head_dim) chunks (``as_chunks``), frame-major, the first N = num_frames *
            frame_size tokens real (rows past them, sequence parallelism's padding, are
            left out as keys).
        rows: int32 (R,) query rows, < N.
        mask: the mask both patterns apply, each on its own token order.
        scale: softmax scale (default head_dim ** -0.5).

    Returns:
        int32 (batch, heads): ``SPATIAL`` (0) or ``TEMPORAL`` (1), the lower MSE to full
        attention over the rows and head_dim; a tie picks ``SPATIAL``.
    """
    q, k, v = (as_chunks(x) for x in (q, k, v))
    chunks, s_len = k.shape[0], k.shape[3]
    scale = softmax_scale(q.shape[-1], scale)
    f32, n = jnp.float32, num_frames * frame_size
    rows = np.asarray(rows, np.int32)
    q_rows = chunk_rows(q, jnp.broadcast_to(rows, q.shape[1:3] + rows.shape))  # (B, H, R, D)
    # SVG's sample_mse works in the model's dtype (bf16 on its GPUs): scores q k^T / sqrt(d)
    # in bf16, softmax in bf16 (float32 inside), then p @ v. So do we: scores accumulated in
    # float32 and rounded once to q's dtype (float32 runs stay float32 at HIGHEST), which
    # halves the bytes the three softmaxes read (64 rows x 75,648 keys x 10 heads per Wan 14B
    # 720p device: 97 MB in bf16). Keys as (chunk, row) free dims of one dot: k and v are
    # read where they lie (a dot per chunk, or merging them first, cost 0.6-3 ms more per
    # such layer on v6e in a deviceless compile of the routing alone).
    s = jnp.einsum("bhrd,cbhkd->bhrck", q_rows, k, preferred_element_type=f32,
                   precision=jax.lax.Precision.HIGHEST)
    s = (s.reshape(*s.shape[:3], chunks * s_len) * scale).astype(q.dtype)  # (B, H, R, N')
    kv = jnp.arange(chunks * s_len, dtype=jnp.int32)[None, :]
    r = jnp.asarray(rows)[:, None]
    pm = lambda t: position_major_index(t, num_frames, frame_size)  # noqa: E731
    real = kv < n
    allowed = (real, mask.tile_predicate(r, kv) & real, mask.tile_predicate(pm(r), pm(kv)) & real)
    # Probabilities in v's dtype. The three patterns' rows are stacked into one dot, so v is
    # read once (the estimate had three float32 p @ v dots over a float32 copy of v: 0.95 ms
    # per Wan 14B 720p layer on v6e).
    p = jnp.concatenate([jax.nn.softmax(jnp.where(ok, s.astype(f32), -jnp.inf), axis=-1)
                         .astype(v.dtype) for ok in allowed], axis=2)  # (batch, heads, 3 R, N')
    exact = jax.lax.Precision.HIGHEST if v.dtype == f32 else jax.lax.Precision.DEFAULT
    out = jnp.einsum("bhrck,cbhkd->bhrd", p.reshape(*p.shape[:3], chunks, s_len), v,
                     preferred_element_type=f32, precision=exact)
    golden, spatial, temporal = jnp.split(out, 3, axis=2)
    mse = jnp.stack([jnp.mean((o - golden) ** 2, axis=(2, 3)) for o in (spatial, temporal)])
    return jnp.argmin(mse, axis=0).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class SparseScope:
    """What a traced step's self-attention runs sparse: SVG with ``sparsity`` (in (0, 1]) on
    a video of ``num_frames`` x ``frame_size`` tokens (post-patch frames and tokens per
    frame), in layers [``layers[0]``, ``layers[1]``) of the block stack (the rest dense);
    ``block_sizes``: the band calls' (block_q, block_kv, block_kv_compute), None for the
    dense calls' (``splash.blocks.SPARSE_BLOCK_SIZES`` says why they differ)."""

    sparsity: float
    num_frames: int
    frame_size: int
    layers: tuple[int, int]
    block_sizes: tuple[int, int, int] | None = None

    @property
    def mask(self) -> AnchoredBandMask:
        return svg_mask(self.sparsity, self.num_frames, self.frame_size)


_SCOPE: contextvars.ContextVar[SparseScope | None] = contextvars.ContextVar(
    "svg_sparse_scope", default=None)


@contextlib.contextmanager
def sparse_scope(scope: SparseScope | None):
    """Declare, for the code traced inside, that self-attention is SVG-sparse as ``scope``
    says (``None``: dense). Trace-time state, as ``splash.sdpa``'s declarations."""
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def active_scope() -> SparseScope | None:
    """The ``sparse_scope`` in force for the code being traced, else None."""
    return _SCOPE.get()


def layer_segments(start: int, stop: int) -> list[tuple[int, int, SparseScope | None]]:
    """Layers [start, stop) split into runs of one kind: [(a, b, scope or None)], in order;
    one run with the active scope (or None) when no scope is active or it covers them all."""
    scope = active_scope()
    if scope is None:
        return [(start, stop, None)]
    lo, hi = max(start, scope.layers[0]), min(stop, scope.layers[1])
    if lo >= hi:
        return [(start, stop, None)]
    runs = [(start, lo, None), (lo, hi, scope), (hi, stop, None)]
    return [r for r in runs if r[0] < r[1]]


def sparse_attention(q, k, v, scope: SparseScope, attend, scale: float | None = None,
                     q_scale: float | None = None):
    """SVG's sparse self-attention of one call.

    Args:
        q, k, v: (batch, heads, N', head_dim), frame-major video tokens: the first N =
            num_frames * frame_size real, any rows after them padding (sequence
            parallelism's), never attended; no text tokens. Or the same sequences as
            (C, batch, heads, N'/C, head_dim) chunks, chunk outermost (``as_chunks``: what
            Ulysses' all-to-all receives, C = sp), read where they lie.
        scope: the sparsity and token grid.
        attend: ``(q, k, v, mask, valid_kv_len) -> out`` (batch, heads, N', head_dim): one
            kernel call with ``mask`` for every head and the keys from ``valid_kv_len`` on
            left out (None: every key).
        scale: softmax scale (default head_dim ** -0.5).
        q_scale: None, or the factor q already carries (the kernel's ``fold_scale``,
            scale * log2(e), applied where it fuses: before Ulysses' all-to-all): the
            routing divides it out of its scores and ``attend`` is called with
            ``q_scaled=True``, so the kernel makes no pass of its own over the permuted q.

    Returns:
        In q's form ((batch, heads, N', head_dim), or chunks as q's) and dtype, frame-major;
        padded rows hold the kernel's output for them (finite, read by no real token).

    Raises:
        ValueError: N' < num_frames * frame_size, or k's length differs from q's.
    """
    f, p = scope.num_frames, scope.frame_size
    chunked = q.ndim == 5
    q, k, v = (as_chunks(x) for x in (q, k, v))
    chunks, n, n_pad = q.shape[0], f * p, q.shape[0] * q.shape[3]
    if n_pad < n or k.shape != q.shape:
        raise ValueError(f"sparse attention: expected at least {f} x {p} = {n} tokens in q and"
                         f" as many in k, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    mask = scope.mask
    which = route(q, k, v, sample_rows(n), mask, f, p,
                  softmax_scale(q.shape[-1], scale) / (q_scale or 1.0))
    temporal = (which == TEMPORAL)[:, :, None]  # (batch, heads, 1)
    # One row gather per tensor, the row order chosen per head: the estimate charged the
    # jnp.where over both orders (two transposes and a select per tensor) 10.3 ms of copies
    # per Wan 14B 720p layer on v6e against 1.9 ms for a gather (benchmarks/svg_results.md).
    # Padded rows stay in place (identity past n): slicing them off and padding back cost
    # 1.9 ms of copies per layer there.
    t = np.arange(n_pad)
    pm_order = np.where(t < n, (t % f) * p + t // f, t)
    fm_order = np.where(t < n, position_major_index(t, f, p), t)
    to_pm = jnp.where(temporal, jnp.asarray(pm_order, jnp.int32), t)
    to_fm = jnp.where(temporal, jnp.asarray(fm_order, jnp.int32), t)
    kw = {} if q_scale is None else dict(q_scaled=True)
    out = attend(chunk_rows(q, to_pm), chunk_rows(k, to_pm), chunk_rows(v, to_pm), mask,
                 None if n_pad == n else n, **kw)
    out = rows_to_chunks(out, to_fm, chunks)
    return out if chunked else out[0]
