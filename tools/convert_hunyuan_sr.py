"""Convert an official HunyuanVideo-1.5 SR transformer folder to a diffusers-format folder.

Run offline, once per SR version. The official release (``hf download tencent/HunyuanVideo-1.5``,
Tencent-Hunyuan/HunyuanVideo-1.5 @ 60783e7 ``checkpoints-download.md``) keeps the SR DiTs in
the original class's names: ``transformer/720p_sr_distilled/`` and
``transformer/1080p_sr_distilled/``, each a diffusers ``ModelMixin`` folder of
``HunyuanVideo_1_5_DiffusionTransformer`` (``config.json`` with that class's constructor
arguments, ``diffusion_pytorch_model*.safetensors``, sharded with a
``diffusion_pytorch_model.safetensors.index.json`` when large), which the official pipeline
reads with ``from_pretrained`` (hyvideo/pipelines/hunyuan_video_pipeline.py:1416-1421). No
diffusers-format SR transformer is published. This writes one: ``config.json`` +
``diffusion_pytorch_model.safetensors`` for diffusers' ``HunyuanVideo15Transformer3DModel``,
loadable with its ``from_pretrained``.

Names: the full table of diffusers' own conversion script (``families.hunyuan_keys``, from
huggingface/diffusers @ 9cc3601, ``scripts/convert_hunyuan_video1_5_to_diffusers.py``),
the same code path as ``--lora``'s official keys. Config: ``diffusers_config`` below, field by
field. Tensors are copied bit for bit in their stored dtype (the refiner's fused qkv chunked,
the final modulation's halves swapped, as the script does).

Refused, one line on stderr, exit 2, before any tensor data is read and with nothing
written: a missing or unreadable folder, config or safetensors file; pickle weights; a config
field diffusers' class cannot represent (``guidance_embed`` true: it has no guidance embedder;
single-stream blocks; another text/vision projection, activation or norm; sparse
``flex-block-attn`` attention; an unknown field); an official tensor the table does not map
(diffusers' script would drop it silently); a diffusers parameter no tensor fills; a shape
that does not match; an output folder that is not empty.

Usage:
    python tools/convert_hunyuan_sr.py --input ckpts/transformer/720p_sr_distilled \\
        --output ckpts-diffusers/transformer-720p_sr_distilled
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
from diffusers import HunyuanVideo15Transformer3DModel  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tiny_checkpoint import write_atomically  # noqa: E402  (tools/, beside this script)

from engine.run.errors import UsageError  # noqa: E402
from families import hunyuan_keys  # noqa: E402

PROG = "convert_hunyuan_sr.py"
OFFICIAL_CLASS = "HunyuanVideo_1_5_DiffusionTransformer"
WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX = WEIGHTS + ".index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# The official constructor's defaults (hunyuanvideo_1_5_transformer.py:350-384): a field the
# config leaves out takes these, as the official from_pretrained does.
OFFICIAL_DEFAULTS = {
    "patch_size": [1, 2, 2], "in_channels": 4, "concat_condition": True, "out_channels": None,
    "hidden_size": 3072, "heads_num": 24, "mlp_width_ratio": 4.0, "mlp_act_type": "gelu_tanh",
    "mm_double_blocks_depth": 20, "mm_single_blocks_depth": 40, "rope_dim_list": [16, 56, 56],
    "qkv_bias": True, "qk_norm": True, "qk_norm_type": "rms", "guidance_embed": False,
    "use_meanflow": False, "text_projection": "single_refiner", "use_attention_mask": True,
    "text_states_dim": 4096, "text_states_dim_2": 768, "text_pool_type": None,
    "rope_theta": 256, "attn_mode": "flash", "attn_param": None, "glyph_byT5_v2": False,
    "vision_projection": "none", "vision_states_dim": 1280,
    "is_reshape_temporal_channels": False, "use_cond_type_embedding": False,
    "ideal_resolution": None, "ideal_task": None,
}
# Fields diffusers' class hard-wires: the official value it must have, and why.
FIXED = {
    "mm_single_blocks_depth": (0, "diffusers' class has no single-stream blocks"),
    "guidance_embed": (False, "diffusers' class has no guidance embedder (guidance_in)"),
    "text_projection": ("single_refiner", "diffusers' class has only the token refiner"),
    "text_pool_type": (None, "diffusers' class has no pooled-text embedder (vector_in)"),
    "glyph_byT5_v2": (True, "diffusers' class always has the ByT5 projection"),
    "vision_projection": ("linear", "diffusers' class always has the image projection"),
    "use_cond_type_embedding": (True, "diffusers' class always has cond_type_embed"),
    "mlp_act_type": ("gelu_tanh", "diffusers' blocks use tanh-approximated GELU"),
    "qkv_bias": (True, "diffusers' attention projections have biases"),
    "qk_norm": (True, "diffusers' blocks always RMS-normalise q and k"),
    "qk_norm_type": ("rms", "diffusers' blocks always RMS-normalise q and k"),
    "use_attention_mask": (True, "diffusers' token refiner always masks the text padding"),
}
# Fields with no weights and no effect on diffusers' forward: read, not converted.
# text_states_dim_2 sizes only vector_in (absent: text_pool_type is None); attn_mode and
# attn_param pick the official attention kernel (dense ones only, see _check_fields);
# concat_condition and is_reshape_temporal_channels only size the patch embedding, whose width
# is read from the weight and checked against them.
IGNORED = frozenset({"text_states_dim_2", "attn_mode", "attn_param", "concat_condition",
                     "is_reshape_temporal_channels"})
# The SR pipeline's SizeMap (hunyuan_video_sr_pipeline.py:74-78); diffusers' script uses the
# same 480p -> 640 and 720p -> 960 for its target_size (TRANSFORMER_CONFIGS).
TARGET_SIZE = {"480p": 640, "720p": 960, "1080p": 1440}
BYT5_DIM = 1472  # ByT5Mapper(in_dim=1472), fixed in the official class (:406-413)
REFINER_DEPTH = 2  # SingleTokenRefiner(depth=2), fixed in the official class (:448-455)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True,
                   help="official transformer folder, e.g. ckpts/transformer/720p_sr_distilled")
    p.add_argument("--output", required=True, help="new diffusers-format folder to write")
    return p.parse_args(argv)


def read_config(folder: str) -> dict:
    """The official ``config.json``, its missing fields filled with the official defaults.

    Raises:
        UsageError: no folder, no or unreadable config, another ``_class_name``.
    """
    if not os.path.isdir(folder):
        raise UsageError(f"--input={folder!r}: not a folder")
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--input={folder!r}: config.json unreadable ({first(e)})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--input={folder!r}: config.json is not a JSON object")
    name = config.get("_class_name", OFFICIAL_CLASS)
    if name != OFFICIAL_CLASS:
        raise UsageError(f"config.json _class_name={name!r}: expected {OFFICIAL_CLASS!r} "
                         "(an official transformer folder)")
    return {**OFFICIAL_DEFAULTS, **config}


def first(error: BaseException) -> str:
    """The first line of an error's text, short."""
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


