"""``AttentionOptions``: how our kernel runs a model's attention, one frozen value."""

from __future__ import annotations

import dataclasses

from splash.blocks import BlockSizes
from splash.mask import HeadMasks, LocalMask, Mask

ATTENTION_BACKENDS = ("xla", "splash", "stock_splash", "cudnn")
# Kernels the Splash wrapper can run: ours, and JAX's own splash kernel as the trusted fallback.
SPLASH_KERNELS = ("splash", "stock_splash")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """How our kernel runs a model's attention: one frozen value, built once from the run's
    flags and passed down whole (the SDPA override, the sharded wrapper, the kernel).

    Attributes:
        block_sizes: the kernel's tiles (``BlockSizes``).
        k_smoothing: subtract K's mean over real keys first (exact for softmax; see
            docs/attention.md).
        mask: None (every key) or a mask value (a ``splash.mask.Mask``, e.g. ``LocalMask``):
            applied to self-attention (q_len == kv_len) only; cross-attention always sees
            every key. Or ``HeadMasks``: one of its masks per (batch, head), by the kernel
            call's ``mask_index`` (the kernel and its sharded wrapper only, not the SDPA
            override).
    """

    block_sizes: BlockSizes = BlockSizes()
    k_smoothing: bool = False
    mask: Mask | HeadMasks | None = None

    @property
    def window_size(self) -> int | None:
        """The local window's half-width, or None without a ``LocalMask``."""
        return self.mask.window_size if isinstance(self.mask, LocalMask) else None

    @property
    def is_plain(self) -> bool:
        """No option beyond the blocks: what JAX's stock kernel can run."""
        return not self.k_smoothing and self.mask is None
