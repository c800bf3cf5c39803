"""``--quantize int8|fp8`` (engine/weights/quantize.py): the W8A8 linear against a float64
reference of the same arithmetic, whole-channel weight scales under every split, sharded
equal to unsharded, a LoRA fused before the 8 bits, and whole runs near bf16."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))
import generate_flax  # noqa: E402
from engine.pipeline.generation import generate  # noqa: E402
from engine.run import runtime  # noqa: E402
from engine.weights import lora, placement, quantize, sharding  # noqa: E402
from families import FAMILIES  # noqa: E402

QMAX = {"int8": 127.0, "fp8": 448.0}
TINY = float(np.sqrt(np.finfo(np.float32).tiny))


def _scales(a: np.ndarray, scheme: str) -> np.ndarray:
    """Per-row float32 scales by the scheme's definition: absmax x float32(1 / QMAX), 1 for
    a zero row."""
    s = (np.abs(a.astype(np.float32)).max(axis=-1) * np.float32(1 / QMAX[scheme])).astype(
        np.float32)
    return np.where(s < TINY, np.float32(1), s)


def _codes(a: np.ndarray, s: np.ndarray, scheme: str) -> np.ndarray:
    """The 8-bit codes of ``a`` (rows, cols) with per-row scales ``s``, as float64: the
    float32 product with the scale's float32 reciprocal, rounded once to the code."""
    inv = (np.float32(1) / s.astype(np.float32)).astype(np.float32)
    q = (a.astype(np.float32) * inv[:, None]).astype(np.float64)
    if scheme == "int8":
        return np.clip(np.rint(q), -127, 127)
    return np.clip(q, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def reference_linear(x, w, b, scheme: str, parts: bool = False):
    """W8A8 in float64: per-token x codes, per-channel w codes, exact products and sums,
    both float32 scales, bias; float64 (..., out). ``parts``: (scaled dot, bias) apart."""
    x2 = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    w32 = np.asarray(w, np.float32)
    xs, ws = _scales(x2, scheme), _scales(w32, scheme)
    acc = _codes(x2, xs, scheme) @ _codes(w32, ws, scheme).T
    y = (acc * xs.astype(np.float64)[:, None] * ws.astype(np.float64)[None, :]).reshape(
        *x.shape[:-1], w.shape[0])
    bias = np.zeros(w.shape[0]) if b is None else np.asarray(b, np.float64)
    return (y, bias) if parts else y + bias


def _ours(x, w, b, scheme: str, dtype):
    w32 = np.asarray(w, np.float32)
    ws = quantize.channel_scale(w32, scheme)
    wq = quantize.quantize_rows(w32, ws, scheme)
    fn = jax.jit(lambda x, wq, ws, b: quantize.quantized_linear(x, wq, ws, b, scheme=scheme))
    return fn(jnp.asarray(x, dtype), jnp.asarray(wq), jnp.asarray(ws),
              None if b is None else jnp.asarray(b, dtype))


def _ulp(ref: np.ndarray, dtype) -> np.ndarray:
    """One unit in the last place of ``dtype`` at each |ref|."""
    eps = float(jnp.finfo(dtype).eps)
    mag = np.maximum(np.abs(ref), float(jnp.finfo(dtype).tiny))
    return eps * 2.0 ** np.floor(np.log2(mag))


def _inputs(seed: int, dtype, shape=(2, 7, 45), out=29):
    rng = np.random.default_rng(seed)
    x = np.array(jnp.asarray(rng.normal(size=shape).astype(np.float32), dtype), np.float32)
    w = rng.normal(size=(out, shape[-1])).astype(np.float32) * 0.2
    x[0, 3] = 0.0  # an all-zero token: scale 1, codes 0
    w[5] = 0.0  # an all-zero output channel
    b = np.array(jnp.asarray(rng.normal(size=(out,)).astype(np.float32), dtype), np.float32)
    return x, w, b


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantized_linear_equals_float64_reference(scheme, dtype):
    x, w, b = _inputs(0, dtype)
    dot, bias = reference_linear(x, w, b, scheme, parts=True)
    ref = dot + bias
    got = np.asarray(_ours(x, w, b, scheme, dtype), np.float64)
    assert got.shape == ref.shape and _ours(x, w, b, scheme, dtype).dtype == dtype
    err = np.abs(got - ref)
    # The float32 work: the int32 sum converted (fp8: a float32 sum of exact products,
    # 45 terms), two scale products, the bias add: a few float32 roundings of the terms'
    # size; then the cast to the output dtype (one of its ulps at the result).
    size = np.maximum(np.abs(dot), np.abs(bias))
    f32 = 4 * _ulp(size, jnp.float32) + (45 * 2**-24 * np.abs(dot) if scheme == "fp8" else 0)
    out = _ulp(ref, dtype) if dtype == jnp.bfloat16 else 0
    assert np.all(err <= f32 + out), (err - f32 - out).max()
    # The zero token gives the bias alone; the zero channel gives its bias alone.
    np.testing.assert_allclose(got[0, 3], ref[0, 3], rtol=0, atol=float(_ulp(b, dtype).max()))
    no_bias = np.asarray(_ours(x, w, None, scheme, dtype), np.float64)
    assert np.all(no_bias[..., 5] == 0)


def test_codes_are_the_schemes_and_differ_from_float():
    """int8 codes fill [-127, 127] (the largest |w| of a row maps to 127); e4m3 codes reach
    448; the quantized product is not the float one (the test would notice a bf16 dot)."""
    x, w, b = _inputs(1, jnp.float32)
    for scheme in ("int8", "fp8"):
        q = quantize.quantize_rows(w, quantize.channel_scale(w, scheme), scheme)
        assert np.abs(q.astype(np.float32)).max() == QMAX[scheme]
        assert q.dtype == (np.int8 if scheme == "int8" else ml_dtypes.float8_e4m3fn)
        exact = x @ w.T + b
        got = np.asarray(_ours(x, w, b, scheme, jnp.float32))
        assert 1e-4 < np.abs(got - exact).max() < 0.1 * np.abs(exact).max()


def _safetensors(tmp_path, tensors: dict) -> str:
    from safetensors.torch import save_file

    folder = tmp_path / "weights"
    folder.mkdir()
    save_file({k: torch.from_numpy(v) for k, v in tensors.items()},
              str(folder / "model.safetensors"))
    return str(folder)


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_reader_quantizes_any_slice_with_whole_channel_scales(tmp_path, scheme):
    w = np.random.default_rng(2).normal(size=(12, 20)).astype(np.float32)
    w[:, 15:] *= 10  # each row's absmax lies in the last columns: a column split misses it
    reader = quantize.QuantizingReader(
        placement.SafetensorsReader(_safetensors(tmp_path, {"a.weight": w})), scheme)
    scale = _scales(w, scheme)
    codes = _codes(w, scale, scheme)
    assert "a.weight_scale" in reader.keys()
    np.testing.assert_array_equal(reader.read("a.weight_scale", (slice(4, 8),), torch.float32),
                                  scale[4:8])
    wdtype = quantize.SCHEMES[scheme][1]
    for rows, cols in ((slice(0, 12), slice(0, 10)), (slice(6, 12), slice(10, 20)),
                       (slice(3, 9), slice(0, 20))):
        got = reader.read("a.weight", (rows, cols), wdtype)
        np.testing.assert_array_equal(got.astype(np.float64), codes[rows, cols])


def _mesh(shape):
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), ("dp", "tp", "sp"))


