"""Compile time of the Wan 2.1 transformer step: 40 unrolled blocks vs one scanned block.

Deviceless TPU compile on this CPU host: libtpu describes a TPU slice without owning one
(``jax.experimental.topologies.get_topology_desc``), and ``jax.jit(...).lower(...).compile()``
then runs the real TPU compiler for it. No weights are read: the model is built under
``accelerate.init_empty_weights()`` from the architecture config (configs/Wan-AI/...), its
parameters enter as ``jax.ShapeDtypeStruct``s carrying their ``NamedSharding``, and only the
RoPE buffers are real. The jitted function is generate_flax's batch-2 CFG step
(``families.wan.step_fn``) with the Splash attention override, sharded by generate_flax's Megatron
rules: the same program ``compile_transformer_step`` builds, minus the real arrays.

For each variant (unrolled = diffusers' block loop; scanned = scan_layers.scan_blocks) it
prints trace+lower seconds, compile seconds, per-chip ``memory_analysis()`` (argument,
output, temporaries, generated code) and ``cost_analysis()`` flops, then the ratios. Timings
depend on this host's CPU and load; the TPU compiler's work, not the TPU, is measured.

With ``--cache`` it also runs ``generate_flax.py`` twice on the tiny checkpoint (JAX on CPU)
against one fresh persistent compilation cache and compares the cold and warm reports'
``compile_transformer_s``, ``compile_vae_s`` and ``cold_start_s``.

Examples:
    python benchmarks/compile_time.py                         # 14B, 720p x 81, v6e:2x4 dp2 tp4
    python benchmarks/compile_time.py --variants scanned      # one variant only
    python benchmarks/compile_time.py --model 1.3B --height 480 --width 832
    python benchmarks/compile_time.py --variants none --cache # the cache experiment only
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODELS = {
    "14B": os.path.join(ROOT, "configs", "Wan-AI", "Wan2.1-T2V-14B-Diffusers"),
    "1.3B": os.path.join(ROOT, "configs", "Wan-AI", "Wan2.1-T2V-1.3B-Diffusers"),
}
GIB = 2**30
LABEL = "deviceless TPU compile on this CPU host"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="14B")
    p.add_argument("--topology", default="v6e:2x4", help="libtpu topology name")
    p.add_argument("--mesh", default="2,4,1", help="dp,tp,sp")
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--frames", type=int, default=81)
    p.add_argument("--text_len", type=int, default=512)
    p.add_argument("--layers", type=int, default=None,
                   help="override the config's num_layers (e.g. to see how compile time grows)")
    p.add_argument("--variants", default="unrolled,scanned",
                   help="comma-separated subset of unrolled,scanned; 'none' for neither")
    p.add_argument("--attention", choices=("splash", "xla"), default="splash")
    p.add_argument("--unroll", type=int, default=1,
                   help="jax.lax.scan unroll factor of the scanned variant")
    p.add_argument("--cache", action="store_true",
                   help="also measure cold vs warm persistent-cache runs of generate_flax.py "
                        "on the tiny checkpoint (CPU)")
    p.add_argument("--tiny_checkpoint", default=None,
                   help="checkpoint for --cache (default: build one in a temp dir)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Deviceless TPU compile
# ---------------------------------------------------------------------------------------------


def topology_mesh(topology: str, mesh_shape: tuple[int, int, int]):
    """A ("dp", "tp", "sp") mesh over the described (not owned) TPU chips of ``topology``."""
    from engine.run import runtime
    if not runtime.has_tpu_device_files():  # never touch a real TPU host's settings
        runtime.use_deviceless_tpu(topology)
    from jax.experimental import topologies

    from engine.run.mesh import MeshShape, make_mesh

    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    return make_mesh(MeshShape(*mesh_shape), devices[: mesh_shape[0] * mesh_shape[1]
                                                      * mesh_shape[2]])


def abstract_transformer(config_dir: str, *, scanned: bool, layers: int | None = None,
                         unroll: int = 1):
    """``WanTransformer3DModel`` on the meta device, dtypes as ``from_pretrained(dtype=bf16)``
    gives them (``families.wan.empty_transformer``). Buffers (RoPE tables) are real. Uses no
    weight memory."""
    import torch
    from diffusers import WanTransformer3DModel

    from engine.weights import scan_layers
    from families import wan

    cfg = dict(WanTransformer3DModel.load_config(config_dir, subfolder="transformer"))
    if layers:
        cfg["num_layers"] = layers
    model = wan.empty_transformer(cfg, torch.bfloat16)
    if scanned:
        scan_layers.scan_blocks(model, unroll=unroll)
    return model


def abstract_weights(model, mesh, rules):
    """(JittableModule, params, buffers, specs): params and buffers as ``ShapeDtypeStruct``s
    with their ``NamedSharding`` (buffers replicated), specs {name: PartitionSpec}."""
    import jax
    import torchax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torchax import interop
    from torchax.ops import mappings

    from engine.weights import sharding
    jm = interop.JittableModule(model)
    shapes = {k: tuple(v.shape) for k, v in jm.params.items()}
    # For a scanned model: the unrolled model's decisions, with an unsharded layer axis.
    specs, _, _ = sharding.module_sharding_specs(model, shapes, rules, mesh)
    params = {k: jax.ShapeDtypeStruct(tuple(v.shape), mappings.t2j_dtype(v.dtype),
                                      sharding=NamedSharding(mesh, specs[k]))
              for k, v in jm.params.items()}
    real = torchax.default_env().t2j_copy(jm.buffers)
    buffers = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
               for k, v in real.items()}
    return jm, params, buffers, specs


def step_inputs(mesh, cfg: dict, args):
    """latents (1, 16, F', H/8, W/8) f32, timestep (1,) int32, text (2, T, text_dim) bf16."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rep = NamedSharding(mesh, P())
    f = (args.frames - 1) // 4 + 1
    latents = jax.ShapeDtypeStruct((1, cfg["in_channels"], f, args.height // 8, args.width // 8),
                                   jnp.float32, sharding=rep)
    timestep = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=rep)
    embeds = jax.ShapeDtypeStruct((2, args.text_len, cfg["text_dim"]), jnp.bfloat16,
                                  sharding=NamedSharding(mesh, P("dp")))
    return latents, timestep, embeds


def measure(variant: str, mesh, args) -> dict:
    """Trace+lower and compile one variant's CFG step; returns the figures."""
    import types

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torchax import interop

    from families import wan

    model = abstract_transformer(MODELS[args.model], scanned=variant == "scanned",
                                 layers=args.layers, unroll=args.unroll)
    jm, params, buffers, specs = abstract_weights(model, mesh, wan.transformer_sharding_rules())
    latents, timestep, embeds = step_inputs(mesh, dict(model.config), args)
    embeds = {"encoder_hidden_states": embeds}
    # The family's batch-2 CFG step, as generate_flax builds it for bf16 at CFG 5.0.
    fn = wan.step_fn(jm, types.SimpleNamespace(dtype="bfloat16", use_cfg=True,
                                               guidance_scale=5.0))
    rep = NamedSharding(mesh, P())
    param_sh = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    jitted = jax.jit(interop.jax_view(fn),
                     in_shardings=(param_sh, rep, rep, rep, NamedSharding(mesh, P("dp"))),
                     out_shardings=rep)
    # Wall and process CPU seconds: on a shared host the CPU time is the steadier figure.
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = jitted.lower(params, buffers, latents, timestep, embeds)
    c1, t1 = time.process_time(), time.perf_counter()
    compiled = lowered.compile()
    c2, t2 = time.process_time(), time.perf_counter()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = lowered.as_text()
    return dict(
        variant=variant,
        scan_unroll=args.unroll if variant == "scanned" else None,
        trace_lower_s=t1 - t0,
        compile_s=t2 - t1,
        trace_lower_cpu_s=c1 - c0,
        compile_cpu_s=c2 - c1,
        host_load_avg_1min=os.getloadavg()[0],
        stablehlo_chars=len(hlo),
        has_while_loop="stablehlo.while" in hlo,
        num_params=len(params),
        argument_bytes=mem.argument_size_in_bytes,
        output_bytes=mem.output_size_in_bytes,
        temp_bytes=mem.temp_size_in_bytes,
        generated_code_bytes=mem.generated_code_size_in_bytes,
        alias_bytes=mem.alias_size_in_bytes,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
    )


def print_compile(results: list[dict], args) -> None:
    layers = f" ({args.layers} layers)" if args.layers else ""
    print(f"\n== Wan {args.model}{layers} CFG step, {args.height}x{args.width}x{args.frames}, "
          f"{args.topology} mesh dp,tp,sp={args.mesh}, attention={args.attention}: {LABEL} ==")
    head = (f"{'variant':9} {'trace+lower s':>13} {'compile s':>10} {'compile cpu s':>13} "
            f"{'args GiB':>9} {'temp GiB':>9} {'out GiB':>8} {'code MiB':>9} {'HLO flops':>11}")
    print(head)
    for r in results:
        name = r["variant"] + (f"/u{r['scan_unroll']}" if (r["scan_unroll"] or 1) > 1 else "")
        print(f"{name:9} {r['trace_lower_s']:13.1f} {r['compile_s']:10.1f} "
              f"{r['compile_cpu_s']:13.1f} "
              f"{r['argument_bytes'] / GIB:9.2f} {r['temp_bytes'] / GIB:9.2f} "
              f"{r['output_bytes'] / GIB:8.3f} {r['generated_code_bytes'] / 2**20:9.2f} "
              f"{r['flops']:11.3e}")
    by = {r["variant"]: r for r in results}
    if {"unrolled", "scanned"} <= set(by):
        u, s = by["unrolled"], by["scanned"]
        print(f"unrolled / scanned: compile {u['compile_s'] / s['compile_s']:.2f}x wall, "
              f"{u['compile_cpu_s'] / s['compile_cpu_s']:.2f}x CPU time, "
              f"trace+lower {u['trace_lower_s'] / s['trace_lower_s']:.2f}x, "
              f"StableHLO text {u['stablehlo_chars'] / s['stablehlo_chars']:.1f}x; "
              f"per-chip temporaries scanned - unrolled "
              f"{(s['temp_bytes'] - u['temp_bytes']) / GIB:+.2f} GiB")
        if u["flops"]:
            # XLA's cost analysis counts a while loop's body once, not trip-count times.
            print(f"HLO flops scanned / unrolled: {s['flops'] / u['flops']:.3f} "
                  "(cost_analysis counts a loop body once)")


# ---------------------------------------------------------------------------------------------
# Persistent compilation cache, cold vs warm (CPU, tiny checkpoint)
# ---------------------------------------------------------------------------------------------

CACHE_TIMINGS = ("compile_transformer_s", "compile_vae_s", "cold_start_s")


def _run_generate(checkpoint: str, cache_dir: str, out_dir: str) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "generate_flax.py"), "--model_id", checkpoint,
           "--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "2",
           "--num_iterations", "1", "--compilation_cache_dir", cache_dir, "--output_dir",
           out_dir]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a plain run would have
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"generate_flax.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    reports = sorted(glob.glob(os.path.join(out_dir, "*.json")))
    if not reports:
        raise RuntimeError(f"no JSON report in {out_dir}")
    with open(reports[-1]) as f:
        report = json.load(f)
    timings = report.get("timings", {})
    return dict(process_wall_s=wall, **{k: timings.get(k) for k in CACHE_TIMINGS})


