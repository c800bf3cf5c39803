"""Sharding rules to ``PartitionSpec``s to weights streamed into their shards.

A family gives a rule table, ((regex on the state-dict name, spec tuple), ...), first match
wins; ``sharding_specs`` turns it into a spec per weight for a mesh, and ``place_module``
streams every weight into its ``NamedSharding`` (``engine.weights.placement``), from the module's
torch tensors or straight from the checkpoint's safetensors files.
"""

from __future__ import annotations

import logging
import math
import re
import time

import jax
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop
from torchax.ops import mappings

import custom_splash_attention as csa
from engine.files.checkpoint import component_folder
from engine.run.errors import GenerationError
from engine.weights import lora, placement, quantize, scan_layers

log = logging.getLogger("generate_flax")


class Fallbacks:
    """Every silent fallback made loud: each distinct one is logged once as a warning and
    listed in the JSON report's ``fallbacks``.

    Call it as ``fallbacks(kind, detail)``; kinds: "attention_to_xla" (a call the Splash
    wrapper cannot split), "weight_replicated" (a rule the mesh cannot divide),
    "vae_decode_replicated" (a latent width the devices do not divide).
    """

    def __init__(self):
        self.items: list[dict] = []

    def __call__(self, kind: str, detail: str) -> None:
        item = dict(kind=kind, detail=detail)
        if item not in self.items:
            self.items.append(item)
            log.warning("fallback (%s): %s", kind, detail)


def sharding_specs(names_shapes: dict, rules, mesh, *, fsdp: bool = False):
    """Map parameter names to ``PartitionSpec`` by the first matching rule.

    Args:
        names_shapes: {name: shape}.
        rules: ((regex, spec tuple), ...); an entry is None, a mesh axis name or a tuple of
            names (the dimension split over their product, e.g. ("tp", "sp")).
        mesh: the mesh; a rule whose axis size does not divide its dimension is not applied.
        fsdp: also shard every weight of 2+ dims over the mesh axes its rule leaves unused,
            on its largest dimension that they divide (GSPMD all-gathers it before use).

    Returns:
        ({name: PartitionSpec}, {regex: matched parameter count}, [unmatched names]).
    """
    specs, counts, unmatched = {}, {rx: 0 for rx, _ in rules}, []
    for name, shape in names_shapes.items():
        axes = (None,) * len(shape)
        for rx, rule_axes in rules:
            if re.search(rx, name):
                if all(a is None or shape[i] % _axes_size(mesh, a) == 0
                       for i, a in enumerate(rule_axes)):
                    axes = tuple(rule_axes) + (None,) * (len(shape) - len(rule_axes))
                    counts[rx] += int(math.prod(shape))
                break
        else:
            unmatched.append(name)
        if fsdp and len(shape) >= 2:
            used = {x for a in axes if a is not None for x in (a if isinstance(a, tuple) else (a,))}
            free = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
            size = math.prod(mesh.shape[a] for a in free)
            free_dims = [d for d in range(len(shape)) if axes[d] is None]
            for d in sorted(free_dims, key=lambda d: -shape[d]):
                if free and shape[d] % size == 0:
                    axes = axes[:d] + (free,) + axes[d + 1:]
                    break
        specs[name] = P(*axes)
    return quantize.scale_specs(specs), counts, unmatched


def _axes_size(mesh, axes) -> int:
    """Devices a spec entry splits over: one mesh axis's size, or a tuple's product."""
    return math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def module_sharding_specs(module, names_shapes: dict, rules, mesh, *, fsdp: bool = False):
    """``sharding_specs`` for a module's weights; for blocks stacked by ``--scan_layers`` the
    per-layer decisions are made on the unstacked view and get an unsharded layer axis."""
    blocks = scan_layers.scanned_blocks(module)
    if blocks is not None:
        return scan_layers.stacked_sharding_specs(sharding_specs, names_shapes, rules, mesh,
                                                  num_layers=blocks.num_layers,
                                                  stack=blocks.stack, fsdp=fsdp)
    return sharding_specs(names_shapes, rules, mesh, fsdp=fsdp)


def undivided_weights(specs: dict, rules, stack=scan_layers.DEFAULT_STACK) -> list:
    """Names a sharding rule matched but left replicated because the mesh does not divide
    the rule's dimensions (``sharding_specs`` skips such a rule silently). ``stack`` names
    the scanned block list, if any."""
    out = []
    for name, spec in specs.items():
        probe, axes = name, tuple(spec)
        if name.startswith(stack.prefix):  # judge on layer 0's unstacked name
            probe, axes = stack.layer_name(0, name[len(stack.prefix):]), axes[1:]
        rule = next((tuple(r) for rx, r in rules if re.search(rx, probe)), None)
        if rule is not None and tuple(axes[:len(rule)]) != rule:
            out.append(name)
    return out


