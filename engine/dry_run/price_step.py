"""The denoising step's price (ESTIMATE): one transformer block compiled at the real per-chip
shapes with the kernel stubbed out (``_first_block``), its ops priced by
``price_ops.program_summary``, the kernel's calls by their profiled cost model
(``price_kernel``, in a subprocess), x blocks (``combine``); sparse steps the same with the
sparse block (``sparse_steps``). See ``engine.dry_run.estimate`` for the method."""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time

import jax
import torch
from jax.experimental import pallas as pl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop
from torchax.ops import mappings

from custom_splash_attention import (
    LocalMask,
    describe_calls,
)
from engine.dry_run.abstract import abstract_inputs, abstract_transformer
from engine.dry_run.price_kernel import (
    _band,
    _band_counts,
    _kernel_key,
    call_cycles,
    worker_failure,
)
from engine.dry_run.price_ops import (
    ICI_SOURCE,
    MXU_FLOPS_PER_CYCLE,
    STUB_NAME,
    block_hlo_text,
    clock_hz,
    device_hbm_bytes_per_s,
    device_ici_bytes_per_s,
    device_peak_flops,
    label,
    program_summary,
)
from engine.files.checkpoint import PROJECT_ROOT, read_component_config
from engine.weights import sharding as sharding_mod
from splash import sdpa, svg


def _recorded(call) -> dict:
    """A ``splash.kernel.KernelCall`` as the JSON-able dict the estimate passes around (the
    profiling worker rebuilds the kernel from it): ``window_size`` for a ``LocalMask``,
    ``band_window`` and ``band_anchor`` for ``splash.svg.AnchoredBandMask`` (the sparse
    path's mask, costed per tile class: ``masked_cost``), else None.

    Raises:
        ValueError: any other mask (its cost would be the profile's blind spot)."""
    bs, mask = call.block_sizes, call.mask
    if mask is not None and not isinstance(mask, (LocalMask, svg.AnchoredBandMask)):
        raise ValueError(f"--estimate cannot cost a kernel call with mask {type(mask).__name__}"
                         " (only LocalMask and the sparse path's band)")
    band = isinstance(mask, svg.AnchoredBandMask)
    return dict(grid=list(call.grid), head_dim=call.head_dim, dtype=call.dtype,
                q_len=call.q_len, kv_len=call.kv_len,
                block_sizes=[bs.block_q, bs.block_kv, bs.block_kv_compute],
                segment_ids=call.segment_ids,
                window_size=mask.window_size if isinstance(mask, LocalMask) else None,
                band_window=mask.window if band else None,
                band_anchor=mask.anchor if band else None,
                real_kv_blocks=call.real_kv_blocks)


def _stub_kernel(call, inputs):
    """A no-op Pallas call over the kernel's operands (so their producers, the q scaling
    and the V transpose, stay in the program) whose output aliases q (``inputs[0]``)."""
    arrays = [a for a in inputs if a is not None]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        lambda *refs: None, out_shape=call.out_shape, name=STUB_NAME,
        in_specs=[any_spec] * len(arrays), out_specs=any_spec,
        input_output_aliases={0: 0})(*arrays)


@contextlib.contextmanager
def stub_attention_kernel(calls: list):
    """Within: our kernel is a no-op (``_stub_kernel``) and each call traced is appended to
    ``calls`` (``_recorded``), through the kernel's public hook ``describe_calls``."""

    def hook(call, inputs):
        calls.append(_recorded(call))
        return _stub_kernel(call, inputs)

    with describe_calls(hook):
        yield


