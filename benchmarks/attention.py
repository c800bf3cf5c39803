"""Time our splash kernel against JAX's stock splash kernel and XLA attention.

On a TPU: runs the compiled kernels at a Wan 2.1 shape (default: one chip's share of Wan
14B 720p self-attention with 8-way head sharding, 5 heads x 75,600 tokens, bf16) and
prints the median time of ``--iters`` calls after ``--warmup`` calls (each call ends in
``block_until_ready``), the achieved TFLOP/s with the 4*B*H*Sq*Skv*D yardstick, the
fraction of the chip's bf16 peak, and each implementation's time relative to ours.

On CPU (no TPU): runs the same harness with the Pallas kernels in interpret mode on a
small shape, only to show the harness works. Those timings are labelled
"CPU interpret-mode" and say nothing about TPU performance.

Examples:
    python benchmarks/attention.py                       # TPU: Wan 14B self-attention
    python benchmarks/attention.py --kv-len 512          # TPU: Wan 14B cross-attention
    python benchmarks/attention.py --block-q 2048 --block-kv 2048 --block-kv-compute 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import custom_splash_attention as csa  # noqa: E402
from engine.run import chips  # noqa: E402

TPU_DEFAULTS = dict(batch=1, heads=5, q_len=75600, kv_len=75600, head_dim=128)
CPU_DEFAULTS = dict(batch=1, heads=2, q_len=640, kv_len=640, head_dim=128)


def _parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--q-len", type=int)
    p.add_argument("--kv-len", type=int)
    p.add_argument("--head-dim", type=int)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--block-q", type=int, help="ours; default BlockSizes().block_q")
    p.add_argument("--block-kv", type=int)
    p.add_argument("--block-kv-compute", type=int)
    p.add_argument(
        "--stock-block-q",
        type=int,
        default=None,
        help="stock splash block_q (default 1024 on TPU, 128 on CPU)",
    )
    p.add_argument("--stock-block-kv", type=int, default=None)
    p.add_argument("--stock-block-kv-compute", type=int, default=None)
    p.add_argument(
        "--impls", default="ours,stock,xla", help="comma-separated subset of ours,stock,xla"
    )
    p.add_argument("--warmup", type=int, default=None, help="default 3 (TPU), 1 (CPU)")
    p.add_argument("--iters", type=int, default=None, help="default 20 (TPU), 3 (CPU)")
    p.add_argument("--k-smoothing", action="store_true")
    p.add_argument("--no-check", action="store_true", help="skip the agreement check")
    args = p.parse_args(argv)
    on_tpu = jax.default_backend() == "tpu"
    defaults = TPU_DEFAULTS if on_tpu else CPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not on_tpu:
        # Small blocks so the CPU run exercises several q and kv blocks and a ragged tail.
        args.block_q = args.block_q or 256
        args.block_kv = args.block_kv or 256
        args.block_kv_compute = args.block_kv_compute or 128
    stock_default = (1024, 1024, 512) if on_tpu else (128, 128, 128)
    args.stock_block_q = args.stock_block_q or stock_default[0]
    args.stock_block_kv = args.stock_block_kv or stock_default[1]
    args.stock_block_kv_compute = args.stock_block_kv_compute or stock_default[2]
    args.warmup = (3 if on_tpu else 1) if args.warmup is None else args.warmup
    args.iters = (20 if on_tpu else 3) if args.iters is None else args.iters
    args.on_tpu = on_tpu
    return args


def make_ours(args):
    defaults = csa.BlockSizes()
    bs = csa.BlockSizes(
        args.block_q or defaults.block_q,
        args.block_kv or defaults.block_kv,
        args.block_kv_compute or defaults.block_kv_compute,
    )
    interpret = not args.on_tpu

    @jax.jit
    def ours(q, k, v):
        return csa.splash_attention(
            q, k, v, options=csa.AttentionOptions(block_sizes=bs, k_smoothing=args.k_smoothing),
            interpret=interpret,
        )

    fit = csa._fit_block_sizes(bs, args.q_len, args.kv_len)  # what the kernel runs
    return ours, f"blocks {fit.block_q}/{fit.block_kv}/{fit.block_kv_compute}"


def make_stock(args):
    """JAX's stock splash kernel through ``csa.stock_splash_attention`` (the product's
    ``--attention stock_splash``): padded to its blocks, padding masked by segment ids."""
    bs = csa.BlockSizes(block_q=args.stock_block_q, block_kv=args.stock_block_kv,
                        block_kv_compute=args.stock_block_kv_compute)
    run = jax.jit(lambda q, k, v: csa.stock_splash_attention(q, k, v, block_sizes=bs,
                                                             interpret=not args.on_tpu))
    fit = csa._fit_block_sizes(bs, args.q_len, args.kv_len)
    return run, f"blocks {fit.block_q}/{fit.block_kv}/{fit.block_kv_compute}"


def make_xla(args):
    return jax.jit(lambda q, k, v: csa.xla_attention(q, k, v)), "jax.nn.dot_product_attention"


def _time(fn, inputs, warmup, iters):
    for _ in range(warmup):
        jax.block_until_ready(fn(*inputs))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    args = _parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    b, h, sq, skv, d = args.batch, args.heads, args.q_len, args.kv_len, args.head_dim
    flops = 4 * b * h * sq * skv * d
    if args.on_tpu:
        print(f"TPU timings on {kind} (1 chip), median of {args.iters} after {args.warmup} warmup")
    else:
        print(
            "CPU interpret-mode timings (NOT TPU performance; harness check only), "
            f"median of {args.iters} after {args.warmup} warmup"
        )
    print(
        f"shape B={b} H={h} Sq={sq} Skv={skv} D={d} {dtype.name}; "
        f"{flops / 1e12:.4f} TFLOP per call (4*B*H*Sq*Skv*D)"
    )

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, h, sq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, h, skv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, h, skv, d)), dtype)
    makers = {"ours": make_ours, "stock": make_stock, "xla": make_xla}
    results, outputs = {}, {}
    for name in [n.strip() for n in args.impls.split(",") if n.strip()]:
        if name not in makers:
            print(f"{name}: unknown implementation, expected one of {sorted(makers)}")
            return 2
        fn, note = makers[name](args)
        try:
            seconds = _time(fn, (q, k, v), args.warmup, args.iters)
            outputs[name] = fn(q, k, v)
        except Exception as e:  # e.g. XLA running out of HBM on a 75,600^2 score matrix
            print(f"{name:>6}: failed ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
            continue
        results[name] = seconds
        tflops = flops / seconds / 1e12
        chip = chips.chip_for_device_kind(kind) if args.on_tpu else None
        peak = chip.peak_bf16_tflops if chip else None
        of_peak = f", {100 * tflops / peak:.1f}% of {peak:.0f} peak" if peak else ""
        print(f"{name:>6}: {seconds * 1e3:10.3f} ms  {tflops:9.4f} TFLOP/s{of_peak}  ({note})")
    if "ours" in results:
        for name, seconds in results.items():
            if name != "ours":
                print(f"{name:>6} / ours time ratio: {seconds / results['ours']:.2f}x")
    if not args.no_check and "ours" in outputs:
        for name, out in outputs.items():
            if name != "ours":
                diff = jnp.max(
                    jnp.abs(out.astype(jnp.float32) - outputs["ours"].astype(jnp.float32))
                )
                print(f"max |{name} - ours| = {float(diff):.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
