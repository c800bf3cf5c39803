"""The text (and image) encoders' price per video, on the mesh and on the host (ESTIMATES).

What runs: the checkpoint's text stage, its ``weight_folders["text_encoder"]`` (the family's
own list: a text encoder, a second one, the text connectors, an I2V checkpoint's image
encoder), each built from its config with meta weights (no RAM for weights) and called as the
diffusers pipeline calls it, at the pipeline's padded length:

* text encoders: ``input_ids`` of (1, tokens) with ``output_hidden_states`` (no mask:
  ``encoder_inputs``); tokens = the run's ``max_sequence_length`` plus the prompt
  template's tokens the pipeline crops after the encode (``TEMPLATE_TOKENS``);
* an encoder listed in ``QUOTED_TEXT_ONLY`` runs only on a prompt that quotes text;
* a diffusers component of the text stage (text connectors) takes every hidden state of the
  text encoder stacked: (1, tokens, ``caption_channels`` x ``text_proj_in_factor``);
* an image encoder (a vision config) takes one image of its ``image_size``, only where the
  checkpoint conditions on an image.

Attention runs as plain matmuls (``attn_implementation="eager"``): the same FLOPs as SDPA,
and on the mesh every op visible to the roofline.

Two placements are priced:

* **mesh**: each encoder lowered through torchax on the dry run's mesh (weights sharded on
  their first dimension over every device where it divides, FSDP-like; inputs replicated)
  and compiled for the topology; its ops priced as the step's block is
  (``price_ops.program_summary``: roofline or HBM bytes per op, collectives at ICI egress).
  Kind "compiled estimate".
* **host**: the encoder's FLOPs at the padded length (torch's ``FlopCounterMode`` on the
  meta model: matmuls, convolutions and attention) / this host's bf16 matmul rate measured
  at the encoder's main linear shape (``price_host.matmul_rate``). Kind "host
  measurement" (the rate is measured; the FLOPs are counted).

Per video (warm): the prompt is encoded; the negative prompt, where CFG runs, is the same
text every video, so the per-text embedding cache holds it after the first video and it is
priced apart (``first_video_extra_s``), not in the whole video. An image is encoded every
video.
"""

from __future__ import annotations

import importlib
import re
import time

import jax
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch.utils.flop_counter import FlopCounterMode
from torchax import interop
from torchax.ops import mappings

from engine.dry_run import price_host
from engine.dry_run.price_ops import (
    BLOCK_NAME,
    block_hlo_text,
    device_ici_bytes_per_s,
    label,
    program_summary,
)
from engine.files.checkpoint import read_component_config, read_model_index

# Prompt-template tokens an encoder class runs on beyond ``max_sequence_length``: diffusers
# 0.42.1's HunyuanVideo-1.5 pipelines wrap the prompt in a chat template and crop its first
# 108 tokens after the Qwen2.5-VL encode (``prompt_template_encode_start_idx``), so the
# encoder sees 1,000 + 108 tokens.
TEMPLATE_TOKENS = {"Qwen2_5_VLTextModel": 108}
# Weight folders whose encoder runs only on a prompt that quotes text, at a fixed length:
# HunyuanVideo-1.5's ByT5 glyph encoder (``text_encoder_2``, 256 tokens; without a quote the
# pipeline passes zeros and makes no call). The quote pattern is the pipeline's
# (``extract_glyph_texts``).
QUOTED_TEXT_ONLY = {"text_encoder_2": 256}
QUOTE = re.compile(r"\"(.*?)\"|“(.*?)”")


def encoder_calls(config, family) -> list:
    """The encoder calls of one video: [dict(folder, cls, cfg, kind ("text", "connector" or
    "image"), tokens, per_video (True: every video; False: the negative prompt, cached after
    the first))], in the order the pipeline runs them. A folder without a config (the
    shipped real-size configs carry none) is left out and named in ``missing``.

    Returns:
        (calls, missing folder names).
    """
    model_id, v = config.model.model_id, config.video
    index = read_model_index(model_id)
    texts = [side for side, _ in family.text.prompt_sides(config)]
    image_mode = family.image.mode(model_id)
    with_image = image_mode == "required" or (image_mode == "optional" and v.image)
    calls, missing = [], []
    for folder in family.checkpoint.weight_folders.get("text_encoder", ()):
        lib, cls = (index.get(folder) or [None, None])[:2]
        if cls is None:
            continue
        cfg = read_component_config(model_id, folder)
        if cfg is None:
            missing.append(folder)
            continue
        vision = "vision_config" not in cfg and "image_size" in cfg
        if vision and not with_image:
            continue
        if vision:
            calls.append(dict(folder=folder, lib=lib, cls=cls, cfg=cfg, kind="image",
                              tokens=None, per_video=True))
            continue
        kind = "text" if lib == "transformers" else "connector"
        tokens = QUOTED_TEXT_ONLY.get(folder, v.max_sequence_length + TEMPLATE_TOKENS.get(cls, 0))
        for side in texts:
            text = v.prompt if side == "" else (v.negative_prompt or "")
            if folder in QUOTED_TEXT_ONLY and not QUOTE.search(text or ""):
                continue
            calls.append(dict(folder=folder, lib=lib, cls=cls, cfg=cfg, kind=kind,
                              tokens=tokens, per_video=side == ""))
    return calls, missing