def place_module(module, mesh, rules=(), *, fsdp: bool = False, include=None,
                 checkpoint: str | None = None, desc: str = "weights", on_placed=None,
                 loras=(), park=None) -> dict:
    """Wrap a torch module for torchax and stream its weights into their shards on ``mesh``.

    Every weight goes straight into its ``NamedSharding``: no device holds a whole weight
    unless its spec replicates it. Without ``checkpoint`` the values come from the module's
    own torch tensors (``placement.place_tensors``), each freed once placed. With
    ``checkpoint`` the module's weights may be meta tensors: each device's slice is read from
    the safetensors files in that folder (``placement.place_from_safetensors``), so a host
    reads only what its own devices hold; stacked ``blocks.stacked.*`` weights
    (``--scan_layers``; the block list is the family's) read their layers' ``blocks.{i}.*``.
    Buffers (RoPE tables) are replicated from the module's tensors.

    Args:
        module: a torch module on CPU.
        mesh: the ("dp", "tp", "sp") mesh.
        rules: ((regex, spec), ...) for ``sharding_specs``; no rule means replicated.
        fsdp: see ``sharding_specs``.
        include: optional ``f(name) -> bool``; only those weights are placed (the rest stay
            on the host, unused by the program that gets these params).
        checkpoint: optional folder of the module's safetensors files.
        desc: progress-bar label.
        on_placed: optional ``f(name, jax.Array)`` after each weight (memory accounting).
        loras: ``engine.weights.lora.Lora``s fused into the slices as they are read (needs
            ``checkpoint``).
        park: optional ``f([sharded ShapeDtypeStruct of each weight]) -> str | None``; a
            memory kind ("device" or "pinned_host") places every weight at its parked
            sharding in that memory (``engine.weights.placement.parked_sharding``: a
            two-expert model's idle expert, ``engine.programs.experts``), while ``specs``
            stay the weights' home specs (the compiled step's); None places them home.

    Returns:
        dict(module=JittableModule, params={name: jax.Array}, buffers={name: jax.Array},
        specs={name: PartitionSpec}, rule_counts={regex: parameters}, unmatched=[names],
        undivided=[names a rule matched but whose dims the mesh does not divide],
        param_bytes=weights in their run dtypes, bytes=weights and buffers,
        bytes_read=bytes read from ``checkpoint`` (None without it), seconds=wall time,
        parked=the memory kind ``park`` placed the weights parked in, or False).

    Raises:
        GenerationError: ``checkpoint`` holds no safetensors file, or lacks a tensor the
            module has.
        ValueError: ``loras`` without ``checkpoint``.
    """
    jm = quantize.jittable(module)
    keep = include or (lambda name: True)
    params = {k: v for k, v in jm.params.items() if keep(k)}
    buffers = {k: v for k, v in jm.buffers.items() if keep(k)}
    reader, stacked = (None, {}) if checkpoint is None else _checkpoint_reader(
        module, checkpoint, params)
    specs, counts, unmatched = module_sharding_specs(
        module, {k: v.shape for k, v in params.items()}, rules, mesh, fsdp=fsdp)
    shardings = {k: NamedSharding(mesh, specs[k]) for k in params}
    shardings, parked = _maybe_parked(params, shardings, park)
    t0 = time.perf_counter()
    if loras and reader is None:
        raise ValueError("place_module: LoRAs are fused only when streaming from a checkpoint")
    if reader is None:
        placed = placement.place_tensors(params, shardings, desc=desc, on_placed=on_placed)
    else:
        placed = placement.place_from_safetensors(reader, params, shardings, desc=desc,
                                                  stacked=stacked, on_placed=on_placed,
                                                  fuse=lora.fusers(loras or ()))
    placed_buffers = placement.place_tensors(
        buffers, {k: NamedSharding(mesh, P()) for k in buffers}, desc=f"{desc} buffers",
        on_placed=on_placed)
    param_bytes = sum(int(math.prod(t.shape)) * t.element_size() for t in params.values())
    return dict(module=jm, params=placed, buffers=placed_buffers, specs=specs,
                rule_counts=counts, unmatched=unmatched,
                undivided=undivided_weights(specs, rules, _stack(module)),
                param_bytes=param_bytes,
                bytes=param_bytes + sum(t.numel() * t.element_size() for t in buffers.values()),
                bytes_read=None if reader is None else reader.bytes_read,
                seconds=time.perf_counter() - t0, parked=parked)


