"""Trace-time state of the torch SDPA adapter: which scopes force a backend, which keys are
padding (sequence parallelism's declared token padding, a key-padding ``attn_mask``), and
what the family promises about where padding can be (``real_keys_before``). All of it is
``ContextVar`` state, set and reset around the traced code, never inside the compiled
program. The router itself (``install_sdpa_override``) is in ``custom_splash_attention``.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import jax.numpy as jnp

from splash.mask import SegmentIds
from splash.options import ATTENTION_BACKENDS

# Backend forced for a scope (``forced_attention``): the Wan VAE's attention always takes XLA.
_FORCED_ATTENTION: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "forced_attention", default=None
)


@contextlib.contextmanager
def forced_attention(attention: str):
    """Route every SDPA call traced inside this block to ``attention``, whatever
    ``install_sdpa_override`` chose.

    The Wan VAE's mid-block attention is batch 1, one head, head_dim 384, float32: nothing
    a flash kernel helps with (one tiny head), and a shape our Mosaic kernel was never tuned
    or tested for. Its programs are traced under ``forced_attention("xla")``.
    """
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention: expected one of {ATTENTION_BACKENDS}, got {attention!r}")
    token = _FORCED_ATTENTION.set(attention)
    try:
        yield
    finally:
        _FORCED_ATTENTION.reset(token)


def forced_backend() -> str | None:
    """The backend ``forced_attention`` set for the code being traced, else None."""
    return _FORCED_ATTENTION.get()


class KeyPadding(NamedTuple):
    """Self-attention keys at positions >= ``valid_len`` of a ``padded_len`` sequence are
    padding (``pad_self_attention_keys``)."""

    padded_len: int
    valid_len: int


_KEY_PADDING: contextvars.ContextVar[KeyPadding | None] = contextvars.ContextVar(
    "key_padding", default=None
)
IN_SELF_ATTENTION: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "in_self_attention", default=False
)


_REAL_KEYS_BEFORE: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "real_keys_before", default=None
)


@contextlib.contextmanager
def real_keys_before(position: int):
    """Declare, for the SDPA calls traced inside, that a key-padding ``attn_mask`` can only
    mask keys at positions >= ``position`` (a static fact of the family's token layout,
    e.g. HunyuanVideo-1.5's joint attention: [video tokens, text tokens], padding only in
    the text). The Splash kernel then skips the segment-id compare in kv blocks wholly
    before it (``splash_attention(real_keys_before=...)``). A mask that breaks the promise
    gives wrong results; nothing checks it at run time."""
    token = _REAL_KEYS_BEFORE.set(int(position))
    try:
        yield
    finally:
        _REAL_KEYS_BEFORE.reset(token)


def pad_self_attention_keys(padded_len: int, valid_len: int) -> contextvars.Token:
    """Declare, until ``unpad_self_attention_keys(token)``, that the token axis of the
    sequences being traced was zero-padded from ``valid_len`` to ``padded_len``.

    Self-attention calls (inside a module ``mark_self_attention`` marked) whose key length
    is ``padded_len`` then give real tokens segment id 1 and padding id 0: the kernels mask
    the padded keys exactly (never zero keys left in the softmax denominator), and padded
    query rows attend only padding, so they stay finite. Used by sequence parallelism to run
    token counts the "sp" axis does not divide. Trace-time state: set and reset around the
    traced blocks, not inside the compiled program.
    """
    return _KEY_PADDING.set(KeyPadding(padded_len, valid_len))


def declared_key_padding() -> KeyPadding | None:
    """The ``pad_self_attention_keys`` declaration in force, else None."""
    return _KEY_PADDING.get()


def unpad_self_attention_keys(token: contextvars.Token) -> None:
    """End the ``pad_self_attention_keys`` declaration that returned ``token``."""
    _KEY_PADDING.reset(token)


def mark_self_attention(module) -> list:
    """Hooks that flag SDPA calls traced inside ``module`` as self-attention (keys are the
    video tokens themselves), for ``pad_self_attention_keys``. Returns the hook handles.

    The flag is reset even when ``module``'s forward raises (``always_call``, torch >= 2.1):
    a raise mid-trace must not leave later traces' attentions flagged."""
    tokens = []

    def enter(_module, _args):
        tokens.append(IN_SELF_ATTENTION.set(True))

    def leave(_module, _args, _output):
        # On a raise torch calls this too (output None); an earlier pre-hook's raise means
        # ``enter`` never ran, and there is nothing to reset.
        if tokens:
            IN_SELF_ATTENTION.reset(tokens.pop())

    return [module.register_forward_pre_hook(enter),
            module.register_forward_hook(leave, always_call=True)]