def meta_encoder(call: dict, dtype):
    """The encoder of ``call`` with meta weights in ``dtype``, eager attention, eval mode."""
    from accelerate import init_empty_weights

    cfg = {k: v for k, v in call["cfg"].items() if not k.startswith("_")}
    with init_empty_weights():
        if call["lib"] == "transformers":
            import transformers

            cls = getattr(transformers, call["cls"])
            model_config = cls.config_class.from_dict(cfg)
            model_config._attn_implementation = "eager"
            for sub in ("text_config", "vision_config"):
                if getattr(model_config, sub, None) is not None:
                    getattr(model_config, sub)._attn_implementation = "eager"
            model = cls(model_config)
        else:
            module = importlib.import_module("diffusers" if call["lib"] == "diffusers"
                                             else f"diffusers.pipelines.{call['lib']}")
            model = getattr(module, call["cls"]).from_config(cfg)
    torch.nn.Module.to(model, dtype)
    return model.eval()


def encoder_inputs(call: dict, dtype) -> tuple:
    """(args, kwargs) of the encoder call as torch meta tensors (``pixel_values`` in
    ``dtype``; token ids and masks int64)."""
    cfg, n = call["cfg"], call["tokens"]
    if call["kind"] == "image":
        size = cfg["image_size"]
        return (), dict(pixel_values=torch.empty(1, 3, size, size, dtype=dtype, device="meta"),
                        output_hidden_states=True)
    mask = torch.empty(1, n, dtype=torch.int64, device="meta")
    if call["kind"] == "connector":
        width = cfg["caption_channels"] * cfg["text_proj_in_factor"]
        return (torch.empty(1, n, width, dtype=dtype, device="meta"), mask), {}
    # No attention mask for a text encoder: transformers tests a given mask's values
    # (``Tensor.all()``), which neither meta tensors nor a trace have, and a batch-1 call's
    # mask changes no matmul (the padded tokens are computed all the same).
    return (), dict(input_ids=torch.empty(1, n, dtype=torch.int64, device="meta"),
                    output_hidden_states=True)


def encoder_flops(call: dict, dtype=torch.bfloat16) -> float:
    """FLOPs of one encoder call (torch's ``FlopCounterMode`` on the meta model: matmuls,
    convolutions, attention; elementwise work is not counted)."""
    model = meta_encoder(call, dtype)
    args, kwargs = encoder_inputs(call, dtype)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(*args, **kwargs)
    return float(counter.get_total_flops())


def main_linear(model) -> tuple[int, int]:
    """(in_features, out_features) of the ``torch.nn.Linear`` shape holding the most weights
    of the model (all its layers of that shape together): the shape most of the encoder's
    FLOPs run at (Gemma 3 12B: its FFN's 3,840 x 15,360, not the 262,208-wide output head
    that runs once)."""
    weights = {}
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            key = (m.in_features, m.out_features)
            weights[key] = weights.get(key, 0) + m.in_features * m.out_features
    return max(weights, key=weights.get)


def _outputs(out) -> tuple:
    """The tensors the pipeline reads from an encoder's output: every hidden state where it
    has them, else its tensors."""
    if isinstance(out, (tuple, list)):
        return tuple(x for x in out if isinstance(x, torch.Tensor))
    states = getattr(out, "hidden_states", None)
    return tuple(states) if states else (out.last_hidden_state,)


def _weight_sharding(mesh, shape) -> NamedSharding:
    """Dim 0 over every mesh axis where it divides, else replicated."""
    axes, n = tuple(mesh.axis_names), mesh.devices.size
    if len(shape) >= 2 and shape[0] % n == 0:
        return NamedSharding(mesh, P(axes))
    return NamedSharding(mesh, P())


