"""Parity against an eager reference, failing loudly with a diagnosis.

The parity tests compared our frames with diffusers' eager float32 pipeline at atol 1e-3
while the two agree to ~2e-7 (measured; both sides are bit-identical across repeated runs in
one process). Rare failures (1 in ~835 suite tests under load; once in CI, 2026-11-27, on a
machine whose CPU differs from ours) had frames off by up to 0.07 in one patch of the last
frames. The cause is the tiny Wan 2.1 VAE (``tools/make_tiny_checkpoint.py``, base_dim 3):
its last up block has one channel, so that block's RMS norm (``F.normalize`` over channels)
is sign(x), a step. Where x is within float32 rounding of 0 a rounding difference upstream
(another CPU's torch kernels, another reduction order) flips the sign and moves a patch of
pixels by ~0.07, while the latents agree to 1e-6 of their scale (measured: the reference
under torch's AVX2 and its non-vector kernels gives latents 1.8e-5 apart on a max of 13 and
frames 0.036 apart; the first layer that differs by more than 1e-3 is that norm: 3e-7 in,
2.0 out). So every parity test that decodes through the tiny Wan 2.1 VAE compares the
**final latents** (the VAE decode's input, diffusers' ``output_type="latent"``), which the
flip never touches: ``our_latents`` records ours. One end-to-end test
(``test_pipeline_parity.py::test_float32_frames_match_diffusers``) also keeps the frames,
with ``assert_frames_close_but_a_patch``'s bound, which allows such a patch. When a
comparison fails, the helper computes both sides once more and says which of them changed
between two identical runs. It never passes a test on the second try: a mismatch always
fails.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import numpy as np
from safetensors.numpy import save_file

from engine.programs import denoise
from engine.run import runtime


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


def assert_frames_close(ours, want, *, atol: float, again, what: str = "frames") -> None:
    """Assert ``|ours - want| <= atol`` elementwise; on failure recompute and diagnose.

    Args:
        ours, want: frames (or ``what``: latents), any equal shapes, our run and the
            reference's.
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
        f"{what} differ beyond atol {atol}: {_where(ours, want)}; run again: ours vs ours "
        f"{_where(ours2, ours)}, reference vs reference {_where(want2, want)}, ours vs "
        f"reference {_where(ours2, want2)}")


def assert_frames_close_but_a_patch(ours, want, *, atol: float, patch_atol: float,
                                    patch_fraction: float) -> None:
    """Frames through the tiny Wan 2.1 VAE: equal within ``atol`` except for at most
    ``patch_fraction`` of the values, which may be off by up to ``patch_atol``.

    The VAE's one-channel RMS norm (module docstring) can flip on a float32 rounding
    difference and move a patch of pixels (measured: 188 of 165,888 values by up to 0.017;
    elsewhere up to 0.07); a decode bug (an axis, a scale or shift, a frame) moves most
    values. The latents, compared tightly beside this, carry the precision.

    Args:
        ours, want: equal-shape frames in [0, 1], ours and the reference's.
        atol: the bound for all but ``patch_fraction`` of the values.
        patch_atol: the bound for every value.
        patch_fraction: the largest share of values allowed beyond ``atol`` (0-1).

    Raises:
        AssertionError: either bound broken, naming the largest difference, where, and how
            many values are beyond ``atol``.
    """
    ours, want = np.asarray(ours), np.asarray(want)
    assert ours.shape == want.shape, (ours.shape, want.shape)
    diff = np.abs(ours.astype(np.float64) - want.astype(np.float64))
    beyond = int((diff > atol).sum())
    assert diff.max() <= patch_atol and beyond <= patch_fraction * diff.size, (
        f"frames differ beyond a patch: {beyond} of {diff.size} values beyond atol {atol} "
        f"(allowed {patch_fraction:.2%}), every value within {patch_atol} required; "
        f"{_where(ours, want)}")


@contextlib.contextmanager
def our_latents():
    """Record the final latents of our runs inside the block: a list that receives, per
    decoded video, float32 (batch, channels, frames, height, width) host copies of the VAE
    decode's input (the normalized latents diffusers returns with ``output_type="latent"``)."""
    seen: list[np.ndarray] = []
    decode = denoise.decode

    def recording(vae_decode, latents):
        seen.append(np.asarray(latents, np.float32))
        return decode(vae_decode, latents)

    with mock.patch.object(denoise, "decode", recording):
        yield seen


def latents_of(run, *args, **kw):
    """``run(*args, **kw)``, a call that returns ``generate``'s (frames, report), under
    ``our_latents``: (its last video's final latents, report)."""
    with our_latents() as seen:
        _, report = run(*args, **kw)
    return seen[-1], report


def save_latents_in_this_process(path: str) -> None:
    """For a child process that then runs ``generate_flax.py`` (the multi-host tests launch
    it under ``python -c``): every VAE decode's input, gathered from every process
    (``runtime.to_host``, a collective each process joins as each decodes), is written by
    process 0 to ``path`` after each decode, as safetensors ``{"0": latents, "1": ...}`` in
    decode order (warmup decodes included; float32 (batch, channels, frames, height, width),
    the arrays ``our_latents`` records in-process). The patch lasts for the process."""
    seen: dict[str, np.ndarray] = {}
    decode = denoise.decode

    def recording(vae_decode, latents):
        seen[str(len(seen))] = np.ascontiguousarray(runtime.to_host(latents), np.float32)
        if runtime.is_writer():
            save_file(seen, path)
        return decode(vae_decode, latents)

    denoise.decode = recording


def recording_program(script: str, path: str) -> list[str]:
    """The arguments after ``python`` that run ``script`` (generate_flax.py, its own
    arguments following) in a child that first calls ``save_latents_in_this_process(path)``:
    ``["-c", code]`` in place of ``[script]``."""
    tests = os.path.dirname(os.path.abspath(__file__))
    return ["-c", f"import runpy, sys; sys.path.insert(0, {tests!r}); import parity; "
                  f"parity.save_latents_in_this_process({str(path)!r}); "
                  f"sys.argv[0] = {script!r}; runpy.run_path({script!r}, run_name='__main__')"]