def key_padding_mask(mask, q, k):
    """The (batch, kv_len) bool of real keys when ``mask`` is a boolean key-padding mask,
    else None.

    A key-padding mask is a boolean SDPA ``attn_mask`` of shape (batch or 1, 1 or heads, 1,
    kv_len): one row of allowed keys broadcast over every query, as diffusers'
    ``Attention.prepare_attention_mask`` leaves a (batch, 1, 1, kv_len) mask (repeated over
    heads) and as the HunyuanVideo-1.5 family passes its text padding. Such a mask must be
    the same for every head; the heads are combined with AND.
    """
    batch, heads, _, _ = q.shape
    kv_len = k.shape[2]
    if (mask is None or mask.dtype != jnp.bool_ or mask.ndim != 4 or mask.shape[2] != 1
            or mask.shape[3] != kv_len or mask.shape[0] not in (1, batch)
            or mask.shape[1] not in (1, heads)):
        return None
    return jnp.broadcast_to(jnp.all(mask[:, :, 0, :], axis=1), (batch, kv_len))


def active_padding(k) -> KeyPadding | None:
    """The ``pad_self_attention_keys`` declaration that applies to this call (a self-attention
    call whose keys hold the padded tokens, with some padding), else None."""
    pad = _KEY_PADDING.get()
    if (pad is None or not IN_SELF_ATTENTION.get() or k.shape[2] < pad.padded_len
            or pad.valid_len >= pad.padded_len):
        return None
    return pad


def declared_padding(q, k):
    """(batch, kv_len) bool, False at the keys ``pad_self_attention_keys`` declared padding
    (self-attention calls only; the video tokens come first in the key sequence), else
    None."""
    pad = active_padding(k)
    if pad is None:
        return None
    pos = jnp.arange(k.shape[2])
    real = (pos < pad.valid_len) | (pos >= pad.padded_len)
    return jnp.broadcast_to(real, (q.shape[0], k.shape[2]))


def declared_tail(k) -> int | None:
    """``valid_len`` when declared padding applies to this call and is the key sequence's tail
    (the keys are the padded tokens alone), else None."""
    pad = active_padding(k)
    return pad.valid_len if pad is not None and k.shape[2] == pad.padded_len else None


def real_keys(q, k, mask):
    """(real keys (batch, kv_len) bool or None, the mask left for the reference path,
    the static position before which every key is real: 0 when unknown).

    A key-padding ``mask`` is consumed (its padding may sit anywhere unless
    ``real_keys_before`` declared where); declared sequence-parallel padding, which starts
    at its ``valid_len``, is added."""
    kv_len = k.shape[2]
    real = key_padding_mask(mask, q, k)
    before = kv_len
    if real is not None:
        mask = None
        declared_before = _REAL_KEYS_BEFORE.get()
        before = 0 if declared_before is None else min(declared_before, kv_len)
    declared = declared_padding(q, k)
    if declared is not None:
        real = declared if real is None else real & declared
        before = min(before, _KEY_PADDING.get().valid_len)
    return real, mask, before


def key_segment_ids(q, k, real) -> SegmentIds:
    """Segment ids for the kernels from real keys: real = 1, padding = 0.

    In self-attention (q_len == kv_len, the same tokens) a query gets its own key's id, so a
    padded query attends only padding (its own key among them) and stays finite; no real
    token reads it. Otherwise every query is real (id 1)."""
    kv_ids = real.astype(jnp.int32)
    if q.shape[2] == k.shape[2]:
        return SegmentIds(kv_ids, kv_ids)
    return SegmentIds(jnp.ones((q.shape[0], q.shape[2]), jnp.int32), kv_ids)
