"""Sparse VideoGen's published settings for the Wan checkpoints (``--sparse svg``).

Sources (read, not copied):
- svg-project/Sparse-VideoGen @ 5ce7b01: Wan 2.1 T2V (``wan_t2v_inference.py`` and its
  script): sparsity 0.3, the first 10 of 50 steps dense, layer 0 dense; Wan 2.1 I2V: 14 of
  40 steps dense (layer 0 dense, as its I2V script).
- maxdiffusion ``docs/svg.md`` @ 2a52ee9 (PR #480), Wan 2.2 A14B "moderate" policy:
  sparsity 0.5 for the high-noise expert and 0.2 for the low-noise one, sparse on steps
  [11, 40) and layers [1, 40).
(``../shared/notes/sparse-attention.md`` has the gathered facts and published quality.)
"""

from __future__ import annotations

from engine.programs.sparse import SparsePolicy

T2V21 = dict(densities=(0.3,), sparse_steps=(10, 50), reference_steps=50, layers=(1, 10**9),
             source="Sparse-VideoGen @ 5ce7b01, Wan 2.1 T2V")
I2V21 = dict(densities=(0.3,), sparse_steps=(14, 40), reference_steps=40, layers=(1, 10**9),
             source="Sparse-VideoGen @ 5ce7b01, Wan 2.1 I2V")
A14B = dict(densities=(0.5, 0.2), sparse_steps=(11, 40), reference_steps=40, layers=(1, 40),
            source="maxdiffusion docs/svg.md @ 2a52ee9 (PR #480), Wan 2.2 A14B moderate policy")


def policy(kind: str, num_frames: int, frame_size: int) -> SparsePolicy | str:
    """The setting for a checkpoint ``kind`` ("t2v", "i2v", "a14b" or "ti2v") on a grid of
    ``num_frames`` x ``frame_size`` post-patch tokens, or why there is none (one line)."""
    table = {"t2v": T2V21, "i2v": I2V21, "a14b": A14B}
    if kind not in table:
        return ("not supported for Wan 2.2 TI2V-5B yet (no published SVG setting wired for "
                "it)")
    return SparsePolicy(num_frames=num_frames, frame_size=frame_size, **table[kind])
