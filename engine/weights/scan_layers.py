"""Run a transformer's blocks as one ``jax.lax.scan`` instead of L unrolled copies.

``WanTransformer3DModel.forward`` runs ``for block in self.blocks: hidden_states = block(...)``
(HunyuanVideo-1.5: ``self.transformer_blocks``, two streams in and out). Traced through torchax,
that loop unrolls: the jitted program holds every block's ops, and XLA compile time grows with
the block count. Here the per-block weights are stacked along a new leading layer axis and the
block list is replaced by :class:`ScannedBlocks`, whose forward scans ONE block module over the
stacked weights. Everything else in ``forward`` (patch embedding, condition embedder, RoPE,
``norm_out``, ``proj_out``, unpatchify) is still diffusers' own code, untouched. A family
describes its block list with a :class:`BlockStack` (Wan's is the default).

State-dict names change from ``blocks.{i}.<name>`` (shape S) to ``blocks.stacked.<name>``
(shape (L, *S)); ``blocks`` is ``BlockStack.attr``. Sharding stays per-layer Megatron with an
unsharded layer axis:
:func:`stacked_sharding_specs` runs ``engine.weights.sharding.sharding_specs`` on the unstacked
view, so the decisions are exactly the unrolled model's, ``--fsdp`` included (FSDP never picks the
layer axis).

Typical use, before the weights are placed (see ``engine.weights.sharding.place_transformer``)::
    scan_blocks(pipe.transformer)                      # in place; stacks on the host
    specs, counts, unmatched = stacked_sharding_specs(
        sharding_specs, {k: v.shape for k, v in params.items()}, rules, mesh,
        num_layers=pipe.transformer.blocks.num_layers, fsdp=fsdp)

With meta weights (``accelerate.init_empty_weights``) nothing is copied: the stacked
parameters are meta too, and ``place_module(..., checkpoint=...)`` reads each layer's slices
from the files.

The scan body is traced once; forward pre-hooks on ``model.blocks`` (the sequence-parallel
constraint) run inside it for every layer. Pure-torch (non-torchax) calls loop in Python.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import torch
import torchax.tensor
from jax.sharding import PartitionSpec as P
from torchax import interop

from splash import svg

STACKED = "stacked"


@dataclasses.dataclass(frozen=True)
class BlockStack:
    """Where a transformer keeps its identical blocks and how one is called.

    attr: the ``nn.ModuleList`` attribute ("blocks" for Wan, "transformer_blocks" for
        HunyuanVideo-1.5).
    carry: how many leading positional arguments a block returns, in order (Wan's block
        returns hidden_states; HunyuanVideo-1.5's returns (hidden_states,
        encoder_hidden_states)). The rest are the same for every layer.
    token_axes: per positional argument, the axis of the video tokens, or None: sequence
        parallelism zero-pads these axes (``sharding.add_sequence_parallel_hooks``). A tuple
        argument (RoPE (cos, sin)) has the axis in each element.
    self_attention: the name (last dotted part) of the modules whose keys are the video
        tokens, which mask sequence-parallel padding.
    sublayers: the block's children that take the normed residual stream (batch, tokens,
        dim) as their first argument and return their contribution to it: Megatron sequence
        parallelism gathers the tokens on entry and reduce-scatters them on exit
        (``sharding.add_sequence_parallel_hooks``). Empty: the family does not support it.
    token_tile: sequence parallelism pads the token axis to a multiple of this times the
        shard count, so every shard is a whole number of 16-row bf16 tiles and the
        all-to-all's merge of the shards is a bitcast, not a copy (Wan 14B 720p, dp2 x sp4
        on v6e: 18,900 tokens per shard, padded to 18,912; elementwise HBM time 0.360 ->
        0.332 s/step by the static estimate). Where the self-attention keys are exactly the
        residual tokens, the padding is the keys' tail and the kernel masks it by length
        (``custom_splash_attention.splash_attention(valid_kv_len=...)``); a joint attention
        over another stream masks it by segment ids, as any padding. 1: pad only to what the
        shard count needs.
    token_kwargs: for blocks called by keyword (a diffusers forward that passes
        every block argument by name), ((name, token axis or None), ...)
        in place of ``token_axes``: the first names the residual stream (batch, tokens, dim),
        the rest the per-token inputs sequence parallelism pads. Empty: positional.
    video_key_attention: names of other attentions whose keys are the video tokens (a
        cross-attention from a second stream), masked like ``self_attention`` when sequence
        parallelism pads the tokens.
    sequence_parallel: False for blocks that sequence parallelism would break (Helios'
        blocks slice the chunk's tokens off the residual stream's end by count): the mesh
        then keeps sp at 1 (``engine.weights.layout.resolve_run_mesh``).
    """

    attr: str = "blocks"
    carry: int = 1
    token_axes: tuple = (1, None, None, 1)  # hidden, encoder, temb, rotary (Wan 2.1)
    self_attention: str = "attn1"
    sublayers: tuple = ("attn1", "attn2", "ffn")
    token_tile: int = 1
    token_kwargs: tuple = ()
    video_key_attention: tuple = ()
    sequence_parallel: bool = True

    @property
    def prefix(self) -> str:
        """State-dict prefix of the stacked weights: "blocks.stacked."."""
        return f"{self.attr}.{STACKED}."

    def layer_name(self, i: int, leaf: str) -> str:
        return f"{self.attr}.{i}.{leaf}"


# diffusers' DiT layout: a "blocks" list whose blocks take (hidden, encoder, temb, rotary).
DEFAULT_STACK = BlockStack()
STACKED_PREFIX = DEFAULT_STACK.prefix


def scanned_blocks(model: torch.nn.Module):
    """The model's :class:`ScannedBlocks`, or None when its blocks are not scanned (seen
    through a step cache's :class:`CachedBlocks`)."""
    for child in model.children():
        child = getattr(child, "inner", child)
        if isinstance(child, ScannedBlocks):
            return child
    return None