def _block_calls(config, family, cfg: dict, mesh, placed) -> list:
    """Every call of the first block in one traced step, as dicts of ``args`` and ``kwargs``
    (tensors as abstract shapes and dtypes, other values as given), ``order`` (the keywords
    in call order) and ``count``, equal calls merged. One call per model pass the step
    runs: a CFG pair is one call of batch 2, and a step with more guidance passes (LTX-2's
    spatio-temporal and modality-isolation passes, batch 1 each, with their own flags) calls
    the block once per pass. The step is traced
    (``jax.eval_shape``, no compile) with a hook that records them."""
    vae_cfg = read_component_config(config.model.model_id, "vae")
    latents, t, inputs = abstract_inputs(config, family, cfg, vae_cfg, mesh)
    seen = []

    def abstract(x):
        return jax.ShapeDtypeStruct(tuple(x.shape), mappings.t2j_dtype(x.dtype)) \
            if isinstance(x, torch.Tensor) else x

    def record(_module, args, kwargs):
        # Under the sparse scope, sequence parallelism's padding declaration too (the band
        # runs on the real tokens; the dense estimate keeps its unmasked padded keys).
        pad = sdpa.declared_key_padding() if svg.active_scope() is not None else None
        seen.append((*jax.tree.map(abstract, (args, kwargs)), list(kwargs), pad))

    blocks = getattr(placed["module"]._model, family.transformer.block_stack.attr)
    handle = blocks[0].register_forward_pre_hook(record, with_kwargs=True)
    try:
        jax.eval_shape(interop.jax_view(family.transformer.step_fn(placed["module"], config)),
                       placed["params"], placed["buffers"], latents, t, inputs)
    finally:
        handle.remove()
    calls = {}
    for args, kwargs, order, pad in seen:
        leaves, tree = jax.tree.flatten((args, kwargs))
        key = repr((tree, leaves, order, pad))
        calls.setdefault(key, dict(args=args, kwargs=kwargs, order=order, padding=pad,
                                   count=0))["count"] += 1
    return list(calls.values())


def _residual(call: dict, stack):
    """The call's residual stream (batch, tokens, dim): its first positional argument, or
    for a block called by keyword the first name of ``stack.token_kwargs``."""
    return call["kwargs"][stack.token_kwargs[0][0]] if stack.token_kwargs else call["args"][0]


def _compile_block(config, family, mesh, shape, placed, call: dict) -> tuple:
    """(compiled, seconds, kernel calls) of ONE transformer block at the real per-chip
    shapes, called as ``call`` (``_block_calls``): batch over "dp" and, with sequence
    parallelism, tokens over "sp" (as the residual stream is laid out between blocks);
    values that are not tensors (a pass's flags) stay static.

    Only a block, not the whole model: libtpu 0.0.42.1's static profiler exhausted this
    host's memory (over 14 GB) on the whole model's program and aborted on a tiny one
    ("Unsupported DMA direction"), in ops outside the blocks (patch embedding)."""
    stack = family.transformer.block_stack
    batch, tokens = _residual(call, stack).shape[:2]
    axes = sharding_mod.residual_token_axes(mesh, config.layout.megatron_sp)
    shards = math.prod(mesh.shape[a] for a in axes)

    def sharding(x):
        if x.ndim >= 2 and x.shape[0] == batch and batch % shape.dp == 0 and batch > 1:
            spec = ["dp"] + [None] * (x.ndim - 1)
        else:
            spec = [None] * x.ndim
        if axes and x.ndim >= 3 and x.shape[1] == tokens and tokens % shards == 0:
            spec[1] = axes if len(axes) > 1 else axes[0]
        return NamedSharding(mesh, P(*spec))

    leaves, tree = jax.tree.flatten((call["args"], call["kwargs"]))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
    sharded = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype,
                                    sharding=sharding(leaves[i])) for i in arrays]
    jm = placed["module"]

    def block(params, buffers, *values):
        full = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            full[i] = v
        args, kwargs = jax.tree.unflatten(tree, full)
        return jm.functional_call(lambda model, *a, **k: getattr(model, stack.attr)[0](*a, **k),
                                  params, buffers, *args, **kwargs)

    # The carried streams (the first ``carry`` arguments, positional or keyword in call
    # order: HunyuanVideo-1.5 and LTX-2 carry two) come out laid out as they went in.
    carried = [*call["args"], *(call["kwargs"][k] for k in call["order"])][:stack.carry]
    out_sh = [next(x.sharding for i, x in zip(arrays, sharded, strict=True)
                   if leaves[i] is c) for c in carried]
    out_sh = out_sh[0] if stack.carry == 1 else tuple(out_sh)

    param_sh = {k: NamedSharding(mesh, s) for k, s in placed["specs"].items()}
    calls, pad = [], call.get("padding")
    with stub_attention_kernel(calls), _declared(pad):
        t0 = time.perf_counter()
        def estimate_block(*a):  # names the module, for the HLO dump (``block_hlo_text``)
            return interop.jax_view(block)(*a)

        compiled = jax.jit(estimate_block, in_shardings=(
            param_sh, NamedSharding(mesh, P()), *[x.sharding for x in sharded]),
            out_shardings=out_sh).lower(
            placed["params"], placed["buffers"], *sharded).compile()
    return compiled, time.perf_counter() - t0, calls


