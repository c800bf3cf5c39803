"""How XLA compiles and runs our W8A8 linear on this machine's accelerator, per XLA flag set.

Why: on an H200 (2026-11-27) a ``--quantize fp8`` run of the real-size Wan 2.1 1.3B had not
finished compiling its step after ~180 s, where the bf16 step's whole cold start is 52 s.
This measures one quantized linear (``engine.weights.quantize.quantized_linear``) beside the
bf16 ``x @ W^T`` it replaces, at Wan 2.1 1.3B's real shapes (480 x 832 x 81: 32,760 tokens
per video, CFG batch 2; width 1,536, FFN 8,960), once per XLA flag set, each set in its own
process (XLA reads ``XLA_FLAGS`` once):

* ``default``: the flags the run would use;
* ``no_triton_gemm``: ``--xla_gpu_enable_triton_gemm=false`` (cuBLAS / cuBLASLt only);
* ``autotune0``: ``--xla_gpu_autotune_level=0`` (no autotuning of GEMM configurations).

Per (flag set, layer): lower + compile seconds, the median of 10 timed calls in ms (device
synchronised), and which kernels the optimized HLO calls (cuBLASLt ``__cublas$lt$matmul$f8``,
``__cublas$gemm``, a Triton fusion, or a plain ``dot`` / ``convolution``). The last line is a
JSON object with every result and ``pick``: the fastest flag set to compile among those whose
fp8 calls are within 1.25x of the best fp8 time.

Usage: ``python benchmarks/fp8_probe.py [--tokens N]`` (any backend; on a CPU it runs at
``--tokens 256`` in under a minute).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG_SETS = {
    "default": "",
    "no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
    "autotune0": "--xla_gpu_autotune_level=0",
}
# (name, in, out): Wan 2.1 1.3B's attention projection and the two FFN layers.
LAYERS = (("attn_qkvo", 1536, 1536), ("ffn_up", 1536, 8960), ("ffn_down", 8960, 1536))
KERNEL_PATTERNS = {
    "cublaslt_f8": r"__cublas\$lt\$matmul\$f8",
    "cublaslt": r"__cublas\$lt\$matmul\"",
    "cublas_gemm": r"__cublas\$gemm",
    "triton": r"__triton_gemm|kind=kCustom.*triton|\"triton_gemm",
    "dot": r"= [a-z0-9]+\[[^\]]*\][^ ]* dot\(",
    "convolution": r" convolution\(",
}


def time_calls(fn, *args, n: int = 10) -> float:
    """Median wall ms of ``n`` calls after one warmup, each synchronised."""
    fn(*args).block_until_ready()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def kernels(hlo: str) -> dict:
    """How many times each kernel pattern occurs in an optimized HLO text."""
    return {k: len(re.findall(p, hlo)) for k, p in KERNEL_PATTERNS.items() if re.search(p, hlo)}


def measure_layer(tokens: int, d_in: int, d_out: int, scheme: str) -> dict:
    """One layer, bf16 and ``scheme``: compile s, call ms, kernels, fp8 vs bf16 rel. error."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sys.path.insert(0, ROOT)
    from engine.weights import quantize

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, tokens, d_in), np.float32), jnp.bfloat16)
    w = rng.standard_normal((d_out, d_in), np.float32) / np.sqrt(d_in)
    scale = quantize.channel_scale(w, scheme)
    w_q = jnp.asarray(quantize.quantize_rows(w, scale, scheme))
    w_bf = jnp.asarray(w, jnp.bfloat16)
    out = {}
    for name, fn, args in (
            ("bf16", lambda a, b: jnp.einsum("bti,oi->bto", a, b), (x, w_bf)),
            (scheme, lambda a, b, s: quantize.quantized_linear(a, b, s, None, scheme=scheme),
             (x, w_q, jnp.asarray(scale)))):
        start = time.perf_counter()
        compiled = jax.jit(fn).lower(*args).compile()
        compile_s = time.perf_counter() - start
        out[name] = dict(compile_s=round(compile_s, 3),
                         call_ms=round(time_calls(compiled, *args), 3),
                         kernels=kernels(compiled.as_text()))
        out[name]["y"] = compiled(*args)
    ref, got = (out[k].pop("y").astype(jnp.float32) for k in ("bf16", scheme))
    out["rel_l2_vs_bf16"] = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    return out


def child(tokens: int, scheme: str) -> dict:
    """Every layer under this process's XLA flags."""
    import jax

    return dict(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                layers={n: measure_layer(tokens, i, o, scheme) for n, i, o in LAYERS})


def run_flag_set(name: str, tokens: int, scheme: str, timeout: float) -> dict:
    """``child`` in a fresh process with ``FLAG_SETS[name]`` appended to ``XLA_FLAGS``."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + FLAG_SETS[name]).strip()
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", "--tokens", str(tokens),
                               "--scheme", scheme], env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout:.0f} s")
    wall = round(time.perf_counter() - start, 1)
    if proc.returncode != 0:
        return dict(error=(proc.stderr.strip().splitlines() or ["?"])[-1], wall_s=wall)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), wall_s=wall)


def pick(results: dict, scheme: str) -> str:
    """The flag set to run with: fastest total compile among those whose summed call time is
    within 1.25x of the best (``default`` when none finished)."""
    ok = {k: v for k, v in results.items() if "layers" in v}
    if not ok:
        return "default"
    calls = {k: sum(lay[scheme]["call_ms"] for lay in v["layers"].values()) for k, v in ok.items()}
    compiles = {k: sum(lay[scheme]["compile_s"] for lay in v["layers"].values())
                for k, v in ok.items()}
    fast = [k for k in ok if calls[k] <= 1.25 * min(calls.values())]
    return min(fast, key=lambda k: (compiles[k], k != "default"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32760, help="tokens per video (batch is 2)")
    p.add_argument("--scheme", choices=("fp8", "int8"), default="fp8")
    p.add_argument("--timeout", type=float, default=120, help="seconds per flag set")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.tokens, args.scheme)))
        return 0
    results = {}
    for name in FLAG_SETS:
        results[name] = run_flag_set(name, args.tokens, args.scheme, args.timeout)
        print(name, json.dumps(results[name]), flush=True)
    chosen = pick(results, args.scheme)
    print(json.dumps(dict(tokens=args.tokens, scheme=args.scheme, results=results, pick=chosen,
                          pick_flags=FLAG_SETS[chosen])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
