"""Time of the checkpoint check (``engine/files/integrity.py``) on the real Wan 2.1 14B layout.

Writes, into a temporary folder, a checkpoint with the real tensor names and shapes and
sparse data (the header, then ``truncate`` to the full size: ~80 GB apparent, a few MB on
disk), then times ``integrity.check_checkpoint`` for ``--stage all`` over it, as a run does
after flag validation:

* transformer: ``WanTransformer3DModel`` from ``configs/Wan-AI/Wan2.1-T2V-14B-Diffusers``
  (built with meta weights), float32, in 5 GB shards with an index, as ``save_pretrained``
  shards it;
* VAE: ``AutoencoderKLWan`` from the same configs, float32, one file;
* text encoder: ``UMT5EncoderModel`` with google/umt5-xxl's encoder sizes (d_model 4096,
  d_ff 10240, 24 layers, 64 heads, vocabulary 256,384; no config of it is shipped here),
  float32, 5 GB shards with an index.

It prints the apparent bytes, files and tensors, then the check's time: the first call in
the process (with flag validation; diffusers and transformers are already imported by the
writer, a run imports them inside the check) and the median of ``--repeats`` further
calls. The headers are in the page cache after writing; on a cold disk each file costs one
more small read (one per shard).

Example (figures in README, "Checkpoint check"):
    python benchmarks/checkpoint_check.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import struct
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
CONFIGS = os.path.join(ROOT, "configs", "Wan-AI", "Wan2.1-T2V-14B-Diffusers")
SHARD_BYTES = 5 * 10**9
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                num_heads=64, relative_attention_num_buckets=32,
                relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                tie_word_embeddings=False)


def write_sparse(path: str, tensors: dict) -> int:
    """A safetensors file of ``tensors`` ({name: shape}, float32) whose data is a hole.
    Returns its size in bytes."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors.items():
        n = math.prod(shape) * 4
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)
    return 8 + len(blob) + offset


def write_component(folder: str, tensors: dict, stem: str, shard: bool) -> tuple[int, int]:
    """Write ``tensors`` as one file or ``SHARD_BYTES`` shards plus an index; returns
    (bytes, files)."""
    os.makedirs(folder, exist_ok=True)
    groups, size = [[]], 0
    for name, shape in tensors.items():
        n = math.prod(shape) * 4
        if shard and groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    total, weight_map = 0, {}
    for i, names in enumerate(groups):
        file = (f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors" if shard
                else f"{stem}.safetensors")
        total += write_sparse(os.path.join(folder, file), {k: tensors[k] for k in names})
        weight_map.update({k: file for k in names})
    if shard:
        with open(os.path.join(folder, f"{stem}.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total, len(groups)


def build_checkpoint(root: str) -> dict:
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    shutil.copy(os.path.join(CONFIGS, "model_index.json"), root)
    stats = {}
    with init_empty_weights():
        models = {
            "transformer": WanTransformer3DModel.from_config(
                WanTransformer3DModel.load_config(CONFIGS, subfolder="transformer")),
            "vae": AutoencoderKLWan.from_config(
                AutoencoderKLWan.load_config(CONFIGS, subfolder="vae")),
            "text_encoder": UMT5EncoderModel(UMT5Config(**UMT5_XXL)),
        }
    for sub, model in models.items():
        folder = os.path.join(root, sub)
        model.save_config(folder) if sub != "text_encoder" else model.config.save_pretrained(
            folder)
        tensors = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if sub == "text_encoder":  # save_pretrained keeps one of the tied pair
            tensors.pop("encoder.embed_tokens.weight")
        stem = "model" if sub == "text_encoder" else "diffusion_pytorch_model"
        nbytes, files = write_component(folder, tensors, stem, shard=sub != "vae")
        stats[sub] = dict(bytes=nbytes, files=files, tensors=len(tensors))
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="wan14b-sparse-")
    try:
        stats = build_checkpoint(root)
        disk = sum(os.stat(os.path.join(d, f)).st_blocks * 512
                   for d, _, fs in os.walk(root) for f in fs)
        for sub, s in stats.items():
            print(f"{sub:<13} {s['bytes'] / 1e9:7.2f} GB apparent, {s['files']:3d} file(s), "
                  f"{s['tensors']:5d} tensors")
        print(f"total {sum(s['bytes'] for s in stats.values()) / 1e9:.2f} GB apparent, "
              f"{disk / 1e6:.1f} MB on disk")

        t0 = time.perf_counter()
        import generate_flax as gf
        from engine.files import integrity
        from families import FAMILIES

        config = gf.validate_args(gf.parse_args(["--model_id", root, "--output_dir",
                                                 os.path.join(root, "out")]))
        first = integrity.check_checkpoint(config, FAMILIES[config.model.family])
        first_s = time.perf_counter() - t0
        assert first["ran"] and sorted(first["components"]) == sorted(stats), first
        times = []
        for _ in range(args.repeats):
            family = FAMILIES[config.model.family]
            times.append(integrity.check_checkpoint(config, family)["seconds"])
        # diffusers and transformers are already imported (by the writer above); a run
        # imports them inside the check.
        print(f"check, first call in the process (flag validation + check): {first_s:.2f} s")
        print(f"check, median of {args.repeats} further calls: {statistics.median(times):.2f} s "
              f"(min {min(times):.2f}, max {max(times):.2f})")
    finally:
        shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