@pytest.mark.parametrize("mesh_shape", [(2, 2, 2), (2, 1, 4)])
@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_sharded_equals_unsharded(mesh_shape, scheme):
    """x over dp (batch) and sp (tokens); the weight column-parallel (rows over tp) or
    row-parallel (input over tp, the per-token absmax and the sum all-reduced). int8: bit
    for bit (integer sums and a max are exact in any order). fp8: the column-parallel case
    bit for bit; the row-parallel sum, float32 partial sums in another order, within float32
    rounding."""
    mesh = _mesh(mesh_shape)
    x, w, b = _inputs(3, jnp.bfloat16, shape=(2, 16, 48), out=32)
    one = np.asarray(_ours(x, w, b, scheme, jnp.bfloat16).astype(jnp.float32))
    w32 = np.asarray(w, np.float32)
    ws = quantize.channel_scale(w32, scheme)
    wq = quantize.quantize_rows(w32, ws, scheme)
    for w_spec, x_last in ((P("tp", None), None), (P(None, "tp"), "tp")):
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        args = (put(jnp.asarray(x, jnp.bfloat16), P("dp", "sp", x_last)), put(wq, w_spec),
                put(ws, P(w_spec[0])), put(jnp.asarray(b, jnp.bfloat16), P(w_spec[0])))
        fn = jax.jit(lambda x, wq, ws, b: quantize.quantized_linear(x, wq, ws, b,
                                                                    scheme=scheme))
        got = np.asarray(fn(*args).astype(jnp.float32))
        if scheme == "int8" or w_spec[0] == "tp":
            np.testing.assert_array_equal(got, one)
        else:
            np.testing.assert_allclose(got, one, rtol=2**-7, atol=0)


