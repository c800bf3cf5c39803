"""``--estimate``'s reduced-problem kernel profile (engine/dry_run/estimate.py,
``reduced_q_cost``): a kernel comparing segment ids in every kv block is profiled at two
smaller block_q and extrapolated linearly, because libtpu's static profile of it at v6e's
default block_q needs more host memory than a user's machine may have (issue #45).

The shipped geometry (profiles at block_q 2304 and 3328, extrapolated to 4736) cannot be
checked against a full profile at 4736 here: that profile is the one that does not fit. So
the same geometry is checked at a quarter of its size, where both fit in about 2 GB: profiles
at block_q 512 and 768 extrapolated to 1152 (the real extrapolation's 1.375 spans beyond the
second profile, rounded to whole 128-row tiles: 1.5 spans here), against the profile at 1152
itself. Deviceless, libtpu 0.0.42.1's static model for v6e, block_kv 512 / 256; ESTIMATES,
nothing runs on a TPU."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from engine.dry_run import estimate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The real grid of one HunyuanVideo-1.5 720p call's q blocks at this scale's kv steps: what
# the cost model is for (the per-step term dominates; the per-q-block term is spread over it).
GRID = [1, 1, 24, 56]

REDUCED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from engine.dry_run import estimate
    estimate.setup_profile_environment()
    estimate.MASKED_PROFILE_MAX_BLOCK_Q, estimate.REDUCED_Q_SPAN = 768, 256
    blocks = (1152, 512, 256)
    reduced = estimate.kernel_cost("v6e:2x4", blocks, kv_steps=56, segment_ids=True)
    full = estimate.grid_cost("v6e:2x4", blocks, kv_steps=56, segment_ids=True)
    real = estimate.kernel_cost("v6e:2x4", blocks, kv_steps=56, segment_ids=True,
                                real_keys_before=1 << 30)
    print(json.dumps(dict(reduced=reduced, full=full, real=real)))
""")


@pytest.fixture(scope="module")
def profiled():
    """One subprocess (the profile flag must precede libtpu's start): the masked kernel at
    1152/512/256 by ``kernel_cost`` with the bound lowered to 768 (so reduced), by
    ``grid_cost`` (the full profile), and the all-real variant by ``kernel_cost``."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("LIBTPU_INIT_ARGS", None)
    proc = subprocess.run([sys.executable, "-c", REDUCED.format(root=ROOT)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_reduced_q_profile_agrees_with_the_full_profile(profiled):
    reduced, full = profiled["reduced"], profiled["full"]
    # The reduced model profiled the two smaller block_q, not the real one.
    assert reduced["reduced_block_q"] == [512, 768]
    assert set(reduced["profiles"]) == {"bq512 2x2", "bq512 2x3", "bq768 2x2", "bq768 2x3"}
    assert "extrapolated" in reduced["note"]
    assert set(full["profiles"]) == {"2x2", "2x3"}
    # Within 5% per grid step and on the real grid's total.
    assert reduced["per_step"] == pytest.approx(full["per_step"], rel=0.05)
    assert estimate.call_cycles(dict(grid=GRID), reduced) == pytest.approx(
        estimate.call_cycles(dict(grid=GRID), full), rel=0.05)


def test_only_the_masked_kernel_above_the_bound_is_reduced(profiled):
    # With every kv block declared real the kernel profiles at its real blocks.
    assert set(profiled["real"]["profiles"]) == {"2x2", "2x3"}
    assert "reduced_block_q" not in profiled["real"]