def mesh_seconds(call: dict, mesh, chip: str, dtype=torch.bfloat16) -> dict:
    """One encoder call compiled for the topology on ``mesh`` and priced (ESTIMATE): dict(
    seconds, linear_s, elementwise_s, collectives_s, compile_s)."""
    model = meta_encoder(call, dtype)
    args, kwargs = encoder_inputs(call, dtype)
    jm = interop.JittableModule(model)
    params = {k: jax.ShapeDtypeStruct(tuple(v.shape), mappings.t2j_dtype(v.dtype),
                                      sharding=_weight_sharding(mesh, v.shape))
              for k, v in jm.params.items()}
    rep = NamedSharding(mesh, P())
    buffers = {k: jax.ShapeDtypeStruct(tuple(v.shape), mappings.t2j_dtype(v.dtype), sharding=rep)
               for k, v in jm.buffers.items()}
    names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    flags = {k: v for k, v in kwargs.items() if k not in names}
    tensors = [*args, *(kwargs[k] for k in names)]
    abstract = [jax.ShapeDtypeStruct(tuple(t.shape), mappings.t2j_dtype(t.dtype), sharding=rep)
                for t in tensors]

    def encode(params, buffers, *values):
        def call_model(m, *vals):
            pos = vals[:len(args)]
            kw = dict(zip(names, vals[len(args):], strict=True), **flags)
            return _outputs(m(*pos, **kw))
        return jm.functional_call(call_model, params, buffers, *values)

    # The name holds BLOCK_NAME: where jaxlib cannot read the compiled HLO back (tpu7x),
    # ``block_hlo_text`` reads libtpu's dump, which keeps that name's modules only.
    def estimate_block_text_encoder(*a):
        return interop.jax_view(encode)(*a)

    assert BLOCK_NAME in estimate_block_text_encoder.__name__
    t0 = time.perf_counter()
    compiled = jax.jit(estimate_block_text_encoder).lower(params, buffers, *abstract).compile()
    compile_s = time.perf_counter() - t0
    s = program_summary(block_hlo_text(compiled), chip, exclude=())
    collectives_s = s["collective_sent_bytes"] / device_ici_bytes_per_s(chip)
    return dict(seconds=s["linear_s"] + s["other_hbm_floor_s"] + collectives_s,
                linear_s=s["linear_s"], elementwise_s=s["other_hbm_floor_s"],
                collectives_s=collectives_s, compile_s=compile_s)


def price_text(config, family, mesh, chip: str, *, rate_seconds: float = 1.0) -> dict:
    """The text stage of one video priced both ways (see the module docstring).

    Returns:
        dict(mesh=part, host=part, encoders=[per call: folder, class, kind, tokens,
        per_video, flops, mesh_s, host_s], missing=[folders without a config]); each part
        dict(seconds (per video, warm: the negative cached), kind, first_video_extra_s
        (the negative prompt's encode, first video only), label) and, for the host part,
        the measured ``rates`` ({"k x n": matmul_rate's dict}).
    """
    dtype = getattr(torch, config.model.dtype)
    calls, missing = encoder_calls(config, family)
    rates, encoders, priced = {}, [], {}
    for call in calls:
        same = (call["folder"], call["tokens"])  # the negative's call is the prompt's again
        if same not in priced:
            k, n = main_linear(meta_encoder(call, dtype))
            rows = call["tokens"] or (call["cfg"]["image_size"] // call["cfg"]["patch_size"]) ** 2
            key = f"{rows} x {k} x {n}"
            if key not in rates:
                rates[key] = price_host.matmul_rate(rows, k, n, dtype=dtype,
                                                    seconds=rate_seconds)
            flops = encoder_flops(call, dtype)
            priced[same] = dict(flops=flops, mesh=mesh_seconds(call, mesh, chip, dtype),
                                host_rate=key, host_s=flops / rates[key]["flops_per_s"])
        p = priced[same]
        encoders.append(dict(folder=call["folder"], cls=call["cls"], kind=call["kind"],
                             tokens=call["tokens"], per_video=call["per_video"],
                             mesh_s=p["mesh"]["seconds"], **p))

    def part(field: str, kind: str, lab: str) -> dict:
        return dict(seconds=sum(e[field] for e in encoders if e["per_video"]), kind=kind,
                    first_video_extra_s=sum(e[field] for e in encoders if not e["per_video"]),
                    label=lab)

    host = part("host_s", "host measurement",
                "encoder FLOPs (counted) / this host's bf16 matmul rate (measured)")
    host["rates"] = rates
    return dict(mesh=part("mesh_s", "compiled estimate", label(chip)), host=host,
                encoders=encoders, missing=missing)
