"""``--quantize int8|fp8``: W8A8 linear layers, weights quantized at placement.

The scheme (the one LightX2V ships for Wan 2.1/2.2 and tpu-inference runs through torchax):

* **Weights**, symmetric per output channel: for ``W`` (out, in) in float32 (after any LoRA
  is fused), ``scale[o] = max_i |W[o, i]| / QMAX`` and ``W_q[o, i] = Q(W[o, i] / scale[o])``.
  The scale always comes from the **whole** channel, whatever slice of it a device holds
  (tensor parallelism splits a weight's input dimension for row-parallel layers).
* **Activations**, symmetric per token, inside the step: for ``x`` (..., in),
  ``s[t] = max_i |x[t, i]| / QMAX`` and ``x_q = Q(x / s)``.
* **The dot**: ``x_q @ W_q^T`` with a 32-bit accumulator (int32 for int8, float32 for fp8),
  then ``* s[t] * scale[o]`` in float32, ``+ bias``, cast to the activation's dtype.

The scale is ``absmax * float32(1 / QMAX)``, and both divide by the scale as a multiply by
its float32 reciprocal, ``a * (1 / scale)``, as AQT does (qwix's
``USE_RECIPROCAL_FOR_QUANTIZATION``): XLA rewrites a division by a broadcast scale into
that multiply anyway, and a quotient one float32 ulp off flips a code at an exact tie
(frequent with bf16 activations), so host and device use the one form.
``Q`` is round-half-to-even and clip to [-127, 127] for int8 (QMAX 127; -128 is never used,
so the range is symmetric), and the cast to ``float8_e4m3fn`` after a clip to [-448, 448]
for fp8 (QMAX 448, e4m3's largest finite value). A scale under sqrt(float32 tiny) (an
all-zero row) is replaced by 1, as qwix does (``qwix/_src/core/qarray.py``,
``compute_scale_zero_point``), so zeros quantize to zeros.

Sources: qwix's ``quantize_api`` (absmax calibration, divide by the scale, convert) and
``dot_general`` (8-bit operands, a wider ``preferred_element_type``); tpu-inference's torchax
int8 path (``jax.lax.dot_general(x_q, w_q, preferred_element_type=jnp.int32)``). qwix itself
is not used: its ``QArray`` needs Flax (not otherwise a dependency), and its model
interception rewrites Flax modules, which a torchax-run diffusers model has none of; the op
here is the same arithmetic in a dozen lines of ``jax.lax``.

Which layers: the family names them (``Transformer.quantized_linears``, a regex over module
names): the transformer blocks' attention projections and MLPs. Attention's own matmuls
(QK^T, PV, in the Splash kernel), norms, embeddings, the time/modulation projections and the
output head stay in the run dtype.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from torchax import interop

from engine.run import chips
from engine.run.errors import fail
from engine.run.runtime import ProcessEnv

# scheme -> (QMAX, the weight's torch dtype, its NumPy dtype, the dot's accumulator)
SCHEMES = {
    "int8": (127.0, torch.int8, np.int8, jnp.int32),
    "fp8": (448.0, torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn, jnp.float32),
}
EIGHT_BIT_DTYPES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
_TINY_SQRT = float(np.sqrt(np.finfo(np.float32).tiny))
SCALE_SUFFIX = ".weight_scale"
# libtpu's option to fuse a downcast convert into a convolution's input
# (``prefer_fused_quantization``).
TPU_INPUT_FUSION = "--xla_tpu_allow_conv_input_fusion_with_downcast_convert"
# diffusers' ``Attention`` output projections (video and, in dual-stream blocks, text): their
# input is the attention kernel's output, already in memory (``quantized_linear``'s barrier).
ATTENTION_OUTPUT = r"(^|\.)(to_out\.0|to_add_out)$"


CHOICES = ("none", "int8", "fp8")
HELP = ("W8A8 for the transformer blocks' linear layers: weights per output channel, "
        "quantized as they are placed; activations per token; an 8-bit dot with a 32-bit "
        "accumulator. int8 on TPU v5e/v5p/v6e, fp8 (e4m3) on TPU7x and on GPUs of compute "
        "capability 8.9+ (Hopper, Ada, Blackwell); both on CPU. Attention, norms, embeddings, "
        "modulation and the output head stay in --dtype (docs/features.md)")


def add_flag(g) -> None:
    """``--quantize`` on an argparse group."""
    g.add_argument("--quantize", choices=CHOICES, default="none", help=HELP)


def eight_bit_for(chip_name: str | None, device=None) -> str | tuple[str, ...] | None:
    """The 8-bit scheme(s) ``--quantize`` may name on a TPU ``chip_name`` ("v6e") or, with
    ``chip_name`` None, on ``device`` (a ``jax.Device``): ("int8", "fp8") on CPU; None where
    no 8-bit rate is known (TPU v4, GPUs before compute capability 8.0)."""
    if chip_name is not None:
        chip = chips.CHIPS.get(chip_name)
        return None if chip is None else chip.eight_bit
    if device is None or device.platform == "cpu":
        return ("int8", "fp8")
    if device.platform == "gpu" or device.platform == "cuda":
        cc = tuple(int(x) for x in str(getattr(device, "compute_capability", "0.0")).split("."))
        return "fp8" if cc >= (8, 9) else "int8" if cc >= (8, 0) else None
    return None


def check_scheme(scheme: str, family, where: str, allowed) -> None:
    """Refuse ``--quantize scheme`` in one line (exit 2) where ``family`` names no 8-bit
    layers or ``where`` (a chip or device, for the message) runs another 8-bit type.

    ``allowed``: ``eight_bit_for``'s answer for that chip or device."""
    if scheme == "none":
        return
    if family.transformer.quantized_linears is None:
        fail("--quantize", scheme, f"not supported for {family.name} (its transformer names "
             "no 8-bit linear layers)")
    if allowed is None:
        fail("--quantize", scheme, f"{where} has no 8-bit matmul rate above bf16's; use "
             "--quantize none")
    if scheme not in ((allowed,) if isinstance(allowed, str) else allowed):
        fail("--quantize", scheme, f"{where} runs 8-bit matmuls as {allowed}, not {scheme}: "
             f"use --quantize {allowed}")