def _maybe_parked(params: dict, shardings: dict, park) -> tuple[dict, str | bool]:
    """(``shardings``, False), or every weight's parked sharding and its memory kind where
    ``park`` (``place_module``'s) names one for the weights at their home ``shardings``."""
    homes = {k: jax.ShapeDtypeStruct(tuple(v.shape), mappings.t2j_dtype(v.dtype),
                                     sharding=shardings[k]) for k, v in params.items()}
    memory = None if park is None else park(list(homes.values()))
    if not memory:
        return shardings, False
    return {k: placement.parked_sharding(h, memory) for k, h in homes.items()}, memory


def _stack(module):
    blocks = scan_layers.scanned_blocks(module)
    return scan_layers.DEFAULT_STACK if blocks is None else blocks.stack


def _checkpoint_reader(module, folder: str, params: dict):
    """(``placement.SafetensorsReader`` of ``folder`` checked against ``params``' names,
    {each ``--scan_layers`` stacked weight: its layers' names in the files})."""
    blocks = scan_layers.scanned_blocks(module)
    stacked = {}
    if blocks is not None:
        prefix = blocks.stack.prefix
        for name in params:
            if name.startswith(prefix):
                leaf = name[len(prefix):]
                stacked[name] = [blocks.stack.layer_name(i, leaf)
                                 for i in range(blocks.num_layers)]
    try:
        reader = placement.SafetensorsReader(folder)
    except FileNotFoundError as e:
        raise GenerationError(f"--model_id: {e}") from None
    scheme = next((s for s in map(quantize.scheme_of, (p.dtype for p in params.values()))
                   if s), None)
    if scheme:  # --quantize: 8-bit weights are quantized as their slices are read
        reader = quantize.QuantizingReader(reader, scheme)
    want = {f for name in params for f in stacked.get(name, [name])}
    missing = sorted(want - reader.keys())
    if missing:
        raise GenerationError(f"--model_id: {folder} does not match its config: missing "
                              f"{', '.join(missing[:3])}")
    # Tensors the module does not use are not read, as from_pretrained ignores them
    # (engine.files.integrity warned about them before anything loaded).
    return reader, stacked


def place_expert(config, family, module, component: str, mesh, fallbacks, park=None) -> dict:
    """Stream one transformer of the pipeline (``component``: "transformer", or a two-expert
    model's "transformer_2") from its own safetensors into the family's shardings, with that
    component's LoRA set (``config.model.lora`` / ``config.model.lora_2``) fused into each slice.

    ``park``: as ``place_module``'s (a two-expert model's idle expert placed parked).
    Returns ``place_transformer``'s dict plus "loras": the fused files' report entries.
    """
    loras = config.model.lora if component == "transformer" else config.model.lora_2
    quantized = quantize.apply(module, family, config.model.quantize)
    placed = place_transformer(
        module, mesh, family.transformer.sharding_rules(config),
        checkpoint=component_folder(config.model.model_id, component), fsdp=config.layout.fsdp,
        scan=config.layout.scan_layers, megatron_sp=config.layout.megatron_sp, fallbacks=fallbacks,
        stack=family.transformer.block_stack, loras=loras, park=park)
    placed["loras"] = loras.report() if loras else []
    placed["quantize"] = quantize.report(config.model.quantize, quantized, placed["params"],
                                         getattr(torch, config.model.dtype))
    return placed


def place_transformer(transformer, mesh, rules, *, checkpoint: str, fsdp: bool,
                      scan: bool, megatron_sp: bool = False, fallbacks=None,
                      stack=scan_layers.DEFAULT_STACK, loras=(), park=None) -> dict:
    """Stream a transformer's weights from ``checkpoint`` into their shards on ``mesh`` by
    ``rules`` (plus FSDP with ``fsdp``); see ``place_module``. With ``scan`` its blocks become
    one ``jax.lax.scan`` first (``scan_layers.scan_blocks``); the residual stream's tokens are
    sharded between blocks over ``residual_token_axes(mesh, megatron_sp)``. Logs what each
    rule matched and, at debug
    level, every weight no rule names; weights a rule matched but the mesh cannot divide are
    reported to ``fallbacks``. ``stack`` is the family's ``scan_layers.BlockStack``;
    ``loras`` (``engine.weights.lora.Lora``) are fused into each slice as it is read;
    ``park`` as ``place_module``'s. Returns as ``place_module``."""
    if scan:
        scan_layers.scan_blocks(transformer, stack=stack)  # before the sp hooks, which it keeps
    placed = place_module(transformer, mesh, rules, fsdp=fsdp, desc="transformer",
                          checkpoint=checkpoint, loras=loras, park=park)
    for rx, n in placed["rule_counts"].items():
        log.info("sharding rule %-70s matched %12s parameters", rx, f"{n:,}")
    log.debug("replicated (no rule): %s", ", ".join(placed["unmatched"]))
    undivided = placed["undivided"]
    if undivided and fallbacks is not None:
        fallbacks("weight_replicated",
                  f"{len(undivided)} weight(s) stay replicated: a sharding rule matches "
                  f"but mesh {dict(mesh.shape)} does not divide their dims "
                  f"({', '.join(undivided[:3])}{', ...' if len(undivided) > 3 else ''})")
    axes = residual_token_axes(mesh, megatron_sp)
    if axes:
        add_sequence_parallel_hooks(transformer, mesh, stack=stack, axes=axes)
    return placed