def test_scale_specs_follow_the_weights_output_axis():
    specs = {"a.weight": P("tp", None), "a.weight_scale": P(None), "b.weight": P(None, "tp"),
             "b.weight_scale": P(None), "s.weight": P(None, ("tp", "sp"), None),
             "s.weight_scale": P(None, None)}
    out = quantize.scale_specs(specs)
    assert out["a.weight_scale"] == P("tp") and out["b.weight_scale"] == P(None)
    assert out["s.weight_scale"] == P(None, ("tp", "sp"))


def test_fp8_run_sends_gpu_dots_to_cublaslt_unless_the_user_chose():
    # An fp8 run asks for the flag (applied where the runtime starts); a user's own setting
    # wins; a dry run (TPU, deviceless) and int8 ask for nothing in XLA_FLAGS. The check
    # itself writes nothing (tests/test_process_env.py).
    family = FAMILIES["wan"]
    env = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
    runtime.apply_process_env(quantize.check_flag("fp8", family, None), env)
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_triton_gemm=false"
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    runtime.apply_process_env(quantize.prefer_cublas_fp8(), env)
    assert env == {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    assert quantize.check_flag("int8", family, None).xla_flags == ()
    assert quantize.check_flag("fp8", family, "tpu7x:2x2x1").xla_flags == ()


def test_8_bit_runs_ask_libtpu_to_fuse_the_quantization(monkeypatch):
    """Dry runs and runs that may take a TPU get the flag; the user's own setting wins; a run
    on another platform and an unquantized run leave LIBTPU_INIT_ARGS alone."""
    family, flag = FAMILIES["wan"], quantize.TPU_INPUT_FUSION
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    env = {"LIBTPU_INIT_ARGS": "--xla_jf_dump_to=/tmp/x"}
    runtime.apply_process_env(quantize.check_flag("int8", family, "v6e:2x4"), env)
    assert env["LIBTPU_INIT_ARGS"] == f"--xla_jf_dump_to=/tmp/x {flag}=true"
    env = {"LIBTPU_INIT_ARGS": f"{flag}=false"}
    runtime.apply_process_env(quantize.prefer_fused_quantization(env, dry_run=True), env)
    assert env == {"LIBTPU_INIT_ARGS": f"{flag}=false"}
    for settings in (quantize.check_flag("int8", family, None),  # JAX_PLATFORMS=cpu
                     quantize.check_flag("none", family, "v6e:2x4")):
        assert runtime.apply_process_env(settings, env := {}) == {} and env == {}
    env = {"JAX_PLATFORMS": "tpu,cpu"}
    runtime.apply_process_env(quantize.prefer_fused_quantization(env, dry_run=False), env)
    assert env["LIBTPU_INIT_ARGS"] == f"{flag}=true"


def test_lora_is_fused_before_the_8_bits(tiny_checkpoint_8h, tmp_path):
    """Placement with a PEFT LoRA at scale 0.7 and --quantize int8, on dp1 x tp4 x sp2 (q/k/v
    split by rows, to_out and ffn.2 by columns): each placed weight equals W + 0.7 B @ A,
    fused by hand from the two files, then quantized by the reference."""
    from safetensors.numpy import load_file
    from tiny_lora import write_lora

    cfg_path = os.path.join(tiny_checkpoint_8h, "transformer", "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    path = str(tmp_path / "peft.safetensors")
    write_lora(path, cfg, fmt="peft", rank=4, seed=1)
    family = FAMILIES["wan"]
    loras = lora.validate([f"{path}:0.7"], family, tiny_checkpoint_8h, "float32")
    module = family.transformer.empty(dict(cfg), torch.float32)
    names = quantize.apply(module, family, "int8")
    assert len(names) == 10 * cfg["num_layers"]
    placed = sharding.place_transformer(
        module, _mesh((1, 4, 2)), family.transformer.sharding_rules(_config(tiny_checkpoint_8h)),
        checkpoint=os.path.join(tiny_checkpoint_8h, "transformer"), fsdp=False, scan=False,
        loras=loras)
    files = load_file(os.path.join(tiny_checkpoint_8h, "transformer",
                                   "diffusion_pytorch_model.safetensors"))
    deltas = load_file(path)
    checked = 0
    for name in names:
        # PEFT's merge in float32, as diffusers' fuse_lora does it: W + (B @ A) * scale.
        w = torch.from_numpy(files[f"{name}.weight"]).float()
        a = deltas.get(f"transformer.{name}.lora_A.weight")
        if a is not None:
            b = torch.from_numpy(deltas[f"transformer.{name}.lora_B.weight"]).float()
            w = w + (b @ torch.from_numpy(a).float()) * 0.7
            checked += 1
        w = w.numpy()
        scale = _scales(w, "int8")
        got = placed["params"][f"{name}.weight"]
        assert got.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(got), _codes(w, scale, "int8").astype(np.int8))
        np.testing.assert_array_equal(np.asarray(placed["params"][f"{name}.weight_scale"]),
                                      scale)
    assert checked >= 10  # the LoRA touched these weights


def _config(checkpoint, *extra):
    return generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, "--compilation_cache_dir", "none", *extra]))


