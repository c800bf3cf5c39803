"""Host RAM and per-device bytes while real-architecture weights are placed on a mesh.

Builds Wan 2.1's transformer from a shipped architecture config (default: the 1.3B one in
``configs/``) with random bf16 weights, stacks its blocks as ``--scan_layers`` does, and places
it on 8 CPU devices (dp2 x tp4, the default 8-device layout with CFG) through
``engine.weights.sharding.place_module``, the product's streamed path. It prints, as ratios to the
weight bytes:

* the peak host RSS during placement (anonymous memory, sampled every 5 ms) and the RSS
  before it;
* the peak bytes any device holds (from ``jax.live_arrays()`` and shard shapes, after every
  weight), device 0's peak and the other devices' median.

``--legacy`` places the same weights the way this project did before streaming (torchax's
``t2j_copy``, then ``device_put`` to the shardings), for a before/after ratio.
``--from_checkpoint`` first saves the random weights as a diffusers checkpoint
(``save_pretrained``, safetensors) in a temporary folder, frees them, and then places them
the way a real run does: meta weights, each device's slice read from the files
(``engine.weights.sharding.place_module(..., checkpoint=...)``), so the host never holds
the checkpoint.

``--lora_rank R`` (with ``--from_checkpoint``) also writes a random rank-R LoRA over every
block's attention and FFN projections (original/lightx2v keys, bf16, ``tools/tiny_lora.py``),
loads it through diffusers' key conversion (``engine.weights.lora.load``, timed apart) and fuses it
into each device's slice during placement, for the placement time and host RAM against a
run without it.

CPU caveat: CPU "devices" live in host RAM, so here RSS also holds every device's copies;
the host-side overhead is RSS minus the sum over devices. Figures are CPU figures, not TPU.

Example:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python benchmarks/placement.py [--legacy]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

GB = 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "Wan-AI",
                                                    "Wan2.1-T2V-1.3B-Diffusers"),
                   help="folder with transformer/config.json")
    p.add_argument("--legacy", action="store_true",
                   help="place with torchax t2j_copy + device_put (the pre-streaming path)")
    p.add_argument("--from_checkpoint", action="store_true",
                   help="save to safetensors first, then stream slices from the files (the "
                        "product's path for the transformer)")
    p.add_argument("--lora_rank", type=int, default=0,
                   help="with --from_checkpoint: fuse a random LoRA of this rank (0: none)")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=4)
    return p.parse_args(argv)


def rss_bytes() -> int:
    """Anonymous resident memory (RssAnon): what the process allocated. File-backed pages of
    the memory-mapped safetensors files are page cache the kernel can drop, so they are left
    out."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class RssSampler(threading.Thread):
    """Peak resident set size of this process while running, sampled every 5 ms."""

    def __init__(self):
        super().__init__(daemon=True)
        self.peak, self.stop = rss_bytes(), threading.Event()

    def run(self):
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())