def weight_files(folder: str) -> list:
    """The folder's ``diffusion_pytorch_model*.safetensors`` (the names diffusers' script globs),
    checked against the shard index when there is one.

    Raises:
        UsageError: pickle files, no safetensors, or shards that disagree with the index.
    """
    names = sorted(os.listdir(folder))
    pickled = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickled:
        raise UsageError(f"--input={folder!r}: pickle weights ({pickled[0]}); refusing them: "
                         "safetensors only")
    files = sorted(glob.glob(os.path.join(folder, "diffusion_pytorch_model*.safetensors")))
    if not files:
        raise UsageError(f"--input={folder!r}: no diffusion_pytorch_model*.safetensors")
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                shards = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"--input={folder!r}: {INDEX} unreadable ({first(e)})") from None
        found = {os.path.basename(p) for p in files}
        if shards != found:
            raise UsageError(f"--input={folder!r}: {INDEX} lists {sorted(shards)[:4]}, the "
                             f"folder has {sorted(found)[:4]}")
    return files


def read_headers(files: list) -> dict:
    """{official key: (file, shape)} from the safetensors headers (no tensor data read).

    Raises:
        UsageError: an unreadable or damaged file, a key in two files, a non-float tensor.
    """
    shapes = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                entries = [(k, tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype())
                           for k in f.keys()]
        except Exception as e:  # safetensors raises its own error types for damaged headers
            raise UsageError(f"weights={path!r}: not a readable safetensors file "
                             f"({first(e)})") from None
        for key, shape, dtype in entries:
            if key in shapes:
                raise UsageError(f"weights={path!r}: {key} is also in {shapes[key][0]!r}")
            if dtype not in ("F32", "F16", "BF16"):
                raise UsageError(f"weights={path!r}: {key} has dtype {dtype}, expected a float")
            shapes[key] = (path, shape)
    return shapes