def cache_ratio(tiny_checkpoint: str | None) -> dict:
    """Two runs against one fresh cache dir: the first fills it, the second reads it."""
    with tempfile.TemporaryDirectory(prefix="wan-cache-bench-") as tmp:
        checkpoint = tiny_checkpoint
        if checkpoint is None:
            checkpoint = os.path.join(tmp, "tiny-wan")
            subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tiny_checkpoint.py"),
                            "--output", checkpoint], check=True, capture_output=True,
                           env={**os.environ, "JAX_PLATFORMS": "cpu"})
        cache = os.path.join(tmp, "cache")
        cold = _run_generate(checkpoint, cache, os.path.join(tmp, "out-cold"))
        warm = _run_generate(checkpoint, cache, os.path.join(tmp, "out-warm"))
        entries = len(os.listdir(cache)) if os.path.isdir(cache) else 0
    print("\n== persistent compilation cache, tiny checkpoint, 64x96x9, 2 steps, JAX on CPU ==")
    print(f"{'timing':26} {'cold s':>8} {'warm s':>8} {'cold/warm':>9}")
    for key in ("process_wall_s", *CACHE_TIMINGS):
        c, w = cold.get(key), warm.get(key)
        if c is None or w is None:
            print(f"{key:26} {'n/a':>8} {'n/a':>8}")
            continue
        print(f"{key:26} {c:8.2f} {w:8.2f} {c / w if w else float('inf'):9.1f}")
    print(f"cache entries written: {entries}")
    return dict(cold=cold, warm=warm, cache_entries=entries)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = dict(label=LABEL, args=vars(args))
    variants = [v for v in args.variants.split(",") if v and v != "none"]
    if variants:
        import torchax

        import custom_splash_attention as csa

        mesh_shape = tuple(int(x) for x in args.mesh.split(","))
        mesh = topology_mesh(args.topology, mesh_shape)
        csa.install_sdpa_override(torchax.default_env(), attention=args.attention,
                                  mesh=mesh if args.attention == "splash" else None,
                                  # the topology's default blocks, as generate_flax takes them
                                  options=csa.AttentionOptions(
                                      block_sizes=csa.default_block_sizes(
                                          args.topology.split(":")[0])),
                                  interpret=False)
        results = []
        for v in variants:
            r = measure(v, mesh, args)
            print(f"[{v}] trace+lower {r['trace_lower_s']:.1f} s, compile {r['compile_s']:.1f} s "
                  f"({r['compile_cpu_s']:.1f} s CPU; load avg {r['host_load_avg_1min']:.1f})",
                  flush=True)
            results.append(r)
        print_compile(results, args)
        out["compile"] = results
    if args.cache:
        out["cache"] = cache_ratio(args.tiny_checkpoint)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