def _split(name: str) -> tuple[str, str]:
    """"attn1.to_q.weight" -> ("attn1.to_q", "weight"); "scale_shift_table" -> ("", ...)."""
    owner, _, leaf = name.rpartition(".")
    return owner, leaf


def _tensor_at(module: torch.nn.Module, name: str):
    """The tensor currently bound at dotted ``name`` (a Parameter, a buffer, or whatever
    ``torch.func.functional_call`` swapped in), read by attribute like the module's own code."""
    owner, leaf = _split(name)
    return getattr(module.get_submodule(owner) if owner else module, leaf)


class ScannedBlocks(torch.nn.Module):
    """Drop-in for a block list (``WanTransformer3DModel.blocks``) that runs all L blocks as
    one scan.

    Holds one ``WanTransformerBlock`` (``self.stacked``) whose parameters have a leading layer
    axis: ``stacked.attn1.to_q.weight`` is (L, out, in), ``stacked.scale_shift_table`` is
    (L, 1, 6, dim), each in its original dtype (bf16 weights stay bf16, the fp32-kept tables
    stay fp32). Iterating it yields itself once, so diffusers' ``for block in self.blocks``
    loop makes exactly one call with the block's own arguments (Wan: ``(hidden_states,
    encoder_hidden_states, temb, rotary_emb)``); the first ``stack.carry`` of them are carried
    from layer to layer.

    Under torchax (tensors are ``torchax.tensor.Tensor``) that call is a ``jax.lax.scan`` whose
    body is ``torch.func.functional_call(self.stacked, <layer i's slices>, ...)``: the jitted
    program contains the block once. On plain torch tensors it loops over the slices in
    Python (same math), so eager CPU runs still work.

    Forward pre-hooks registered on this module (e.g. engine.weights.sharding's sequence-parallel
    sharding constraint) run once on entry, as for any module, and again on the carry before
    every layer inside the scan, where the unrolled model ran them per block.
    """

    def __init__(self, template: torch.nn.Module, num_layers: int, names: tuple[str, ...],
                 *, unroll: int = 1, stack: BlockStack = DEFAULT_STACK):
        super().__init__()
        self.stacked = template
        self.num_layers = num_layers
        self.param_names = names
        self.unroll = unroll
        self.stack = stack
        # (start, stop): run only these layers on the next call (step caching's cached DeepCache
        # step); None runs all of them.
        self.layer_range = None
        # A layer index j: the next call also keeps the carry entering layer j in
        # ``self.recorded`` (DeepCache's full step), in the same single scan as a plain call.
        self.record_at = None
        self.recorded = None

    def __iter__(self):
        # diffusers iterates ``self.blocks``; one "block" that runs them all.
        return iter((self,))

    def __len__(self) -> int:
        return 1

    def stacked_params(self) -> dict:
        """{name: tensor (L, ...)} as currently bound (torchax tensors inside functional_call)."""
        return {n: _tensor_at(self.stacked, n) for n in self.param_names}

    def _pre_hooks(self, args: tuple) -> tuple:
        for hook in self._forward_pre_hooks.values():
            out = hook(self, args)
            if out is not None:
                args = out if isinstance(out, tuple) else (out,)
        return args

    def _layer(self, params: dict, *args):
        """One block with ``params`` ({name: tensor without the layer axis}); returns the
        carried arguments' new values as a tuple."""
        args = self._pre_hooks(args)
        # functional_call swaps the (L, ...) tensors for this layer's slices and back; hooks on
        # the template block run too, as they would on blocks.0.
        out = torch.func.functional_call(self.stacked, params, args)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def _result(self, carry: tuple):
        return carry[0] if self.stack.carry == 1 else carry

    def forward(self, *args):
        """Args and result as the block's own forward, applied L times.

        Wan: hidden_states (B, N, dim) in the model dtype; encoder_hidden_states (B, T, dim);
        temb (B, 6, dim) float32 (Wan 2.1) or (B, N, 6, dim); rotary_emb (cos, sin), each
        (1, N, 1, head_dim) float32; returns (B, N, dim) in the model dtype. The first
        ``stack.carry`` arguments are carried (and returned, as a tuple when more than one).
        """
        n = self.stack.carry
        stacked = self.stacked_params()
        start, stop = self.layer_range or (0, self.num_layers)
        record_at = self.record_at
        if not isinstance(args[0], torchax.tensor.Tensor):
            carry = tuple(args[:n])
            for i in range(start, stop):
                if i == record_at:
                    self.recorded = carry
                carry = self._layer({k: v[i] for k, v in stacked.items()}, *carry, *args[n:])
            return self._result(carry)

        # SVG's layer range (``splash.svg.layer_segments``): one scan per run of dense or
        # sparse layers, each traced under its own scope; one run (the plain scan) otherwise.
        carry = tuple(args[:n])
        for a, b, scope in svg.layer_segments(start, stop):
            with svg.sparse_scope(scope):
                carry = self._scan(carry, stacked, tuple(args[n:]), a, b, record_at)
        return self._result(carry)

    def _scan(self, carry: tuple, stacked: dict, rest: tuple, start: int, stop: int,
              record_at):
        """Layers [start, stop) as one ``jax.lax.scan`` on torchax tensors; returns the new
        carry (a tuple), keeping the carry entering ``record_at`` in ``self.recorded``."""
        # The body is torch code viewed as a JAX function: JAX arrays in, torchax tensors
        # inside (call_torch enters the default env), JAX arrays out.
        body = interop.jax_view(self._layer)

        def run(carry, params, rest):
            def step(carry, layer_params):
                return body(layer_params, *carry, *rest), None

            if record_at is not None:
                # The plain scan's body plus a conditional copy of the carry at layer j: the
                # block math is the plain program's, so a full DeepCache step equals a step
                # without a cache bit for bit.
                def recording(state, xs):
                    carry, kept = state
                    layer_params, i = xs
                    kept = jax.lax.cond(i == record_at, lambda c, k: c, lambda c, k: k,
                                        carry, kept)
                    return (step(carry, layer_params)[0], kept), None

                zeros = jax.tree.map(jax.numpy.zeros_like, carry)
                (out, kept), _ = jax.lax.scan(
                    recording, (carry, zeros),
                    (params, jax.numpy.arange(self.num_layers)), unroll=self.unroll)
                return out, kept
            if (start, stop) == (0, self.num_layers):
                out, _ = jax.lax.scan(step, carry, params, unroll=self.unroll)
                return out

            # A sub-range indexes the whole stacked weights per layer: slicing them to the
            # range first would copy those layers' weights (GBs per chip at 14B).
            def indexed(carry, i):
                return step(carry, {k: jax.lax.dynamic_index_in_dim(v, i, keepdims=False)
                                    for k, v in params.items()})

            out, _ = jax.lax.scan(indexed, carry, jax.numpy.arange(start, stop),
                                  unroll=self.unroll)
            return out

        carry = interop.call_jax(run, carry, stacked, rest)
        if record_at is not None:
            carry, self.recorded = carry
            self.recorded = tuple(self.recorded)
        return tuple(carry)


