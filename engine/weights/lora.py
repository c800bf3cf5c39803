"""LoRA fused at placement: each device's weight slice gets its own slice of the delta.

``--lora PATH[:SCALE]`` loads a LoRA whose keys the family's converter
(``ModelFamily.transformer.lora_state_dict``) turns into diffusers/PEFT keys
``transformer.<module>.lora_A/lora_B.weight``, ``lora_B.bias``. Wan's is diffusers 0.42.1's
``WanLoraLoaderMixin.lora_state_dict`` (diffusers/PEFT keys; the original/ComfyUI/lightx2v
keys ``diffusion_model.blocks.N...lora_down/lora_up``, ``alpha``, ``diff_b``; it folds
``alpha / rank`` into A and B, and keeps no ``.diff`` full weight delta except
``head.head.diff``, and no norm ``diff``/``diff_b``: what it drops, we drop too).
HunyuanVideo-1.5's is ``families.hunyuan_lora`` (official Tencent or diffusers/PEFT keys;
diffusers has no converter for it).

The fusing is ours. ``engine.weights.placement.place_from_safetensors`` reads every device's slice
``W[rows, cols]`` of a weight and, for a weight a LoRA touches, returns

    W[rows, cols] + sum over LoRAs of  scale * (alpha / r) * (B[rows] @ A[:, cols])

computed in float32 from the file's values and cast to the run dtype as the unfused weight
is; a bias slice gets ``scale * (alpha / r) * lora_B.bias[rows]``. This is what PEFT's
``merge`` does (``W + B @ A * scaling``, ``bias + lora_B.bias * scaling``) and what diffusers'
``fuse_lora(lora_scale=s)`` gives with ``scaling`` multiplied by ``s``. ``alpha / r`` is 1
unless the file carries diffusers' ``lora_adapter_metadata`` (PEFT's ``lora_alpha``, ``r``,
``alpha_pattern``, ``rank_pattern``, ``use_rslora``), as in diffusers' own loader. No host
holds a whole fused weight that its devices hold only parts of, and the step program is
unchanged: a LoRA costs placement time, not step time.

Errors are one line: a usage error (exit 2) from ``check_flags`` before any model loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re

import torch

from engine.files.checkpoint import expert_count, read_component_config, read_model_index
from engine.run.errors import fail

# Pickle-based checkpoint suffixes: refused outright (no pickle, ever).
PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin", ".pkl", ".pickle")
# ``<component>.<module>.<part>``: "transformer", or a host component the family names.
_KEY = re.compile(r"^(?P<component>[^.]+)\.(?P<module>.+)\.(?P<part>lora_A\.weight|"
                  r"lora_B\.weight|lora_B\.bias)$")


def parse_flag(value: str, flag: str = "--lora") -> tuple[str, float]:
    """``PATH[:SCALE]`` -> (path, scale); scale 1.0 when absent. A path that itself contains
    ':' works when the whole value names an existing file.

    Raises:
        UsageError: SCALE is not a finite number.
    """
    path, sep, tail = value.rpartition(":")
    if not sep or os.path.isfile(value) or "/" in tail:
        return value, 1.0
    try:
        scale = float(tail)
    except ValueError:
        fail(flag, value, f"SCALE {tail!r} after the last ':' must be a number "
             "(PATH[:SCALE], e.g. lora.safetensors:0.7)")
    if not math.isfinite(scale):
        fail(flag, value, "SCALE must be a finite number")
    return path, scale


def read_file(path: str, flag: str = "--lora") -> tuple[dict, dict]:
    """The file's tensors (``safetensors.torch.load_file``, never pickle) and its
    ``__metadata__``.

    Raises:
        UsageError: missing, a pickle suffix, or not a complete safetensors file.
    """
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    if path.lower().endswith(PICKLE_SUFFIXES):
        fail(flag, path, "pickled checkpoints are refused (no pickle); convert it to "
             ".safetensors")
    if not os.path.isfile(path):
        fail(flag, path, "file not found")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        fail(flag, path, f"not a readable safetensors file ({str(e).splitlines()[0][:160]})")
    return tensors, metadata


def _peft_scaling(metadata: dict, module: str, rank: int,
                  component: str = "transformer") -> float:
    """``lora_alpha / r`` for ``module`` of ``component`` from diffusers'
    ``lora_adapter_metadata`` (a PEFT ``LoraConfig``), as PEFT computes ``scaling``; 1.0
    without metadata (diffusers then sets alpha = rank)."""
    raw = metadata.get("lora_adapter_metadata")
    if not raw:
        return 1.0
    cfg = json.loads(raw)
    if "r" not in cfg:
        # diffusers' pipeline-level save_lora_weights packs each component's LoraConfig under
        # its prefix ("transformer.r", ...); the model-level save_lora_adapter does not.
        cfg = {k.removeprefix(f"{component}."): v for k, v in cfg.items()
               if k.startswith(f"{component}.")}

    def pattern(table, default):
        for key, value in (table or {}).items():
            if re.fullmatch(rf"(.*\.)?{key}", module):
                return value
        return default

    r = pattern(cfg.get("rank_pattern"), cfg.get("r", rank))
    alpha = pattern(cfg.get("alpha_pattern"), cfg.get("lora_alpha", r))
    return alpha / (math.sqrt(r) if cfg.get("use_rslora") else r)


@dataclasses.dataclass
class Lora:
    """One ``--lora`` file, its keys converted and matched to the transformer.

    weights: {weight name (``blocks.N.attn1.to_q.weight``): (A (r, in), B (out, r), factor)},
        A and B as the family's converter gave them (file dtype), factor = scale * alpha / r.
    biases: {bias name: (lora_B.bias (out,), factor)}.
    host: {host component (e.g. a text connector the family runs on the CPU): (its weights,
        its biases)} as ``weights`` / ``biases``; fused at load by ``fuse_host``.
    """

    path: str
    scale: float
    sha256: str
    keys: int
    converted_keys: int
    weights: dict
    biases: dict
    host: dict = dataclasses.field(default_factory=dict)

    def report(self) -> dict:
        """The JSON report's entry: path, sha256, scale, key counts and matched weights (the
        host components' included)."""
        host = sum(len(w) + len(b) for w, b in self.host.values())
        return dict(path=self.path, sha256=self.sha256, scale=self.scale, keys=self.keys,
                    converted_keys=self.converted_keys,
                    matched_weights=len(self.weights) + len(self.biases) + host)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def load(path: str, scale: float, shapes: dict, convert, flag: str = "--lora",
         host_shapes: dict | None = None) -> Lora:
    """Read, convert (the family's ``lora_state_dict``) and match one LoRA.

    Args:
        path: a .safetensors LoRA file.
        scale: the user's scale (``fuse_lora(lora_scale=...)``).
        shapes: {name: shape} of the transformer's unscanned state dict (``blocks.N.*``).
        convert: the family's key converter (``ModelFamily.transformer.lora_state_dict``).
        flag: the flag errors name (``--lora``, or ``--lora_2`` for the second expert).
        host_shapes: {component: {name: shape}} of the host components whose keys
            (``<component>.<module>...``) the file may also carry
            (``Transformer.lora_host_components``); None: transformer keys only.

    Raises:
        UsageError (one line, naming ``flag`` and the file): unreadable or pickle file, keys
        the converter rejects, keys that match no weight (the first three named), shapes that
        do not fit their weight.
    """
    tensors, metadata = read_file(path, flag)
    keys = len(tensors)
    try:
        converted = convert(dict(tensors))
    except (ValueError, KeyError, IndexError, RuntimeError) as e:
        fail(flag, path, "the LoRA key conversion rejects its keys "
             f"({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})")
    tables = {"transformer": shapes, **(host_shapes or {})}
    parts: dict = {}
    unmatched = []
    for key, value in converted.items():
        m = _KEY.match(key)
        table = tables.get(m["component"]) if m else None
        if table is None or f"{m['module']}.weight" not in table:
            unmatched.append(key)
            continue
        parts.setdefault(m["component"], {}).setdefault(m["module"], {})[m["part"]] = value
    if unmatched:
        fail(flag, path, f"{len(unmatched)} key(s) match no {' or '.join(tables)} weight "
             f"({', '.join(sorted(unmatched)[:3])}{', ...' if len(unmatched) > 3 else ''})")
    if "transformer" not in parts:
        fail(flag, path, "holds no LoRA weights for the transformer")
    matched = {component: _deltas(path, scale, flag, metadata, tables[component], p, component)
               for component, p in parts.items()}
    weights, biases = matched.pop("transformer")
    return Lora(path=path, scale=scale, sha256=_sha256(path), keys=keys,
                converted_keys=len(converted), weights=weights, biases=biases, host=matched)