def check_flag(scheme: str, family, topology: str | None, env=os.environ) -> ProcessEnv:
    """``--quantize`` before any model loads: the family must name 8-bit layers and a dry
    run's ``topology`` ("v6e:2x4") must run ``scheme`` at its 8-bit rate. A real run checks
    its devices in the prologue (``engine.pipeline.prologue.start``).

    Returns the process settings ``scheme`` asks for (``env``, the environment, is read, never
    written; ``engine.run.runtime.apply_process_env`` applies them where the runtime starts,
    before the backend): an fp8 run gets ``prefer_cublas_fp8``'s XLA flag, and every 8-bit
    run and dry run that may compile for a TPU ``prefer_fused_quantization``'s libtpu flag.

    Raises:
        UsageError: ``check_scheme``'s refusals.
    """
    settings = ProcessEnv()
    if topology:
        check_scheme(scheme, family, topology, eight_bit_for(topology.split(":")[0]))
    else:
        check_scheme(scheme, family, "this host", CHOICES[1:])
        if scheme == "fp8":
            settings += prefer_cublas_fp8()
    if scheme != "none":
        settings += prefer_fused_quantization(env, dry_run=bool(topology))
    return settings


def prefer_fused_quantization(env, *, dry_run: bool) -> ProcessEnv:
    """``TPU_INPUT_FUSION=true`` for ``LIBTPU_INIT_ARGS`` (added unless the user set that
    flag, ``ProcessEnv``), for a dry run (its deviceless TPU compile) or a run that may take a
    TPU (``JAX_PLATFORMS`` in ``env`` unset or naming tpu); else nothing. libtpu then fuses
    the activations' quantization (a downcast convert to s8 / f8e4m3fn) into the 8-bit
    convolution's input, as it fuses a bf16 producer into a bf16 one, instead of a pass that
    writes the codes.

    Why (deviceless compiles of one Wan 14B 720p block, 2026-11-28): without the flag every
    8-bit operand was its own fusion writing its codes to HBM and read back by the matmul
    (1.36 ms per layer on v6e); with it the step's estimate goes 2.695 -> 2.648 s on
    ``v6e:2x4`` (int8) and 2.059 -> 2.038 s on ``tpu7x:2x2x1`` (fp8). A libtpu option that is
    off by default (in 0.0.42.1 and 0.0.51); the values are the same ops, fused. Its effect
    on a TPU has not been measured (no TPU here). The flag is read when libtpu starts, so
    it must be applied before. To keep libtpu's default, set the flag to false yourself.
    """
    platforms = env.get("JAX_PLATFORMS", "")
    if not dry_run and platforms and "tpu" not in platforms.split(","):
        return ProcessEnv()
    return ProcessEnv(libtpu_args=(f"{TPU_INPUT_FUSION}=true",))