def scan_blocks(model: torch.nn.Module, *, unroll: int = 1,
                stack: BlockStack = DEFAULT_STACK) -> ScannedBlocks:
    """Replace ``model.<stack.attr>`` (a ModuleList of identical blocks) by
    :class:`ScannedBlocks`.

    In place. The weights of ``blocks.{i}.<name>`` are stacked into
    ``blocks.stacked.<name>`` with shape (L, ...), block by block so that host memory grows by
    one stacked tensor at a time rather than by a second copy of all blocks. Works on meta
    tensors (``accelerate.init_empty_weights``) too. ``requires_grad`` is kept (torchax treats
    parameters without it as buffers, which sharding rules do not see).

    Args:
        model: a ``WanTransformer3DModel`` (anything with a ``stack.attr`` ModuleList).
        unroll: ``jax.lax.scan`` unroll factor (1 = one block in the program).
        stack: the family's :class:`BlockStack`.

    Returns:
        the new block list.
    """
    blocks = getattr(model, stack.attr)
    if isinstance(blocks, ScannedBlocks):
        return blocks
    template, num_layers = blocks[0], len(blocks)
    if any(type(b) is not type(template) for b in blocks):
        raise ValueError("scan_blocks: every block must have the same class")
    if list(template.named_buffers()):
        raise ValueError("scan_blocks: blocks with buffers are not supported")
    names = tuple(n for n, _ in template.named_parameters())
    for name in names:
        owner, leaf = _split(name)
        per_layer = [b.get_parameter(name) for b in blocks]
        if len({(tuple(p.shape), p.dtype) for p in per_layer}) != 1:
            raise ValueError(f"scan_blocks: {name} differs in shape or dtype across blocks")
        data = torch.stack([p.detach() for p in per_layer])
        requires_grad = per_layer[0].requires_grad
        for b in blocks[1:]:  # drop the per-layer copies as we go; these blocks are discarded
            (b.get_submodule(owner) if owner else b)._parameters[leaf] = None
        mod = template.get_submodule(owner) if owner else template
        mod._parameters[leaf] = torch.nn.Parameter(data, requires_grad=requires_grad)
    scanned = ScannedBlocks(template, num_layers, names, unroll=unroll, stack=stack)
    setattr(model, stack.attr, scanned)
    return scanned