def _deltas(path, scale, flag, metadata, shapes, parts, component) -> tuple[dict, dict]:
    """({weight name: (A, B, factor)}, {bias name: (lora_B.bias, factor)}) of one component's
    matched ``parts`` ({module: {part: tensor}}), shapes checked against ``shapes``."""
    weights, biases = {}, {}
    for module, p in sorted(parts.items()):
        w_shape = tuple(shapes[f"{module}.weight"])
        a, b = p.get("lora_A.weight"), p.get("lora_B.weight")
        if (a is None) != (b is None):
            fail(flag, path, f"{module} has only one of lora_A/lora_B")
        if a is not None:
            if len(w_shape) != 2 or a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] \
                    or (b.shape[0], a.shape[1]) != w_shape:
                fail(flag, path, f"{module}: lora_B {tuple(b.shape)} @ lora_A "
                     f"{tuple(a.shape)} does not fit its weight {w_shape}")
            factor = scale * _peft_scaling(metadata, module, a.shape[0], component)
            weights[f"{module}.weight"] = (a, b, factor)
        bias = p.get("lora_B.bias")
        if bias is not None:
            b_shape = shapes.get(f"{module}.bias")
            if b_shape is None or tuple(bias.shape) != tuple(b_shape):
                fail(flag, path, f"{module}: lora_B.bias {tuple(bias.shape)} does not fit "
                     f"its bias {b_shape}")
            rank = a.shape[0] if a is not None else 1
            biases[f"{module}.bias"] = (
                bias, scale * _peft_scaling(metadata, module, rank, component))
    return weights, biases