def prefer_cublas_fp8() -> ProcessEnv:
    """``--xla_gpu_enable_triton_gemm=false`` for ``XLA_FLAGS`` (added unless the user set
    that flag, ``ProcessEnv``): XLA's GPU compiler then sends the f8e4m3fn dots to cuBLASLt's
    fp8 GEMM.

    Why (one H200, jax 0.11.2, 2026-11-27, ``benchmarks/fp8_probe.py``): with Triton GEMMs on,
    compiling one (2, 32760, 1536) x (8960, 1536) fp8 linear had not finished after 45 s (its
    autotuning), and a whole Wan 1.3B step had not after ~180 s; with them off each linear
    compiled in under 0.25 s as ``__cublas$lt$matmul$f8``. The flag is read when the backend
    starts (so it must be applied before); CPU and TPU backends do not read it.
    """
    return ProcessEnv(xla_flags=("--xla_gpu_enable_triton_gemm=false",))


def apply(module: torch.nn.Module, family, scheme: str) -> list[str]:
    """``quantize_linears`` with the family's layers (``Transformer.quantized_linears``);
    nothing for scheme "none". Returns the module names quantized."""
    if scheme == "none":
        return []
    return quantize_linears(module, family.transformer.quantized_linears, scheme)


def scheme_of(dtype) -> str | None:
    """"int8" / "fp8" for a quantized weight's torch dtype, else None."""
    return EIGHT_BIT_DTYPES.get(dtype)


def channel_scale(w: np.ndarray, scheme: str) -> np.ndarray:
    """Per-row scales of ``w`` (out, in), float32 (out,): absmax x float32(1 / QMAX), 1 for
    a zero row."""
    qmax = SCHEMES[scheme][0]
    scale = (np.max(np.abs(w.astype(np.float32)), axis=-1) * np.float32(1 / qmax)).astype(
        np.float32)
    return np.where(scale < _TINY_SQRT, np.float32(1.0), scale)


def quantize_rows(w: np.ndarray, scale: np.ndarray, scheme: str) -> np.ndarray:
    """``w`` (rows, cols) in 8 bits with one float32 scale per row (rows,): int8 or
    ``ml_dtypes.float8_e4m3fn``, as the module docstring's ``Q``."""
    qmax, _, np_dtype, _ = SCHEMES[scheme]
    inv = (np.float32(1) / scale.astype(np.float32)).astype(np.float32)
    q = w.astype(np.float32) * inv[:, None]
    if scheme == "int8":
        return np.clip(np.rint(q), -qmax, qmax).astype(np.int8)
    return np.clip(q, -qmax, qmax).astype(np_dtype)


def quantize_tokens(x: jax.Array, scheme: str) -> tuple[jax.Array, jax.Array]:
    """(x_q, s): ``x`` (..., in) quantized per token (last axis reduced) and its float32
    scales (..., 1)."""
    qmax, _, _, _ = SCHEMES[scheme]
    # The absmax in x's own dtype: |x| and max are exact in any float type.
    s = jnp.max(jnp.abs(x), axis=-1, keepdims=True).astype(jnp.float32) * np.float32(1 / qmax)
    s = jnp.where(s < _TINY_SQRT, 1.0, s)
    q = x.astype(jnp.float32) * (1.0 / s)
    if scheme == "int8":
        return jnp.clip(jnp.round(q), -qmax, qmax).astype(jnp.int8), s
    return jnp.clip(q, -qmax, qmax).astype(jnp.float8_e4m3fn), s


def quantized_linear(x: jax.Array, w_q: jax.Array, w_scale: jax.Array, bias, *,
                     scheme: str, barrier: bool = False) -> jax.Array:
    """W8A8 ``x @ W^T + b``.

    Args:
        x: (..., in) activations, any float dtype (the output takes it).
        w_q: (out, in) int8 or float8_e4m3fn weight.
        w_scale: (out,) float32 per-channel scales.
        bias: (out,) or None.
        scheme: "int8" or "fp8".
        barrier: ``x`` is in memory anyway (an attention output, ``ATTENTION_OUTPUT``): an
            optimization barrier keeps XLA from converting it to float32 for the codes
            *before* the head-to-channel layout copies, which then moved 4 bytes per
            element instead of 2 (two copies and two converts of Wan 14B 720p's attention
            outputs: 1.65 ms per layer on v6e, estimated). Values are unchanged.

    Returns:
        (..., out) in ``x.dtype``.
    """
    if barrier:
        x = jax.lax.optimization_barrier(x)
    acc_dtype = SCHEMES[scheme][3]
    x_q, s = quantize_tokens(x, scheme)
    acc = jax.lax.dot_general(x_q, w_q, (((x.ndim - 1,), (1,)), ((), ())),
                              preferred_element_type=acc_dtype)
    y = acc.astype(jnp.float32) * s * w_scale.astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype)