def _check_fields(config: dict) -> None:
    """Refuse the fields diffusers' class cannot represent (see FIXED) and unknown ones."""
    known = set(OFFICIAL_DEFAULTS) | IGNORED
    unknown = sorted(k for k in config if k not in known and not k.startswith("_"))
    if unknown:
        raise UsageError(f"config.json {unknown[0]}={config[unknown[0]]!r}: not a field of "
                         f"{OFFICIAL_CLASS} @ 60783e7; refusing to guess what it changes")
    for field, (value, why) in FIXED.items():
        if config[field] != value:
            raise UsageError(f"config.json {field}={config[field]!r}: expected {value!r} "
                             f"({why})")
    if config["attn_mode"] == "flex-block-attn":
        raise UsageError("config.json attn_mode='flex-block-attn': sparse (SSTA) attention; "
                         "diffusers' class computes dense attention")
    resolution = config["ideal_resolution"]
    if resolution not in TARGET_SIZE:
        raise UsageError(f"config.json ideal_resolution={resolution!r}: expected one of "
                         f"{sorted(TARGET_SIZE)} (the SR output size is read from it)")
    if config["ideal_task"] not in (None, "t2v", "i2v"):
        raise UsageError(f"config.json ideal_task={config['ideal_task']!r}: expected None, "
                         "'t2v' or 'i2v'")


def _patch(config: dict) -> tuple:
    """(patch_size_t, patch_size) from the official [t, h, w] patch.

    Raises:
        UsageError: not three positive integers, or h != w (diffusers' patch is square).
    """
    patch = config["patch_size"]
    if (not isinstance(patch, list) or len(patch) != 3
            or not all(isinstance(p, int) and p > 0 for p in patch) or patch[1] != patch[2]):
        raise UsageError(f"config.json patch_size={patch!r}: expected [t, p, p], positive "
                         "integers (diffusers' class takes one spatial patch size)")
    return patch[0], patch[1]