def transformer_shapes(transformer) -> dict:
    """{name: shape} of a (meta or real) transformer's parameters, unscanned names."""
    return {n: tuple(p.shape) for n, p in transformer.named_parameters()}


# The flag of each expert's LoRAs and the pipeline component it fuses into.
COMPONENTS = {"--lora": "transformer", "--lora_2": "transformer_2"}


@dataclasses.dataclass(frozen=True)
class LoraSet:
    """The LoRAs of one flag (``--lora`` or ``--lora_2``): loaded once, before any model
    loads, and fused into the matching expert's weight slices at placement (``fusers``).

    ``RunConfig`` carries one per flag; an empty set (no flag given) is falsy. Its tensors are
    CPU torch tensors of the file dtype, held until placement.
    """

    flag: str = "--lora"
    loras: tuple[Lora, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.loras)

    def __iter__(self):
        return iter(self.loras)

    @property
    def component(self) -> str:
        """The pipeline component it fuses into ("transformer" or "transformer_2")."""
        return COMPONENTS[self.flag]

    def specs(self) -> list:
        """[[path, scale], ...] as the run's settings record them."""
        return [[x.path, x.scale] for x in self.loras]

    def report(self) -> list:
        return [x.report() for x in self.loras]


def validate(values, family, model_id: str, dtype: str, flag: str = "--lora") -> LoraSet:
    """Parse, read and match every ``--lora`` (or ``--lora_2``) value before any model loads.

    ``--lora_2`` fuses into a two-expert checkpoint's ``transformer_2`` (the low-noise
    expert), as diffusers' ``load_lora_weights(..., load_into_transformer_2=True)``; its names
    and shapes are checked against ``transformer_2``'s config. The transformer's names and
    shapes come from a meta model of its config (``family.transformer.empty``: no weights
    load); the keys are converted by the family's converter
    (``family.transformer.lora_state_dict``). ``--lora`` also takes the keys of the host
    components the family names (``family.transformer.lora_host_components``: their meta
    models' shapes), which the family fuses at load (``fuse_host``).

    Returns:
        the ``LoraSet`` the run's configuration carries (empty without the flag).

    Raises:
        UsageError: see ``parse_flag`` and ``load``; a family without a LoRA loader;
            ``--lora_2`` for a checkpoint with one expert.
    """
    specs = tuple(parse_flag(v, flag) for v in values or ())
    if not specs:
        return LoraSet(flag)
    convert = family.transformer.lora_state_dict
    if convert is None:  # the family has no LoRA key converter
        fail(flag, values[0], f"LoRAs are not supported for {family.name} yet")
    component = COMPONENTS[flag]
    if component == "transformer_2" and expert_count(read_model_index(model_id)) != 2:
        fail(flag, values[0], "needs a two-expert checkpoint (transformer_2 and "
             "boundary_ratio in model_index.json); use --lora for the one transformer")
    cfg = read_component_config(model_id, component, download=True)
    shapes = transformer_shapes(family.transformer.empty(cfg, getattr(torch, dtype)))
    host = family.transformer.lora_host_components
    host_shapes = host(model_id, getattr(torch, dtype)) if host and flag == "--lora" else None
    return LoraSet(flag, tuple(load(path, scale, shapes, convert, flag, host_shapes)
                               for path, scale in specs))


