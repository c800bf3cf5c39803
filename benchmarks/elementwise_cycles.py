"""Estimated cycles of a Wan-sized layer norm's fusions on v6e: libtpu's static profile,
XLA's own fusion cost model and HBM bytes / bandwidth, side by side.

ESTIMATES ONLY (deviceless compile, no TPU): the evidence behind ``engine/dry_run/estimate.py``
charging the non-matmul ops of a block at HBM bytes / bandwidth. Default shape: 18,900 x
5,120 (Wan 14B's 75,600 tokens at 720p split 4 ways), bf16, normalised in float32 with a
scale and a shift, as diffusers' Wan blocks do.

Usage: ``python benchmarks/elementwise_cycles.py [--rows 18900] [--dim 5120]``
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.dry_run import estimate  # noqa: E402
from engine.run import chips  # noqa: E402

estimate.setup_profile_environment()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def layer_norm(x, scale, shift):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    return ((xf - mean) * jax.lax.rsqrt(var + 1e-6) * (1 + scale) + shift).astype(x.dtype)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=18900)
    parser.add_argument("--dim", type=int, default=5120)
    args = parser.parse_args(argv)
    rep = NamedSharding(Mesh(np.array([estimate.topology_device("v6e:2x4")]), ("x",)), P())
    x = jax.ShapeDtypeStruct((args.rows, args.dim), jnp.bfloat16, sharding=rep)
    v = jax.ShapeDtypeStruct((args.dim,), jnp.float32, sharding=rep)
    path = estimate.clear_profile()
    text = jax.jit(layer_norm).lower(x, v, v).compile().as_text()
    profile = {op["name"]: op["cycles"] for op in estimate.read_profile(path)}
    op_bytes = estimate.hlo_op_bytes(text)
    hz, hbm = estimate.clock_hz("v6e"), chips.CHIPS["v6e"].hbm_gbps * 1e9
    print(f"ESTIMATES, v6e, assumed clock {hz / 1e9:.2f} GHz, HBM {hbm / 1e9:.0f} GB/s; "
          f"layer norm of bf16[{args.rows},{args.dim}]")
    print(f"{'op':<28}{'profile':>12}{'XLA model':>12}{'bytes/HBM':>12}  (cycles)")
    for name, _, _, rest in estimate.hlo_computations(text)["ENTRY"]:
        if name not in profile:
            continue
        xla = re.search(r'"window_config":\{[^}]*?"estimated_cycles":"(\d+)"', rest)
        print(f"{name:<28}{profile[name]:>12,}{int(xla.group(1)) if xla else 0:>12,}"
              f"{op_bytes[name][1] / hbm * hz:>12,.0f}")


if __name__ == "__main__":
    main()
