"""Random Wan LoRA files in the key formats diffusers' ``WanLoraLoaderMixin`` reads, for tests
and benchmarks (the public distill LoRAs cannot be downloaded here).

``write_lora(path, cfg, fmt=...)`` writes one ``.safetensors`` for a ``WanTransformer3DModel``
config ``cfg``:

- "original": the original Wan / ComfyUI / lightx2v layout,
  ``diffusion_model.blocks.N.{self_attn,cross_attn}.{q,k,v,o}.lora_down/lora_up.weight``,
  ``ffn.{0,2}``, an ``alpha`` per module (alpha / rank != 1, so the scaling is exercised),
  ``diff_b`` bias deltas on q and ffn.0, and a zero norm ``diff`` that diffusers drops.
- "peft": diffusers/PEFT keys ``transformer.blocks.N.attn{1,2}.<proj>.lora_A/lora_B.weight``
  with ``lora_B.bias`` on to_q (PEFT's ``lora_bias``).

Usage: python tools/tiny_lora.py --model_id CHECKPOINT --output lora.safetensors --rank 4
"""

from __future__ import annotations

import argparse
import json
import os

ATTN = (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("o", "to_out.0"))


def write_lora(path: str, cfg: dict, *, fmt: str = "original", rank: int = 4, seed: int = 0,
               std: float = 0.5, dtype=None, layers=None) -> dict:
    """Write a random LoRA for config ``cfg``; returns the tensors written.

    A ~ N(0, std / sqrt(in)), B ~ N(0, std / sqrt(rank)): each delta is of the order of
    ``std`` times a unit-variance projection, enough to change a tiny model's video clearly.
    ``layers``: block indices (default all); ``dtype``: torch dtype (default float32).
    """
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    ffn = cfg["ffn_dim"]
    shapes = {"attn": (dim, dim), "ffn.0": (ffn, dim), "ffn.2": (dim, ffn)}

    def pair(out_f, in_f):
        a = torch.randn(rank, in_f, generator=g) * (std / in_f ** 0.5)
        b = torch.randn(out_f, rank, generator=g) * (std / rank ** 0.5)
        return a.to(dtype), b.to(dtype)

    def vec(n):
        return (torch.randn(n, generator=g) * 0.05).to(dtype)

    out = {}
    for i in range(cfg["num_layers"]) if layers is None else layers:
        if fmt == "original":
            pre = f"diffusion_model.blocks.{i}"
            mods = [(f"{pre}.{kind}.{o}", shapes["attn"]) for kind in ("self_attn", "cross_attn")
                    for o, _ in ATTN]
            mods += [(f"{pre}.ffn.0", shapes["ffn.0"]), (f"{pre}.ffn.2", shapes["ffn.2"])]
            for name, (o_f, i_f) in mods:
                out[f"{name}.lora_down.weight"], out[f"{name}.lora_up.weight"] = pair(o_f, i_f)
                out[f"{name}.alpha"] = torch.tensor(2.0 * rank, dtype=dtype)
            out[f"{pre}.self_attn.q.diff_b"] = vec(dim)
            out[f"{pre}.ffn.0.diff_b"] = vec(ffn)
            out[f"{pre}.self_attn.norm_q.diff"] = torch.zeros(dim, dtype=dtype)
        elif fmt == "peft":
            pre = f"transformer.blocks.{i}"
            mods = [(f"{pre}.attn{n}.{proj}", shapes["attn"]) for n in (1, 2)
                    for _, proj in ATTN]
            mods += [(f"{pre}.ffn.net.0.proj", shapes["ffn.0"]),
                     (f"{pre}.ffn.net.2", shapes["ffn.2"])]
            for name, (o_f, i_f) in mods:
                out[f"{name}.lora_A.weight"], out[f"{name}.lora_B.weight"] = pair(o_f, i_f)
                out[f"{name}.lora_B.bias"] = vec(o_f)
        else:
            raise ValueError(f"unknown LoRA format {fmt!r}")
    save_file(out, path)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_id", required=True, help="diffusers Wan folder (its transformer "
                   "config is read)")
    p.add_argument("--output", required=True)
    p.add_argument("--format", choices=("original", "peft"), default="original")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    with open(os.path.join(a.model_id, "transformer", "config.json")) as f:
        cfg = json.load(f)
    write_lora(a.output, cfg, fmt=a.format, rank=a.rank, seed=a.seed)
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