def stacked_sharding_specs(sharding_specs, names_shapes: dict, rules, mesh, *,
                           num_layers: int, stack: BlockStack = DEFAULT_STACK, **kwargs):
    """Specs for a scanned model that equal the unrolled model's, layer axis prepended.

    Calls ``sharding_specs`` (``engine.weights.sharding``'s, passed in to keep this module free of
    that import) on the UNSTACKED view: each ``blocks.stacked.<name>`` of shape (L, *S) becomes
    ``blocks.{i}.<name>`` of shape S for i < L, so the original rule table and every option
    (``fsdp``, which must never pick the layer axis, ``replicate_row_parallel`` tables, the
    divisibility checks) decide exactly as for the unrolled model. The stacked spec is
    ``P(None, *spec of blocks.0.<name>)``.

    Args:
        sharding_specs: ``f(names_shapes, rules, mesh, **kwargs) -> (specs, counts, unmatched)``.
        names_shapes: {name: shape} of the scanned model (``JittableModule.params``).
        rules: the UNSTACKED rule table (e.g. ``transformer_sharding_rules()``).
        mesh: the mesh.
        num_layers: L.
        stack: the family's :class:`BlockStack` (names the block list).
        **kwargs: passed on (e.g. ``fsdp=True``).

    Returns:
        ({name: PartitionSpec} for the scanned names, {regex: parameter count as unrolled},
        [unmatched scanned names]).
    """
    prefix = stack.prefix
    flat = {}
    for name, shape in names_shapes.items():
        if name.startswith(prefix):
            leaf = name[len(prefix):]
            for i in range(num_layers):
                flat[stack.layer_name(i, leaf)] = tuple(shape[1:])
        else:
            flat[name] = tuple(shape)
    specs, counts, unmatched = sharding_specs(flat, rules, mesh, **kwargs)
    out = {}
    for name in names_shapes:
        if name.startswith(prefix):
            out[name] = P(None, *specs[stack.layer_name(0, name[len(prefix):])])
        else:
            out[name] = specs[name]
    layer = re.compile(rf"^{re.escape(stack.attr)}\.(\d+)\.(.+)$")
    unmatched_out = sorted({prefix + m.group(2) if (m := layer.match(n)) else n
                            for n in unmatched})
    return out, counts, unmatched_out


# Step caching (engine/programs/step_cache.py): the block list run in "full" or "cached" mode.