def _megatron_sublayer_hooks(blocks, mesh, axes: tuple, stack) -> list:
    """Megatron sequence parallelism inside each block: every sublayer (``stack.sublayers``)
    gets its input's tokens gathered over "tp" (an all-gather, so its column-parallel
    weights meet whole sequences) and its output's tokens scattered back over ``axes`` (a
    reduce-scatter of the row-parallel partial sums). Without these constraints GSPMD is
    free to all-gather the weights instead: on 8 CPU devices it gathered every q/k/v/out
    weight of a Wan block."""
    if not stack.sublayers:
        raise ValueError("Megatron sequence parallelism needs the family's block sublayers")

    def spec(names):
        return NamedSharding(mesh, P("dp", names if len(names) > 1 else
                                     (names[0] if names else None), None))

    gathered, scattered = spec(tuple(a for a in axes if a != "tp")), spec(axes)

    def constrain(x, sharding):
        return interop.call_jax(jax.lax.with_sharding_constraint, x, sharding)

    def enter(module, args):
        return (constrain(args[0], gathered), *args[1:])

    def leave(module, args, output):
        return constrain(output, scattered)

    hooks = []
    for block in blocks:
        for name in stack.sublayers:
            sub = getattr(block, name) if not isinstance(block, scan_layers.ScannedBlocks) \
                else getattr(block.stacked, name)
            hooks += [sub.register_forward_pre_hook(enter), sub.register_forward_hook(leave)]
    return hooks


def residual_token_axes(mesh, megatron_sp: bool = False) -> tuple[str, ...]:
    """Mesh axes of size > 1 that the residual stream's token axis is sharded over between
    blocks: "sp" (sequence parallelism, Ulysses attention), and first "tp" with Megatron
    sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation in
    Large Transformer Models"), where each tensor-parallel all-reduce becomes a
    reduce-scatter plus an all-gather and the norms, modulation and residual adds run on
    1/tp of the tokens. ``mesh``: anything with ``.shape[axis]`` (a Mesh or its shape)."""
    shape = mesh.shape if hasattr(mesh, "shape") else mesh
    names = ("tp", "sp") if megatron_sp else ("sp",)
    return tuple(a for a in names if shape[a] > 1)