def random_transformer(config_dir: str):
    """Wan transformer of the config's architecture, random weights in the dtypes
    ``from_pretrained`` gives them (``families.wan.empty_transformer``), blocks stacked for
    the scan."""
    import torch
    from diffusers import WanTransformer3DModel

    from engine.weights import scan_layers
    from families import wan

    cfg = dict(WanTransformer3DModel.load_config(config_dir, subfolder="transformer"))
    model = wan.empty_transformer(cfg, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for name, param in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        data = torch.empty(param.shape, dtype=param.dtype)
        data.normal_(0.0, 0.02, generator=gen)
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(data)
    scan_layers.scan_blocks(model)
    return model


def place_legacy(model, mesh, rules):
    """The pre-streaming path: every tensor whole on the default device, then resharded."""
    import jax
    import torchax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from torchax import interop

    from engine.weights import sharding
    env = torchax.default_env()
    jm = interop.JittableModule(model)
    params, buffers = env.t2j_copy(jm.params), env.t2j_copy(jm.buffers)
    specs, _, _ = sharding.module_sharding_specs(model, {k: v.shape for k, v in params.items()},
                                           rules, mesh)
    out = {}
    for k, v in params.items():
        out[k] = jax.device_put(v, NamedSharding(mesh, specs[k])).block_until_ready()
        yield k, out[k]
    jax.device_put(buffers, NamedSharding(mesh, P()))


def load_lora(rank: int, cfg: dict, model, folder: str):
    """([engine.weights.lora.Lora] or [], load seconds, file bytes) of a random
    rank-``rank`` LoRA."""
    if not rank:
        return [], 0.0, 0
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from tiny_lora import write_lora

    from engine.weights import lora
    from families import wan
    path = os.path.join(folder, "lora.safetensors")
    write_lora(path, cfg, fmt="original", rank=rank, dtype=torch.bfloat16, std=0.02)
    t0 = time.perf_counter()
    loaded = lora.load(path, 1.0, lora.transformer_shapes(model), wan.lora_state_dict)
    return [loaded], time.perf_counter() - t0, os.path.getsize(path)


def write_checkpoint(model, args):
    """Save ``model`` (scanned) as an unstacked diffusers checkpoint in a temporary folder and
    return (the folder, a meta-weight scanned model of it, [LoRA] or [], LoRA load seconds,
    LoRA file bytes)."""
    import gc
    import tempfile

    import torch

    from engine.weights import scan_layers
    from families import wan

    tmp = tempfile.TemporaryDirectory(prefix="wan-placement-bench-")
    cfg = dict(model.config)
    unstacked = wan.empty_transformer(cfg, torch.bfloat16)  # to save per-block names
    stacked = model.blocks.stacked_params()
    state = {f"blocks.{i}.{k}": v[i] for k, v in stacked.items()
             for i in range(model.blocks.num_layers)}
    state.update({k: v for k, v in model.state_dict().items()
                  if not k.startswith(scan_layers.STACKED_PREFIX)})
    unstacked.load_state_dict(state, assign=True)
    unstacked.save_pretrained(os.path.join(tmp.name, "transformer"))
    del model, unstacked, state, stacked
    gc.collect()
    model = wan.empty_transformer(cfg, torch.bfloat16)
    loras, lora_s, lora_bytes = load_lora(args.lora_rank, cfg, model, tmp.name)
    scan_layers.scan_blocks(model)
    return tmp, model, loras, lora_s, lora_bytes


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from engine.run import runtime
    from engine.run.mesh import MeshShape, make_mesh
    from engine.weights import placement, sharding
    from families import wan

    runtime.quiet_known_warnings()
    model = random_transformer(args.config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes += sum(b.numel() * b.element_size() for b in model.buffers())
    tmp, loras, lora_s, lora_bytes = None, [], 0.0, 0
    if args.from_checkpoint:
        tmp, model, loras, lora_s, lora_bytes = write_checkpoint(model, args)
    mesh = make_mesh(MeshShape(args.dp, args.tp, 1), jax.devices())
    rules = wan.transformer_sharding_rules()
    peaks: dict = {}

    def account(name, arr):
        for device, n in placement.per_device_bytes().items():
            peaks[device] = max(peaks.get(device, 0), n)

    before = rss_bytes()
    sampler = RssSampler()
    sampler.start()
    t0 = time.perf_counter()
    placed = []  # keep the arrays alive for the final accounting
    if args.legacy:
        for name, arr in place_legacy(model, mesh, rules):
            account(name, arr)
            placed.append(arr)
    elif args.from_checkpoint:
        placed = sharding.place_module(model, mesh, rules, desc="transformer", on_placed=account,
                                       checkpoint=os.path.join(tmp.name, "transformer"),
                                       loras=loras)
    else:
        placed = sharding.place_module(model, mesh, rules, desc="transformer", on_placed=account)
    seconds = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    after = placement.per_device_bytes()
    devices = jax.devices()
    dev0, others = peaks[devices[0]], [peaks[d] for d in devices[1:]]
    path = ("legacy t2j_copy + device_put" if args.legacy else
            "streamed from safetensors slices (checkpoint=)" if args.from_checkpoint else
            "streamed from host tensors (place_module)")
    if args.from_checkpoint and loras:
        path += f", rank-{args.lora_rank} LoRA fused per slice"
    print(f"== Placement, {path}: {os.path.basename(args.config)} random bf16 weights, "
          f"{len(devices)} CPU devices, dp{args.dp} x tp{args.tp} (CPU figures, not TPU) ==")
    print(f"weight bytes W:                     {weight_bytes / GB:8.3f} GB")
    print(f"host RSS before placement:          {before / weight_bytes:8.2f} x W")
    print(f"host RSS peak during placement:     {sampler.peak / weight_bytes:8.2f} x W")
    print(f"sum over devices after placement:   {sum(after.values()) / weight_bytes:8.2f} x W "
          "(CPU devices live in host RAM)")
    print(f"peak bytes on device 0:             {dev0 / weight_bytes:8.3f} x W")
    print(f"peak bytes, median other device:    {statistics.median(others) / weight_bytes:8.3f}"
          " x W")
    print(f"device 0 / median other device:     {dev0 / statistics.median(others):8.2f}")
    if args.from_checkpoint:
        print(f"bytes read from the checkpoint:     {placed['bytes_read'] / weight_bytes:8.2f} x W")
        print(f"host RSS peak minus device bytes:   "
              f"{(sampler.peak - sum(after.values())) / weight_bytes:8.2f} x W "
              "(what the host holds besides the CPU devices' arrays)")
    if args.from_checkpoint and loras:
        print(f"LoRA file (bf16) / load + convert:  {lora_bytes / GB:8.3f} GB / {lora_s:.2f} s "
              "(before placement, in the RSS before it)")
    print(f"placement time:                     {seconds:8.2f} s "
          f"({weight_bytes / seconds / GB:.2f} GB/s host -> CPU devices)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