def _frames(checkpoint, shape, *extra, devices=None):
    args = _config(checkpoint, "--num_inference_steps", "2", "--num_iterations", "1",
                   "--warmup_steps", "0", "--attention", "xla", "--height", str(shape[0]),
                   "--width", str(shape[1]), "--frames", "5", *extra)
    frames, report = generate(args, FAMILIES[args.model.family], devices=devices)
    return frames, report


# Stated before measuring: a W8A8 run of a tiny random checkpoint stays within 4 levels of
# 255 in mean absolute frame difference of the bf16 run (its per-linear error is about 1% of
# the output: 8-bit codes for activations and weights), and differs from it.
MEAN_LEVELS_BOUND = 4.0


@pytest.mark.parametrize("case", ["wan-fp8-sharded", "wan22-int8", "hunyuan-int8"])
def test_quantized_run_stays_near_bf16(case, tiny_checkpoint, two_expert_ckpt,
                                       hunyuan_checkpoint):
    checkpoint, shape, scheme = {
        "wan-fp8-sharded": (tiny_checkpoint, (64, 96), "fp8"),
        "wan22-int8": (two_expert_ckpt, (64, 128), "int8"),
        "hunyuan-int8": (hunyuan_checkpoint, (48, 80), "int8")}[case]
    devices = None if case.endswith("sharded") else jax.devices()[:1]
    extra = ("--dp", "2", "--tp", "2", "--sp", "2") if devices is None else ()
    bf16, _ = _frames(checkpoint, shape, *extra, devices=devices)
    q, report = _frames(checkpoint, shape, "--quantize", scheme, *extra, devices=devices)
    levels = np.abs(np.asarray(q, np.float64) - np.asarray(bf16, np.float64)).mean() * 255
    assert 0 < levels <= MEAN_LEVELS_BOUND, levels
    entry = report["quantize"]
    assert entry["scheme"] == scheme and entry["modules"] > 0
    assert entry["weight_bytes_per_device"]["after"] < entry["weight_bytes_per_device"]["before"]


@pytest.fixture(scope="module")
def two_expert_ckpt(tmp_path_factory):
    from conftest import _build

    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan22-q",
                  "--experts", "2", "--boundary_ratio", "0.875")


DEVICELESS = """
import json, re, sys
sys.path.insert(0, {root!r})
from engine.run import runtime
runtime.use_deviceless_tpu({topology!r}, profile_libtpu=True)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from engine.dry_run import estimate, hlo
from engine.weights import quantize
mesh = Mesh(np.array(runtime.topology_desc({topology!r}).devices[:1]), ("x",))
sh = NamedSharding(mesh, P())
w = {{"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}}[{scheme!r}]
args = (jax.ShapeDtypeStruct((8192, 5120), jnp.bfloat16, sharding=sh),
        jax.ShapeDtypeStruct((5120, 5120), w, sharding=sh),
        jax.ShapeDtypeStruct((5120,), jnp.float32, sharding=sh),
        jax.ShapeDtypeStruct((5120,), jnp.bfloat16, sharding=sh))
text = jax.jit(lambda x, w, s, b: quantize.quantized_linear(x, w, s, b, scheme={scheme!r})
               ).lower(*args).compile().as_text()
comps = hlo.hlo_computations(text)
types = [sorted(hlo.matmul_operand_types(comps, {{n: r for n, r, _, _ in comps[c]}}, op, rest))
         for c in comps if c != "ENTRY" for _, _, op, rest in comps[c]
         if op in ("convolution", "dot")]
s = estimate.program_summary(text, {topology!r}.split(":")[0])
# An attention output's head-to-channel transpose before an output projection: top-level
# float32 arrays of its size (a float32 convert before the layout copy), with the barrier
# that ATTENTION_OUTPUT layers get and without.
heads = jax.ShapeDtypeStruct((1, 16, 4096, 128), jnp.bfloat16, sharding=sh)
w2 = jax.ShapeDtypeStruct((2048, 2048), w, sharding=sh)
f32_copies = {{}}
for barrier in (True, False):
    out = jax.jit(lambda x, w, s: quantize.quantized_linear(
        jnp.swapaxes(x, 1, 2).reshape(1, 4096, 2048), w, s, None, scheme={scheme!r},
        barrier=barrier)).lower(heads, w2, args[2].update(shape=(2048,))).compile().as_text()
    entry = out[out.index("ENTRY"):]
    f32_copies[barrier] = len(re.findall(r"= f32\\[1,(?:16,4096,128|4096,16,128|4096,2048)\\]",
                                         entry))
entry = text[text.index("ENTRY"):]
codes = len(re.findall(r"= (?:s8|f8e4m3fn)\\[8192,5120\\]", entry))
print(json.dumps(dict(types=types, flops=s["flops"], eight=s["eight_bit_flops"],
                      linear_s=s["linear_s"], hz=estimate.clock_hz({topology!r}.split(":")[0]),
                      f32_copies=[f32_copies[True], f32_copies[False]], codes=codes)))
"""