class QuantLinear(torch.nn.Module):
    """A ``torch.nn.Linear`` whose weight is 8-bit with a per-output-channel scale.

    Parameters (so placement shards and streams them like any weight): ``weight`` (out, in)
    int8 / float8_e4m3fn, ``weight_scale`` (out,) float32, ``bias`` (out,) in the run dtype
    or None. Runs only under torchax (its forward is ``quantized_linear`` in JAX). An 8-bit
    tensor cannot require grad, so torchax's ``JittableModule`` files ``weight`` among the
    buffers: ``jittable`` moves it back among the params.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: str,
                 bias_dtype, device=None, barrier: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.barrier = barrier  # ``quantized_linear``'s: the input is an attention output
        wdtype = SCHEMES[scheme][1]
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, dtype=wdtype, device=device),
            requires_grad=False)
        self.weight_scale = torch.nn.Parameter(
            torch.ones(out_features, dtype=torch.float32, device=device))
        self.bias = None if not bias else torch.nn.Parameter(
            torch.empty(out_features, dtype=bias_dtype, device=device))

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, scheme: str,
                    barrier: bool = False) -> QuantLinear:
        """The 8-bit twin of ``linear``: quantized from its values, or meta if it is meta."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme,
                  w.dtype, device="meta" if w.is_meta else None, barrier=barrier)
        if not w.is_meta:
            host = w.detach().float().numpy()
            scale = channel_scale(host, scheme)
            q = quantize_rows(host, scale, scheme)
            out.weight.data = (torch.from_numpy(q) if scheme == "int8" else
                               torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn))
            out.weight_scale.data = torch.from_numpy(scale)
            if linear.bias is not None:
                out.bias.data = linear.bias.detach().clone()
        return out

    def forward(self, x):
        return interop.call_jax(_linear_fn(self.scheme, self.barrier), x, self.weight,
                                self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme={self.scheme}, barrier={self.barrier}")


_FNS: dict = {}


def _linear_fn(scheme: str, barrier: bool):
    # One function object per setting: torchax's call_jax caches by the function's identity.
    if (scheme, barrier) not in _FNS:
        _FNS[scheme, barrier] = lambda x, w, s, b: quantized_linear(x, w, s, b, scheme=scheme,
                                                                    barrier=barrier)
    return _FNS[scheme, barrier]


def quantize_linears(module: torch.nn.Module, pattern: str, scheme: str) -> list[str]:
    """Replace, in place, every ``torch.nn.Linear`` of ``module`` whose dotted name matches
    ``pattern`` (``re.search``) by its ``QuantLinear``; modules already quantized stay.

    Returns:
        The names replaced (or already quantized), in module order.
    """
    names = []
    for name, child in list(module.named_modules()):
        if not name or not re.search(pattern, name):
            continue
        if isinstance(child, QuantLinear):
            names.append(name)
        elif type(child) is torch.nn.Linear:
            parent, _, leaf = name.rpartition(".")
            holder = module.get_submodule(parent) if parent else module
            barrier = re.search(ATTENTION_OUTPUT, name) is not None
            setattr(holder, leaf, QuantLinear.from_linear(child, scheme, barrier))
            names.append(name)
    return names


def jittable(module: torch.nn.Module):
    """``torchax.interop.JittableModule(module)`` with the 8-bit weights among ``params``
    (torchax files tensors that do not require grad as buffers, and buffers are replicated
    from the host; these must be sharded and streamed like the weights they replace)."""
    jm = interop.JittableModule(module)
    for name in [k for k, v in jm.buffers.items() if scheme_of(v.dtype)]:
        jm.params[name] = jm.buffers.pop(name)
    return jm


def report(scheme: str, names: list, params: dict, run_dtype) -> dict | None:
    """The report's ``quantize`` entry (None without ``--quantize``): the scheme, the module
    names run in 8 bits, and the transformer weights' bytes on the fullest local device
    as placed ("after") and as they would be in ``run_dtype`` without the 8 bits and
    scales ("before").

    Args:
        params: {name: placed ``jax.Array``} (``place_module``'s ``params``).
        run_dtype: the run's torch dtype (``--dtype``).
    """
    if not names:
        return None
    itemsize = torch.empty((), dtype=run_dtype).element_size()
    before: dict = {}
    after: dict = {}
    for name, arr in params.items():
        for shard in arr.addressable_shards:
            n, d = shard.data.size, shard.device.id
            after[d] = after.get(d, 0) + n * arr.dtype.itemsize
            kept = 0 if name.endswith(SCALE_SUFFIX) else n * (
                itemsize if scheme_of_jax(arr.dtype) else arr.dtype.itemsize)
            before[d] = before.get(d, 0) + kept
    return dict(scheme=scheme, modules=len(names), names=list(names),
                weight_bytes_per_device=dict(before=max(before.values()),
                                             after=max(after.values())))


def scheme_of_jax(dtype) -> str | None:
    """"int8" / "fp8" for an 8-bit JAX dtype, else None."""
    return {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.float8_e4m3fn): "fp8"}.get(
        jnp.dtype(dtype))