def _channels(config: dict, shapes: dict, volume: int) -> tuple:
    """(in_channels, out_channels) of diffusers' class: the patch embedding's input width read
    from ``img_in.proj.weight`` (checked against the official rule, embed_layers.py:56-62:
    ``2n + 1`` with concat_condition, ``n + n // 2 + 1`` when also
    is_reshape_temporal_channels, else ``n``) and the official ``out_channels`` (``in_channels``
    when None, :390), checked against ``final_layer.linear.weight``.

    Raises:
        UsageError: a missing weight or a width that disagrees with the config.
    """
    for key in ("img_in.proj.weight", "final_layer.linear.weight"):
        if key not in shapes or len(shapes[key][1]) < 2:
            raise UsageError(f"weights: {key} missing or not a matrix; cannot read the widths")
    n = config["in_channels"]
    if config["concat_condition"]:
        expected = n + n // 2 + 1 if config["is_reshape_temporal_channels"] else 2 * n + 1
    else:
        expected = n
    width = shapes["img_in.proj.weight"][1][1]
    if width != expected:
        raise UsageError(f"img_in.proj.weight has {width} input channels; config.json "
                         f"in_channels={n}, concat_condition={config['concat_condition']} "
                         f"give {expected}")
    out = n if config["out_channels"] is None else config["out_channels"]
    rows = shapes["final_layer.linear.weight"][1][0]
    if rows != out * volume:
        raise UsageError(f"final_layer.linear.weight has {rows} rows; out_channels={out} x "
                         f"patch volume {volume} give {out * volume}")
    return width, out


def diffusers_config(config: dict, shapes: dict) -> dict:
    """``HunyuanVideo15Transformer3DModel`` arguments for an official config (defaults filled)
    and its weights' shapes. The field mapping follows diffusers' class and conversion script
    (huggingface/diffusers @ 9cc3601): heads_num -> num_attention_heads, hidden_size / heads_num
    -> attention_head_dim, mm_double_blocks_depth -> num_layers, mlp_width_ratio -> mlp_ratio,
    text_states_dim -> text_embed_dim, vision_states_dim -> image_embed_dim, rope_dim_list ->
    rope_axes_dim, rope_theta, use_meanflow; ideal_resolution -> target_size (480p 640, 720p 960
    as the script's TRANSFORMER_CONFIGS, 1080p 1440 from the SR pipeline's SizeMap);
    ideal_task -> task_type (None: the class default "i2v"; diffusers' class and pipelines
    store it without reading it); text_embed_2_dim 1472 and num_refiner_layers 2 (fixed in the
    official class).

    Raises:
        UsageError: see FIXED, ``_patch``, ``_channels``; hidden_size not a multiple of heads_num.
    """
    _check_fields(config)
    pt, p = _patch(config)
    in_channels, out_channels = _channels(config, shapes, pt * p * p)
    hidden, heads = config["hidden_size"], config["heads_num"]
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0
            and hidden % heads == 0):
        raise UsageError(f"config.json hidden_size={hidden!r}, heads_num={heads!r}: expected "
                         "positive integers, hidden_size a multiple of heads_num")
    rope = config["rope_dim_list"]
    if not isinstance(rope, list) or sum(rope) != hidden // heads:
        raise UsageError(f"config.json rope_dim_list={rope!r}: expected dims summing to the head "
                         f"dimension {hidden // heads} (the official class raises too)")
    return {
        "in_channels": in_channels, "out_channels": out_channels,
        "num_attention_heads": heads, "attention_head_dim": hidden // heads,
        "num_layers": config["mm_double_blocks_depth"], "num_refiner_layers": REFINER_DEPTH,
        "mlp_ratio": float(config["mlp_width_ratio"]), "patch_size": p, "patch_size_t": pt,
        "qk_norm": "rms_norm", "text_embed_dim": config["text_states_dim"],
        "text_embed_2_dim": BYT5_DIM, "image_embed_dim": config["vision_states_dim"],
        "rope_theta": float(config["rope_theta"]),
        "rope_axes_dim": tuple(config["rope_dim_list"]),
        "target_size": TARGET_SIZE[config["ideal_resolution"]],
        "task_type": config["ideal_task"] or "i2v",
        "use_meanflow": bool(config["use_meanflow"]),
    }


