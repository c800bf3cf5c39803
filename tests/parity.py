"""Frame parity against an eager reference, failing loudly with a diagnosis.

The parity tests compare our frames with diffusers' eager float32 pipeline at atol 1e-3
while the two agree to ~2e-7 (measured; both sides are bit-identical across repeated runs in
one process). A rare failure under load (1 in ~835 suite tests, frames off by up to 0.056 in
one corner) could not be reproduced alone, so when a comparison fails this helper computes
both sides once more and says which of them changed between two identical runs: a failure
then names its culprit (our run, the reference, or neither: a real disagreement) instead of
reading as bad luck. It never passes a test on the second try: a mismatch always fails.
"""

from __future__ import annotations

import numpy as np


def _where(a: np.ndarray, b: np.ndarray) -> str:
    """The largest difference, where it is, and the box holding every value off by more
    than float32 rounding (1e-5): a box of a few values says "a local corruption", the whole
    shape says "a global change"."""
    diff = np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    idx = np.unravel_index(int(diff.argmax()), diff.shape)
    off = np.argwhere(diff > 1e-5)
    box = "none" if not len(off) else " x ".join(
        f"{lo}..{hi}" for lo, hi in zip(off.min(0), off.max(0), strict=True))
    return (f"max |d| {diff.max():.3g} at index {tuple(int(i) for i in idx)} of {diff.shape}, "
            f"{len(off)} values > 1e-5 in box {box}")


def assert_frames_close(ours, want, *, atol: float, again) -> None:
    """Assert ``|ours - want| <= atol`` elementwise; on failure recompute and diagnose.

    Args:
        ours, want: frames (any equal shapes), our run and the reference's.
        atol: absolute tolerance (frames on the 0-1 scale).
        again: ``() -> (ours, want)``, both sides computed afresh the same way; called only
            when the comparison fails.

    Raises:
        AssertionError: always on a mismatch, naming the largest difference and which side
            gave different frames when run again.
    """
    ours, want = np.asarray(ours), np.asarray(want)
    assert ours.shape == want.shape, (ours.shape, want.shape)
    if np.abs(ours - want).max() <= atol:
        return
    ours2, want2 = (np.asarray(x) for x in again())
    raise AssertionError(
        f"frames differ beyond atol {atol}: {_where(ours, want)}; run again: ours vs ours "
        f"{_where(ours2, ours)}, reference vs reference {_where(want2, want)}, ours vs "
        f"reference {_where(ours2, want2)}")
