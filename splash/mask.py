"""Masks: which keys a query may attend, as frozen values the kernel reads through one
protocol (``Mask``), and segment ids (a data mask: per-token ids).

A mask answers two questions, both in global token positions (queries and keys of the
unpadded sequences; a q shard's rows are offset by the shard's start):

* ``tile_predicate(q_pos, kv_pos)``: elementwise, may query ``q_pos`` attend key ``kv_pos``?
  The kernel calls it on the score tiles the mask only partly covers; the reference paths
  call it on the whole (q_len, kv_len) grid (``dense``).
* ``block_classes(q_len, kv_len, block_q, block_kv, q_offset=0)``: for every (q block,
  kv block) of a tiling, ``EMPTY`` (no pair attends), ``FULL`` (every pair attends) or
  ``PARTIAL``. The default evaluates ``tile_predicate`` on each q block's rows (exact, O(q_len
  x kv_len) host work once per trace); a mask with a closed form overrides it.
* optionally ``edge_masks()``: cheaper masks for the partly covered tiles that only one of
  the mask's boundaries crosses (a band's upper or lower edge, an anchor's); such a tile's
  class is ``EDGE + k`` and the kernel runs ``edge_masks()[k].tile_predicate`` there. A
  masked tile costs ~2.4x an unmasked one on v6e (libtpu's static profile, issue 53), most
  of it the predicate's elementwise work, so one compare instead of five matters.

``splash.mask_info`` turns the classes into the kernel's scalar-prefetched tables. A new mask
is one frozen dataclass subclassing ``Mask`` that implements ``tile_predicate`` (and, for
long sequences, ``block_classes``): no kernel edit.

Per-head masks: ``HeadMasks`` is a small static tuple of masks, and a call's ``mask_index``
(int32 (batch, heads), data) picks one per (batch, head); the kernel stacks each mask's
tables and reads the row the index names, so a new index never recompiles.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# Block classes (``Mask.block_classes``): int8 codes, also the kernel's tile classes.
EMPTY, PARTIAL, FULL = 0, 1, 2
# ``EDGE + k``: a partly covered tile on which the mask's k-th edge mask
# (``Mask.edge_masks()[k]``, a cheaper predicate) equals the mask, with no key past kv_len.
EDGE = 3
# The most edge masks a mask may have: each adds one branch per sub-tile to the kernel.
MAX_EDGES = 4
# The segment id of real tokens where the SDPA override builds ids from a key-padding mask
# (padding: 0). ``real_keys_before`` promises that keys before it carry this id.
REAL_SEGMENT_ID = 1


@dataclasses.dataclass(frozen=True)
class Mask:
    """Base of the kernel's static masks: a frozen, hashable value (it ends up a static
    argument of the kernel), the same for every batch row and head.

    Subclasses implement ``tile_predicate``; ``block_classes`` and ``dense`` derive from it.
    """

    def tile_predicate(self, q_pos, kv_pos):
        """Elementwise: True where query position ``q_pos`` attends key position ``kv_pos``.

        Args:
            q_pos, kv_pos: int32 arrays of one shape (jax arrays inside the kernel, where the
                shape is the transposed score tile (block_kv_compute, block_q); NumPy arrays
                from ``block_classes``). Global positions.

        Returns:
            bool array of that shape. Use elementwise ``jnp`` ops only: the body runs inside
            the Pallas kernel.
        """
        raise NotImplementedError(f"{type(self).__name__}.tile_predicate")

    def block_classes(self, q_len: int, kv_len: int, block_q: int, block_kv: int, *,
                      q_offset: int = 0) -> np.ndarray:
        """(ceil(q_len / block_q), ceil(kv_len / block_kv)) int8 of ``EMPTY``/``PARTIAL``/
        ``FULL``, over the real positions only: queries ``q_offset + [0, q_len)``, keys
        ``[0, kv_len)`` (a ragged last block is classed by its real part).

        The default evaluates ``tile_predicate`` on every pair, one q block at a time."""
        num_kv = -(-kv_len // block_kv)
        out = np.empty((-(-q_len // block_q), num_kv), np.int8)
        kv_pos = np.arange(kv_len, dtype=np.int32)[None, :]
        pad = num_kv * block_kv - kv_len
        for i in range(out.shape[0]):
            rows = q_offset + np.arange(i * block_q, min((i + 1) * block_q, q_len),
                                        dtype=np.int32)
            ok = np.asarray(self.tile_predicate(rows[:, None], kv_pos), bool)
            ok = np.broadcast_to(ok, (rows.size, kv_len))
            # Pad the ragged tail with copies of the last key's column: a class is about
            # real keys only, and copies change neither "any" nor "all".
            ok = np.concatenate([ok, np.repeat(ok[:, -1:], pad, axis=1)], axis=1)
            ok = ok.reshape(rows.size, num_kv, block_kv)
            out[i] = np.where(ok.all(axis=(0, 2)), FULL,
                              np.where(ok.any(axis=(0, 2)), PARTIAL, EMPTY))
        return out

    def edge_masks(self) -> tuple:
        """Masks that ``block_classes`` may name by class ``EDGE + k`` (at most
        ``MAX_EDGES``): on every pair of a tile of class ``EDGE + k``, ``edge_masks()[k]``'s
        ``tile_predicate`` equals this mask's. Default: none (every partly covered tile is
        ``PARTIAL``)."""
        return ()

    def dense(self, q_len: int, kv_len: int) -> jax.Array:
        """(q_len, kv_len) bool: True where query i attends key j (the XLA and reference
        paths)."""
        i = jnp.arange(q_len, dtype=jnp.int32)[:, None]
        j = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
        return jnp.broadcast_to(self.tile_predicate(i, j), (q_len, kv_len))


@dataclasses.dataclass(frozen=True)
class LocalMask(Mask):
    """Local self-attention: query position ``i`` attends key position ``j`` iff
    ``|i - j| <= window_size`` (symmetric; positions in the unpadded q and kv sequences).

    As in JAX's splash kernel (``LocalMask``), a mask is a value, the same for every head.
    Its block classes have a closed form (a band), so long sequences cost O(blocks).

    Raises:
        ValueError: ``window_size`` is not an int >= 0.
    """

    window_size: int

    def __post_init__(self):
        w = self.window_size
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
            raise ValueError(f"window_size: expected None or an int >= 0, got {w!r}")
        object.__setattr__(self, "window_size", int(w))

    def tile_predicate(self, q_pos, kv_pos):
        return jnp.abs(q_pos - kv_pos) <= self.window_size

    def block_classes(self, q_len: int, kv_len: int, block_q: int, block_kv: int, *,
                      q_offset: int = 0) -> np.ndarray:
        w = self.window_size
        q_lo = q_offset + np.arange(0, q_len, block_q, dtype=np.int64)[:, None]
        q_hi = np.minimum(q_lo + block_q, q_offset + q_len) - 1
        kv_lo = np.arange(0, kv_len, block_kv, dtype=np.int64)[None, :]
        kv_hi = np.minimum(kv_lo + block_kv, kv_len) - 1
        # A band meets the box [q_lo, q_hi] x [kv_lo, kv_hi] iff the key interval meets
        # [q_lo - w, q_hi + w]; it covers the box iff the box's farthest corners are in.
        empty = (kv_lo > q_hi + w) | (kv_hi < q_lo - w)
        full = np.maximum(q_hi - kv_lo, kv_hi - q_lo) <= w
        return np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)


# The most masks one ``HeadMasks`` carries: each adds one table row to SMEM and one branch
# per sub-tile to the kernel body, so the set stays small.
MAX_HEAD_MASKS = 8


@dataclasses.dataclass(frozen=True)
class HeadMasks:
    """A static set of masks of which each (batch, head) of a call picks one.

    The choice is the call's ``mask_index``: an int32 (batch, heads) array, data (it is
    scalar-prefetched like the masks' tables), so changing it never recompiles. Each mask
    is any ``Mask`` in the call's own token order (e.g. SVG's spatial and temporal
    ``AnchoredBandMask``; the temporal heads' q, k and v permuted position-major by the
    caller). A frozen, hashable value: it goes in ``AttentionOptions.mask``.

    Attributes:
        masks: a tuple of 1 to ``MAX_HEAD_MASKS`` ``Mask`` values; index ``m`` of
            ``mask_index`` means ``masks[m]``.

    Raises:
        ValueError: ``masks`` is not a tuple or list of 1 to ``MAX_HEAD_MASKS`` ``Mask``
            values.
    """

    masks: tuple

    def __post_init__(self):
        masks = self.masks
        if not isinstance(masks, (tuple, list)) or not 1 <= len(masks) <= MAX_HEAD_MASKS \
                or not all(isinstance(m, Mask) for m in masks):
            raise ValueError(f"HeadMasks.masks: expected a tuple of 1 to {MAX_HEAD_MASKS} Mask "
                             f"values, got {masks!r}")
        object.__setattr__(self, "masks", tuple(masks))

    def __len__(self) -> int:
        return len(self.masks)

    def dense(self, q_len: int, kv_len: int, mask_index) -> jax.Array:
        """(batch, heads, q_len, kv_len) bool: mask ``mask_index[b, h]``'s dense form for
        each (batch, head) (the reference paths). ``mask_index``: int (batch, heads),
        values in [0, len(masks)) (clipped, as in the kernel)."""
        stack = jnp.stack([m.dense(q_len, kv_len) for m in self.masks])
        index = jnp.clip(jnp.asarray(mask_index, jnp.int32), 0, len(self.masks) - 1)
        return stack[index]


def check_mask_index(mask, mask_index, batch: int, heads: int) -> jax.Array | None:
    """``mask_index`` as int32 (batch, heads) with values clipped to [0, len(mask)), or None
    without ``HeadMasks``: the kernel reads table rows by it, so it never leaves them.

    Args:
        mask: the call's ``AttentionOptions.mask`` (None, a ``Mask`` or ``HeadMasks``).
        mask_index: None, or an integer array (batch, heads).
        batch, heads: the shape ``mask_index`` must have.

    Raises:
        ValueError: ``HeadMasks`` without a ``mask_index`` or with one of another shape or
            a non-integer dtype, or a ``mask_index`` without ``HeadMasks``.
    """
    if not isinstance(mask, HeadMasks):
        if mask_index is not None:
            raise ValueError(f"mask_index: expected None without HeadMasks in options.mask, "
                             f"got an array of shape {jnp.shape(mask_index)}")
        return None
    if mask_index is None:
        raise ValueError(f"mask_index: expected an int32 array of shape {(batch, heads)} with "
                         "HeadMasks in options.mask, got None")
    shape, dtype = jnp.shape(mask_index), jnp.result_type(mask_index)
    if shape != (batch, heads) or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"mask_index: expected an int32 array of shape {(batch, heads)}, got "
                         f"{jnp.dtype(dtype).name} {shape}")
    return jnp.clip(jnp.asarray(mask_index, jnp.int32), 0, len(mask) - 1)


def band_mask(q_len: int, kv_len: int, window_size: int) -> jax.Array:
    """(q_len, kv_len) bool: ``|i - j| <= window_size``, ``LocalMask``'s dense form."""
    return LocalMask(window_size).dense(q_len, kv_len)


class SegmentIds(NamedTuple):
    """Segment ids: a query attends only to keys with the same id.

    Attributes:
        q: int32 (batch, q_len).
        kv: int32 (batch, kv_len).
    """

    q: jax.Array
    kv: jax.Array


def as_segment_ids(segment_ids) -> SegmentIds | None:
    """``None``, or ``segment_ids`` (a ``SegmentIds`` or a pair (q_ids, kv_ids)) as int32
    ``SegmentIds``.

    Raises:
        ValueError: not a pair.
    """
    if segment_ids is None:
        return None
    if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
        raise ValueError(f"segment_ids: expected a pair (q_ids, kv_ids), got {segment_ids!r}")
    return SegmentIds(
        jnp.asarray(segment_ids[0], jnp.int32), jnp.asarray(segment_ids[1], jnp.int32)
    )