def add_sequence_parallel_hooks(transformer, mesh, *, stack=scan_layers.DEFAULT_STACK,
                                axes: tuple[str, ...] = ("sp",)) -> list:
    """Shard the residual stream's token axis over ``axes`` (default "sp"; with Megatron
    sequence parallelism ("tp", "sp"), see ``residual_token_axes``) at every block boundary.

    Each block (``transformer.<stack.attr>``; with ``--scan_layers`` the scanned blocks, whose
    pre-hooks run before every layer) gets a forward pre-hook that constrains its hidden
    states (batch, tokens, dim) to P("dp", axes, None); a second stream (HunyuanVideo-1.5's
    text tokens) is left as it is. Norms, modulation and the FFN then
    run on 1/sp of the tokens; attention re-shards as its backend needs (the Splash wrapper
    shards heads over ("tp", "sp"), an all-to-all). The torch model code is untouched.

    Any token count works: when the shard count (times ``stack.token_tile``) does not divide
    it, the first hook zero-pads the token axis (hidden states and every per-token input
    ``stack.token_axes`` names, such as the RoPE tables) to the next multiple, and
    ``custom_splash_attention.pad_self_attention_keys`` makes the self-attention (modules
    named ``stack.self_attention``) mask the padded keys exactly (by length in our kernel when
    they are the keys' tail, else by segment ids); a forward hook after the last block slices
    the padding off. Padded rows are never read by a real token. A block that raises ends
    the declaration (an ``always_call`` forward hook on every block): a raise mid-trace
    leaves nothing for the next trace.

    Returns:
        the hook handles.
    """
    axes = tuple(axes)
    sharding = NamedSharding(mesh, P("dp", axes if len(axes) > 1 else axes[0], None))
    shards, padding = math.prod(mesh.shape[a] for a in axes), {}

    def pad(x, axis, n: int, extra: int):
        # tokens on `axis`: n -> n + extra, zeros appended.
        if isinstance(x, (tuple, list)):
            return type(x)(pad(t, axis, n, extra) for t in x)
        if axis is None or not isinstance(x, torch.Tensor) or x.shape[axis] != n:
            return x
        zeros = x.new_zeros((*x.shape[:axis], extra, *x.shape[axis + 1:]))
        return torch.cat([x, zeros], dim=axis)

    def constrained(hidden, rest, axes):
        n, extra = hidden.shape[1], -hidden.shape[1] % (shards * stack.token_tile)
        if extra:  # first block only: afterwards the count is a multiple of shards
            padding.update(valid=n, padded=n + extra,
                           token=csa.pad_self_attention_keys(n + extra, n))
            hidden = pad(hidden, 1, n, extra)
        if padding:
            # Every block: unrolled, each block gets forward's unpadded per-token inputs.
            valid, padded = padding["valid"], padding["padded"]
            rest = [pad(x, axis, valid, padded - valid)
                    for x, axis in zip(rest, axes, strict=True)]
        hidden = interop.call_jax(jax.lax.with_sharding_constraint, hidden, sharding)
        return hidden, rest

    def constrain(module, args):
        hidden, rest = constrained(args[0], args[1:], stack.token_axes[1:])
        return (hidden, *rest)

    def constrain_kwargs(module, args, kwargs):  # a block called by keyword
        names = [name for name, _ in stack.token_kwargs]
        hidden, rest = constrained(kwargs[names[0]], [kwargs.get(n) for n in names[1:]],
                                   [axis for _, axis in stack.token_kwargs[1:]])
        new = dict(zip(names, [hidden, *rest], strict=True))
        return args, {**kwargs, **{k: v for k, v in new.items() if k in kwargs}}

    blocks = list(getattr(transformer, stack.attr))
    hooks = [block.register_forward_pre_hook(constrain_kwargs, with_kwargs=True)
             if stack.token_kwargs else block.register_forward_pre_hook(constrain)
             for block in blocks]
    if "tp" in axes:
        hooks += _megatron_sublayer_hooks(blocks, mesh, axes, stack)
    return hooks + _end_padding_hooks(blocks, padding, stack) + _mark_video_key_attentions(
        transformer, stack)


def _end_padding_hooks(blocks, padding: dict, stack) -> list:
    """The hooks that end sequence parallelism's token padding (``padding``: the record the
    blocks' pre-hooks of ``add_sequence_parallel_hooks`` keep, with the ``splash.sdpa``
    declaration's token): after the last block the declaration ends and the padded rows are
    sliced off the output; when any block raises, the declaration and the record end too
    (an ``always_call`` hook), or every later trace (every later job of a server) would see
    this trace's padding. Returns the hook handles."""

    def unpad(module, args, output):
        if not padding:
            return output
        token, valid = padding["token"], padding["valid"]
        padding.clear()  # first: the state ends even if the slice below raises
        csa.unpad_self_attention_keys(token)
        # Sliced in JAX: a torchax slice is a lazy view that diffusers' later type_as rejects.
        hidden = interop.call_jax(lambda x: x[:, :valid], output[0] if stack.carry > 1
                                  else output)
        return (hidden, *output[1:]) if stack.carry > 1 else hidden

    def drop_on_raise(module, args, output):
        # torch calls an ``always_call`` hook with output None when the block raised.
        if output is None and padding:
            csa.unpad_self_attention_keys(padding["token"])
            padding.clear()

    return [blocks[-1].register_forward_hook(unpad),
            *(block.register_forward_hook(drop_on_raise, always_call=True) for block in blocks)]


def _mark_video_key_attentions(transformer, stack) -> list:
    """``csa.mark_self_attention`` on the blocks' attentions whose keys are the video tokens
    (``stack.self_attention`` and ``stack.video_key_attention``): they mask sp padding."""
    hooks = []
    for name, module in transformer.named_modules():
        if name.rsplit(".", 1)[-1] in (stack.self_attention, *stack.video_key_attention) \
                and stack.attr in name:
            hooks += csa.mark_self_attention(module)
    return hooks