def summary_line(entry: dict | None) -> str | None:
    """One line for the run summary: the scheme, modules and weight bytes per device."""
    if not entry:
        return None
    b = entry["weight_bytes_per_device"]
    return (f"{entry['modules']} linear layers in {entry['scheme']}: transformer weights "
            f"{b['before'] / 2**30:.3f} -> {b['after'] / 2**30:.3f} GiB per device")


def scale_specs(specs: dict) -> dict:
    """``specs`` with each ``<X>.weight_scale`` laid out as ``<X>.weight``'s output axis: a
    column-parallel weight's scales split with its rows, a row-parallel one's replicated
    (its input split leaves every device whole rows' scales, computed from whole rows)."""
    out = dict(specs)
    for name, spec in specs.items():
        if name.endswith(SCALE_SUFFIX):
            weight = out.get(name[:-len("_scale")])
            if weight is not None:
                # The scale's axes are the weight's leading ones minus "in" (a scanned
                # weight (L, out, in) has scales (L, out)).
                out[name] = type(spec)(*tuple(weight)[:len(spec)])
    return out


class QuantizingReader:
    """A ``placement.SafetensorsReader`` that quantizes on read: a slice of an 8-bit weight
    is read in float32 (LoRA delta fused), divided by its rows' whole-channel scales and
    rounded; ``<X>.weight_scale`` (not in the files) is computed from ``<X>.weight``'s whole
    rows. Reads in any other dtype pass through. Each weight's scales are computed once
    (from the whole weight, one weight in float32 on the host at a time) and kept (out
    floats per weight)."""

    def __init__(self, reader, scheme: str):
        self.reader, self.scheme = reader, scheme
        self._scales: dict = {}
        self._last: tuple = (None, None)

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read

    def keys(self) -> set:
        keys = self.reader.keys()
        return keys | {k + "_scale" for k in keys if k.endswith(".weight")}

    def source(self, name: str) -> str:
        """The file tensor a read of ``name`` draws on (LoRA deltas are keyed by it)."""
        return name[:-len("_scale")] if name.endswith(SCALE_SUFFIX) else name

    def _scale(self, weight: str, fuse) -> np.ndarray:
        if weight not in self._scales:
            whole = self.reader.read(weight, (slice(None), slice(None)), torch.float32, fuse)
            # bytes_read counts what reaches the devices (as for unquantized weights), not
            # this float32 working copy: the slices served below count their 8-bit bytes.
            self.reader.bytes_read -= whole.nbytes
            self._scales[weight] = channel_scale(whole, self.scheme)
            # The whole weight's codes, for the slices read next (placement reads a weight's
            # slices one after another): one read and one quantization per weight.
            self._last = (weight, quantize_rows(whole, self._scales[weight], self.scheme))
        return self._scales[weight]

    def read(self, name: str, index: tuple, dtype, fuse=None) -> np.ndarray:
        """As ``SafetensorsReader.read``; ``fuse`` is the LoRA delta of ``source(name)``."""
        if name.endswith(SCALE_SUFFIX) and name not in self.reader.keys():
            return self._scale(self.source(name), fuse)[index]
        if scheme_of(dtype) is None:
            return self.reader.read(name, index, dtype, fuse)
        rows = self._scale(name, fuse)[index[0]]
        if self._last[0] == name:
            out = np.ascontiguousarray(self._last[1][index])
            self.reader.bytes_read += out.nbytes
            return out
        return quantize_rows(self.reader.read(name, index, torch.float32, fuse), rows,
                             self.scheme)