def fuse_host(module, loras, component: str) -> int:
    """Fuse the LoRAs' deltas for host ``component`` into ``module`` (a torch module on the
    CPU, e.g. a pipeline's text connectors) in place: each touched parameter becomes
    ``W + sum scale * (alpha / r) * B @ A`` (a bias ``+ scale * (alpha / r) * lora_B.bias``),
    computed in float32 and cast back to the parameter's dtype, as PEFT's ``merge``.

    Args:
        module: the component's module; names as ``named_parameters`` gives them.
        loras: the run's ``LoraSet`` (or an iterable of ``Lora``; None: nothing).

    Returns:
        the number of parameters changed.
    """
    deltas: dict = {}
    for x in loras or ():
        weights, biases = x.host.get(component, ({}, {}))
        for name, (a, b, factor) in weights.items():
            deltas[name] = deltas.get(name, 0) + (b.float() @ a.float()) * factor
        for name, (vec, factor) in biases.items():
            deltas[name] = deltas.get(name, 0) + vec.float() * factor
    if not deltas:
        return 0
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, delta in deltas.items():
            p = params[name]
            p.copy_((p.float() + delta).to(p.dtype))
    return len(deltas)


def fusers(loras) -> dict:
    """{weight or bias name: f(index) -> float32 torch delta of that slice} summed over
    ``loras``; ``index`` is the device's tuple of slices (``make_array_from_callback``)."""
    terms: dict = {}
    for lora in loras:
        for name, term in lora.weights.items():
            terms.setdefault(name, []).append(("w", term))
        for name, term in lora.biases.items():
            terms.setdefault(name, []).append(("b", term))

    def make(items):
        def delta(index):
            out = None
            for kind, term in items:
                if kind == "w":
                    a, b, factor = term
                    d = (b[index[0]].float() @ a[:, index[1]].float()) * factor
                else:
                    vec, factor = term
                    d = vec[index[0]].float() * factor
                out = d if out is None else out + d
            return out if out is not None else torch.zeros(())

        return delta

    return {name: make(items) for name, items in terms.items()}


def touched_replicated(lora: Lora, specs: dict, stack) -> list:
    """Names (as placed) of the weights ``lora`` touches whose ``PartitionSpec`` replicates
    them on every device, so each chip holds the whole fused weight (the dry run lists
    them). ``stack``: the family's ``scan_layers.BlockStack`` (scanned names)."""
    layer = re.compile(rf"^{re.escape(stack.attr)}\.\d+\.(.+)$")
    out = set()
    for name in (*lora.weights, *lora.biases):
        m = layer.match(name)
        for placed in (name, stack.prefix + m[1] if m else None):
            if placed in specs and all(a is None for a in specs[placed]):
                out.add(placed)
    return sorted(out)