def plan(shapes: dict) -> dict:
    """{diffusers key: (official key, row operation, piece, pieces, shape)} for every official
    tensor.

    Raises:
        UsageError: official keys outside the table (listed, none dropped), rows that do not
            split, two official keys for one diffusers tensor.
    """
    out, leftover = {}, []
    for key in sorted(shapes):
        found = hunyuan_keys.diffusers_name(key)
        if found is None:
            leftover.append(key)
            continue
        targets, op = found
        try:
            pieces = hunyuan_keys.row_shapes(shapes[key][1], op, len(targets))
        except ValueError as e:
            raise UsageError(f"weights: {key}: {e}") from None
        for i, (target, shape) in enumerate(zip(targets, pieces, strict=True)):
            if target in out:
                raise UsageError(f"weights: {key} and {out[target][0]} both map to {target}")
            out[target] = (key, op, i, len(targets), shape)
    if leftover:
        raise UsageError(f"weights: {len(leftover)} official tensor(s) diffusers' class has no "
                         f"place for ({', '.join(leftover[:4])}); refusing rather than "
                         "dropping them")
    return out


def check_model(config: dict, planned: dict) -> None:
    """Every parameter of ``HunyuanVideo15Transformer3DModel(**config)`` (built on the meta
    device: no memory) filled by exactly one planned tensor of its shape.

    Raises:
        UsageError: missing, unexpected or mis-shaped tensors (the first few named).
    """
    try:
        with torch.device("meta"):
            model = HunyuanVideo15Transformer3DModel(**config)
    except (TypeError, ValueError, RuntimeError) as e:  # e.g. a depth that is not an integer
        raise UsageError(f"config.json: diffusers' class rejects the converted config "
                         f"({first(e)})") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(planned))
    if missing:
        raise UsageError(f"weights: {len(missing)} diffusers parameter(s) no official tensor "
                         f"fills ({', '.join(missing[:4])})")
    extra = sorted(set(planned) - set(expected))
    if extra:
        names = ", ".join(f"{planned[k][0]} -> {k}" for k in extra[:3])
        raise UsageError(f"weights: {len(extra)} tensor(s) the config's model has no place "
                         f"for ({names})")
    for key, (official, _, _, _, shape) in sorted(planned.items()):
        if shape != expected[key]:
            raise UsageError(f"weights: {official} gives {key} the shape {shape}, the "
                             f"config's model has {expected[key]}")


def convert(shapes: dict, planned: dict) -> dict:
    """{diffusers key: tensor}, each official tensor read once, in its stored dtype."""
    by_official = {}
    for target, (key, op, i, n, _) in planned.items():
        by_official.setdefault(key, []).append((i, target, op, n))
    out = {}
    for path in sorted({p for p, _ in shapes.values()}):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                targets = sorted(by_official[key])
                _, _, op, n = targets[0]
                pieces = hunyuan_keys.row_blocks(f.get_tensor(key), op, n)
                for (_, target, _, _), piece in zip(targets, pieces, strict=True):
                    # chunks are views of one storage, which safetensors will not save
                    out[target] = piece.contiguous().clone() if op else piece
    return out


def run(args: argparse.Namespace) -> str:
    """Validate everything, then convert and write; returns the output path.

    Raises:
        UsageError: any refusal (see the module docstring).
    """
    src, out = os.path.abspath(args.input), os.path.abspath(args.output)
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise UsageError(f"--output={args.output!r}: exists and is not an empty folder")
    official = read_config(src)
    shapes = read_headers(weight_files(src))
    config = diffusers_config(official, shapes)
    planned = plan(shapes)
    check_model(config, planned)
    tensors = convert(shapes, planned)

    def save(folder):
        with torch.device("meta"):
            HunyuanVideo15Transformer3DModel(**config).save_config(folder)
        save_file(tensors, os.path.join(folder, WEIGHTS), metadata={"format": "pt"})

    if os.path.isdir(out):
        os.rmdir(out)  # empty (checked above): write_atomically renames a new folder here
    write_atomically(save, out, force=False, prefix=".convert-hunyuan-sr-", marker="config.json")
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        out = run(args)
    except UsageError as e:
        print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"diffusers-format transformer written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