@contextlib.contextmanager
def _declared(pad):
    """Within: ``pad`` (a ``KeyPadding`` or None) declared as the step declares it."""
    token = None if pad is None else sdpa.pad_self_attention_keys(*pad)
    try:
        yield
    finally:
        if token is not None:
            sdpa.unpad_self_attention_keys(token)


_SUMMED = ("linear_s", "other_s", "other_hbm_floor_s", "hbm_bound_s", "flops",
           "eight_bit_flops", "eight_bit_ops", "bytes", "ops", "collective_sent_bytes")


def _first_block(config, family, cfg: dict, mesh, shape, chip: str) -> dict:
    """``program_summary`` of the first block's work in one step, with its ``kernel_calls``,
    ``compile_s`` and ``passes``: each distinct call the step makes (``_block_calls``: one per
    model pass) compiled once and counted as often as the step makes it. ``passes``: per
    distinct call, its batch (samples), how many times a step makes it and its compile
    seconds; a step of a CFG pair alone is one call of batch 2."""
    cfg = dict(cfg, num_layers=1)
    unrolled = config.replace(scan_layers=False)
    placed = abstract_transformer(unrolled, family, cfg, mesh)
    stack = family.transformer.block_stack
    out = dict({k: 0.0 for k in _SUMMED}, source={}, collectives={}, top_ops=[],
               kernel_calls=[], compile_s=0.0, passes=[])
    for call in _block_calls(unrolled, family, cfg, mesh, placed):
        compiled, seconds, kernel_calls = _compile_block(unrolled, family, mesh, shape,
                                                         placed, call)
        one, n = program_summary(block_hlo_text(compiled), chip), call["count"]
        for k in _SUMMED:
            out[k] += n * one[k]
        for k, v in one["source"].items():
            out["source"][k] = out["source"].get(k, 0) + n * v
        for kind, c in one["collectives"].items():
            agg = out["collectives"].setdefault(kind, dict(calls=0, sent_bytes=0.0))
            agg["calls"] += n * c["calls"]
            agg["sent_bytes"] += n * c["sent_bytes"]
        out["top_ops"] = sorted(out["top_ops"] + one["top_ops"], key=lambda op: -op["seconds"])[:8]
        out["kernel_calls"] += kernel_calls * n
        out["compile_s"] += seconds
        out["passes"].append(dict(batch=_residual(call, stack).shape[0], count=n,
                                  compile_s=seconds))
    return out



# ---------------------------------------------------------------------------------------
# The estimate (parent process)
# ---------------------------------------------------------------------------------------


def _kernel_seconds(calls: list, kernels: dict, hz: float) -> dict:
    """Seconds and grid steps of the kernel calls of one program, self vs cross."""
    out = {k: dict(seconds=0.0, grid_steps=0, flops=0.0) for k in ("self", "cross")}
    for c in calls:
        # A masked call is self-attention even when its keys end early (the sparse band
        # leaves sequence parallelism's padded keys out by valid_kv_len).
        masked = c.get("band_window") is not None or c.get("window_size") is not None
        kind = "self" if c["q_len"] == c["kv_len"] or masked else "cross"
        steps = math.prod(c["grid"])
        out[kind]["seconds"] += call_cycles(c, kernels[_kernel_key(c)]) / hz
        out[kind]["grid_steps"] += steps
        bq, bkv, bkc = c["block_sizes"]
        if _band(c) is not None:  # the computed sub-tiles only
            n = _band_counts(c)
            subs = c["grid"][0] * c["grid"][1] * (n.full_subs + n.partial_subs
                                                  + sum(n.edge_subs))
            out[kind]["flops"] += 4.0 * subs * bq * bkc * c["head_dim"]
        else:
            out[kind]["flops"] += 4.0 * steps * bq * bkv * c["head_dim"]
    return out