@pytest.mark.parametrize("topology,scheme,hlo_type", [("v6e:2x4", "int8", "s8"),
                                                      ("tpu7x:2x2x1", "fp8", "f8e4m3fn")])
def test_tpu_compiles_8_bit_matmuls_and_the_estimate_charges_the_8_bit_rate(
        topology, scheme, hlo_type):
    """Deviceless: libtpu keeps the matmul in 8 bits (both operands of the chip's 8-bit type,
    not a bf16 dot after an upcast), and the estimate charges its FLOPs at twice the bf16
    MXU rate. (Their final bundles issue ``vmatmul.mubr.s8`` on v6e and
    ``vmatmul.mubr.f8e4m3fn`` on tpu7x: benchmarks/quantize_results.md.)"""
    import importlib.util
    import subprocess

    from engine.dry_run import estimate

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu is not installed: no deviceless TPU compiler")
    if topology.startswith("tpu7x") and not os.path.exists(runtime.profile_libtpu_path()):
        pytest.skip("`make venv` installs the libtpu that compiles tpu7x")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for key in ("LIBTPU_INIT_ARGS", "TPU_LIBRARY_PATH", "TPU_ACCELERATOR_TYPE"):
        env.pop(key, None)
    # as a dry run applies check_flag's settings
    runtime.apply_process_env(quantize.prefer_fused_quantization(env, dry_run=True), env)
    code = DEVICELESS.format(root=ROOT, topology=topology, scheme=scheme)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["types"] == [[[hlo_type, hlo_type]]]
    # A Wan 14B projection on 8,192 tokens: compute-bound, so the rate shows in the time.
    assert out["flops"] == 2 * 8192 * 5120 * 5120 == out["eight"]
    chip = topology.split(":")[0]
    assert out["linear_s"] >= out["flops"] / (2 * estimate.MXU_FLOPS_PER_CYCLE[chip] * out["hz"])
    assert out["linear_s"] < out["flops"] / (estimate.MXU_FLOPS_PER_CYCLE[chip] * out["hz"])
    # The barrier keeps an attention output in bf16 through its layout copy (without it, v6e
    # converted it to float32 first: 1.65 ms per Wan 14B 720p layer, estimated).
    assert out["f32_copies"][0] == 0, f"float32 copies with / without the barrier: " \
        f"{out['f32_copies']}"
    # With prefer_fused_quantization's flag the codes never reach HBM: the quantization is
    # fused into the 8-bit matmul's input (without it, a fusion wrote them: 1.36 ms per Wan
    # 14B 720p layer on v6e).
    assert out["codes"] == 0


def test_reader_counts_the_8_bit_bytes_it_delivers(tmp_path):
    """``bytes_read`` (the report's bytes read by this host) counts the int8 slices served,
    not the float32 copy the channel scales are computed from."""
    w = np.random.default_rng(4).normal(size=(12, 20)).astype(np.float32)
    reader = quantize.QuantizingReader(
        placement.SafetensorsReader(_safetensors(tmp_path, {"a.weight": w})), "int8")
    reader.read("a.weight", (slice(0, 6), slice(0, 20)), torch.int8)
    reader.read("a.weight", (slice(6, 12), slice(0, 20)), torch.int8)
    assert reader.bytes_read == 12 * 20