def slice_tokens(x, n: int):
    """x[:, :n]; for a torchax tensor sliced in JAX (a torchax slice is a lazy view that
    diffusers' type_as rejects)."""
    if x.shape[1] == n:
        return x
    if not type(x).__module__.startswith("torchax"):
        return x[:, :n]
    return interop.call_jax(lambda a: a[:, :n], x)


class CachedBlocks(torch.nn.Module):
    """Stands in for a transformer's block list (``ModuleList`` or
    ``scan_layers.ScannedBlocks``) and runs it in the mode the step program sets.

    Installed over the block list after the weights are placed. It shares the block list's
    children dict, so every state-dict name (``blocks.3.attn1...``, ``blocks.stacked...``)
    still resolves for ``functional_call``, and every hook (sequence parallelism's padding and
    sharding constraints) stays on the modules it was registered on. diffusers' ``for block
    in self.blocks`` iterates it and gets one callable that runs all blocks, like
    ``ScannedBlocks``.

    Modes (set by the step function for the length of one trace):
        "plain":  every block, nothing recorded (a run without a cache).
        "full":   every block; records what the cache keeps in ``self.record``: MagCache
                  the residual (B, N, D) (blocks' output minus input, model dtype); DeepCache
                  the carry entering block L-k (hidden (B, N, D), and the text stream for
                  HunyuanVideo-1.5), token padding of sequence parallelism sliced off.
        "cached": MagCache returns input + ``self.kept``; DeepCache runs blocks L-k..L-1 on
                  ``self.kept``, ignoring the input.
    """

    def __init__(self, blocks, stack, kind: str, recompute_blocks: int):
        super().__init__()
        self._modules = blocks._modules  # the same children under the same names
        object.__setattr__(self, "inner", blocks)  # not a child: its children are ours
        self.stack, self.kind, self.recompute_blocks = stack, kind, recompute_blocks
        self.mode, self.kept, self.record = "plain", None, None

    @property
    def num_layers(self) -> int:
        return getattr(self.inner, "num_layers", None) or len(self.inner)

    def __iter__(self):
        return iter((self,))

    def __len__(self) -> int:
        return 1

    def _run(self, start: int, stop: int, carry: tuple, rest: tuple) -> tuple:
        """Blocks start..stop-1 on ``carry``; returns the new carry as a tuple."""
        n = self.stack.carry
        if isinstance(self.inner, ScannedBlocks):
            self.inner.layer_range = (start, stop)
            try:
                out = self.inner(*carry, *rest)
            finally:
                self.inner.layer_range = None
            return tuple(out) if n > 1 else (out,)
        for block in list(self.inner)[start:stop]:
            out = block(*carry, *rest)
            carry = tuple(out) if n > 1 else (out,)
        return carry

    def forward(self, *args):
        n = self.stack.carry
        carry, rest = tuple(args[:n]), tuple(args[n:])
        layers = self.num_layers
        if self.mode == "cached" and self.kind == "magcache":
            out = (carry[0] + self.kept, *carry[1:])
        elif self.kind == "deepcache" and self.mode != "plain":
            split = layers - self.recompute_blocks
            if self.mode == "cached":
                out = self._run(split, layers, self.kept, rest)
            elif isinstance(self.inner, ScannedBlocks):
                self.inner.record_at = split
                try:
                    out = self._run(0, layers, carry, rest)
                    mid = self.inner.recorded
                finally:
                    self.inner.record_at, self.inner.recorded = None, None
            else:
                mid = self._run(0, split, carry, rest)
                out = self._run(split, layers, mid, rest)
            if self.mode == "full":
                # Sequence parallelism pads the tokens until after the last block; the
                # recorded input is the unpadded one, so a cached step pads it afresh.
                self.record = (slice_tokens(mid[0], carry[0].shape[1]), *mid[1:])
        else:
            out = self._run(0, layers, carry, rest)
            if self.mode == "full":
                self.record = out[0] - carry[0]
        return out if n > 1 else out[0]


def install_cached_blocks(transformer, stack, kind: str, recompute_blocks: int) -> CachedBlocks:
    """Put a ``CachedBlocks`` over ``transformer.<stack.attr>`` (after placement); returns it."""
    blocks = getattr(transformer, stack.attr)
    if isinstance(blocks, CachedBlocks):
        blocks.kind, blocks.recompute_blocks = kind, recompute_blocks
        return blocks
    cached = CachedBlocks(blocks, stack, kind, recompute_blocks)
    setattr(transformer, stack.attr, cached)
    return cached