def combine(block: dict, kernels: dict, *, chip: str, layers: int,
            model_flops_per_chip: float) -> dict:
    """The step estimate: ``layers`` x (one block's ops, collectives and kernel calls).

    Args:
        block: ``program_summary`` of one block, with its ``kernel_calls`` (as the stub
            recorded them) and ``compile_s``.
        kernels: {``_kernel_key``: ``kernel_cost``'s model} of the profiled kernel.
        model_flops_per_chip: the family's analytic FLOPs of a step / chips, for MXU use.
    """
    hz = clock_hz(chip)
    attn = _kernel_seconds(block["kernel_calls"], kernels, hz)
    attn = {kind: {f: layers * v for f, v in a.items()} for kind, a in attn.items()}
    coll_bytes = layers * block["collective_sent_bytes"]
    parts = dict(
        self_attention_s=attn["self"]["seconds"], cross_attention_s=attn["cross"]["seconds"],
        linear_s=layers * block["linear_s"],
        elementwise_and_other_s=layers * block["other_hbm_floor_s"],
        collectives_s=coll_bytes / device_ici_bytes_per_s(chip))
    total = sum(parts.values())
    xla = total - parts["elementwise_and_other_s"] + layers * block["other_s"]
    peak = device_peak_flops(chip)
    for a in attn.values():
        a["kernel_mxu_use"] = (a["flops"] / (MXU_FLOPS_PER_CYCLE[chip] * a["seconds"] * hz)
                               if a["seconds"] else None)
    return dict(
        label=label(chip), chip=chip, clock_hz=hz,
        clock_source="published bf16 peak / MXU FLOPs per cycle (an assumption)",
        hbm_gbps=device_hbm_bytes_per_s(chip) / 1e9,
        ici_egress_gbps=device_ici_bytes_per_s(chip) / 1e9,
        ici_source=ICI_SOURCE, seconds_per_step=total, parts=parts,
        elementwise_xla_cost_model_s=layers * block["other_s"],
        seconds_per_step_elementwise_by_xla_cost_model=xla,
        mxu_use=model_flops_per_chip / (peak * total) if total else None,
        model_flops_per_chip=model_flops_per_chip,
        collective_gb_per_chip=coll_bytes / 1e9,
        collectives={k: dict(calls=layers * v["calls"], sent_bytes=layers * v["sent_bytes"])
                     for k, v in block["collectives"].items()},
        attention=attn, kernels=kernels,
        passes=block.get("passes", []),
        samples_per_step=sum(p["batch"] * p["count"] for p in block.get("passes", [])),
        layers=layers, block=dict(compile_s=block["compile_s"], ops=block["ops"],
                                  cycle_sources=block["source"], top_ops=block["top_ops"],
                                  linear_flops=block["flops"],
                                  eight_bit_flops=block.get("eight_bit_flops", 0.0),
                                  eight_bit_ops=block.get("eight_bit_ops", 0)),
        method=METHOD)


METHOD = ("attention: our kernel's cycles per grid step and per q block, fitted to libtpu's "
          "static profiles of two tiny grids at the real block sizes (a kernel comparing "
          "segment ids in every block above block_q 3328: at two smaller block_q, "
          "extrapolated linearly), x the real per-chip grid; linear layers: FLOPs / MXU peak "
          "(roofline) or HBM bytes / bandwidth, whichever is larger, per op of one compiled "
          "block; elementwise: HBM bytes / bandwidth (libtpu's profile of a 14B-sized layer "
          "norm is below it; XLA's fusion cost model, 4x above the profile there, is given "
          "apart); x blocks; collectives: ring bytes / ICI "
          "egress, serial; work outside the blocks (patch embedding, RoPE tables, output "
          "projection) left out")


def estimate(config, family, cfg: dict, mesh, mesh_shape, chip: str, attention: str) -> dict:
    """Estimated seconds per denoising step on ``config.dry.topology``, with its breakdown.

    One block is compiled here at the real per-chip shapes with the kernel stubbed out; the
    kernel's cycles per grid step come from a subprocess (the profile flag must be set
    before libtpu loads). ``cfg`` is the transformer config with its real ``num_layers``.
    Every figure is an ESTIMATE (assumed clock, static models); nothing is measured.

    Raises:
        ValueError: the chip has no clock assumption here, or the attention backend is one
            whose cost the profile cannot see (JAX's stock splash kernel).
        RuntimeError: the profiling subprocess failed (its last stderr lines are included).
    """
    clock_hz(chip)
    if attention == "stock_splash":
        raise ValueError("--estimate profiles our Splash kernel or XLA attention; JAX's stock "
                         "splash kernel gates its work on mask data the profile undercounts")
    t0 = time.perf_counter()
    block = _first_block(config, family, cfg, mesh, mesh_shape, chip)
    sparse_blocks = _sparse_blocks(config, family, cfg, mesh, mesh_shape, chip)
    calls = block["kernel_calls"] + [c for b in sparse_blocks.values()
                                     for c in b["kernel_calls"]]
    kernels = {}
    if calls:
        request = dict(topology=config.dry.topology, kernel_calls=calls)
        env = dict(os.environ)
        env.pop("LIBTPU_INIT_ARGS", None)  # the worker sets its own flags
        proc = subprocess.run([sys.executable, "-m", "engine.dry_run.price_kernel"],
                              input=json.dumps(request), capture_output=True, text=True,
                              cwd=PROJECT_ROOT, env=env)
        if proc.returncode != 0:
            raise RuntimeError(worker_failure(proc.returncode, proc.stderr, calls))
        kernels = json.loads(proc.stdout.strip().splitlines()[-1])
    chips_in_mesh = mesh_shape.dp * mesh_shape.tp * mesh_shape.sp
    out = combine(block, kernels, chip=chip, layers=cfg["num_layers"],
                  model_flops_per_chip=family.transformer.flops(cfg, config) / chips_in_mesh)
    if sparse_blocks:
        out["sparse"] = sparse_steps(block, sparse_blocks, kernels, chip=chip,
                                     layers=cfg["num_layers"], sparse_layers=config.sparse.layers)
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def _sparse_blocks(config, family, cfg: dict, mesh, shape, chip: str) -> dict:
    """{sparse program key: ``_first_block`` traced under its ``splash.svg.sparse_scope``}
    for a run with ``config.sparse`` (one per distinct expert density), else {}. The first
    block stands for every sparse layer: unrolled, each block's self-attention is sparse
    under the scope (the layer range is the scan's split, ``splash.svg.layer_segments``),
    so its routing, permutations and band-masked kernel call are all in the program."""
    out = {}
    sparse = config.sparse
    for e in range(len(sparse.densities) if sparse is not None else 0):
        key = sparse.key(e)
        if key not in out:
            with svg.sparse_scope(sparse.scope(e)):
                out[key] = _first_block(config, family, cfg, mesh, shape, chip)
    return out


def sparse_steps(block: dict, sparse_blocks: dict, kernels: dict, *, chip: str, layers: int,
                 sparse_layers: tuple[int, int]) -> dict:
    """{key: the sparse step's estimate}: ``layers`` blocks of which those in
    ``sparse_layers`` ([start, stop), clipped to ``layers``) run the sparse block of
    ``sparse_blocks[key]`` and the rest the dense ``block``; each with ``seconds_per_step``,
    the per-layer ``parts`` of both kinds (seconds) and the layer counts. The routing and
    the permutations are XLA ops of the sparse block, in its linear and elementwise parts."""
    n = max(0, min(sparse_layers[1], layers) - max(sparse_layers[0], 0))
    dense = combine(block, kernels, chip=chip, layers=1, model_flops_per_chip=0.0)
    out = {}
    for key, sb in sparse_blocks.items():
        one = combine(sb, kernels, chip=chip, layers=1, model_flops_per_chip=0.0)
        out[key] = dict(
            seconds_per_step=(layers - n) * dense["seconds_per_step"]
            + n * one["seconds_per_step"], sparse_layers=n, dense_layers=layers - n,
            sparse_layer_s=one["seconds_per_step"], dense_layer_s=dense["seconds_per_step"],
            sparse_layer_parts=one["parts"], sparse_layer_attention=one["attention"],
            sparse_layer_top_ops=sb["top_ops"], sparse_layer_collectives=one["collectives"],
            dense_layer_parts=dense["parts"], compile_s=sb["compile_s"])
    return out

