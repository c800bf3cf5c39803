"""What keeps a real TPU run safe: the kernel self-check, one-line hardware errors, loud
fallbacks, the VAE's attention kept off our kernel, and flow_shift by resolution."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import custom_splash_attention as csa
import families
import generate_flax as gf
from engine.files import report as reporting
from engine.pipeline import stages
from engine.run import runtime
from engine.run.mesh import MeshShape, make_mesh
from engine.weights import sharding
from families import wan, wan_vae

SMALL = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "2",
         "--warmup_steps", "0", "--compilation_cache_dir", "none"]


def _cli(capsys, argv):
    """Exit code and the error lines of an in-process run (progress bars share stderr)."""
    code = gf.cli(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, [line for line in err.splitlines() if line.startswith("generate_flax.py:")]


def test_wrong_kernel_stops_before_loading_with_one_line(tiny_checkpoint, tmp_path, capsys,
                                                         monkeypatch):
    def wrong(q, k, v, **kwargs):  # a plausible bug: the softmax scale applied twice
        scale = 1.0 / np.sqrt(q.shape[-1])
        return csa.reference_attention(q.astype(jnp.float32) * scale,
                                       k.astype(jnp.float32), v.astype(jnp.float32))

    monkeypatch.setattr(csa, "splash_attention", wrong)
    monkeypatch.setitem(families.FAMILIES, "wan", dataclasses.replace(
        wan.FAMILY, text=dataclasses.replace(
            wan.FAMILY.text, load_pipeline=lambda *a, **k: pytest.fail("weights loaded"))))
    out = tmp_path / "out"
    code, lines = _cli(capsys, ["--model_id", tiny_checkpoint, *SMALL, "--attention",
                                "splash", "--output_dir", str(out)])
    assert code == 1
    assert len(lines) == 1, lines
    assert "self-check failed" in lines[0] and "--attention stock_splash" in lines[0]
    assert not os.listdir(out)


@pytest.mark.parametrize("kernel", ["splash", "stock_splash"])
def test_self_check_passes_for_both_kernels(kernel):
    result = csa.kernel_self_check(kernel, interpret=True)
    assert result["passed"] and result["backend"] == kernel
    # bf16 roundings only (measured ~1e-3 here); well inside the tested tolerance.
    assert 0 < result["max_abs_error"] < result["tolerance"]
    assert result["shape"][2] % 128  # the ragged tail is part of the check


def test_self_check_catches_an_unmasked_tail():
    # Zero-padding keys without a mask, the known reference-port flaw, must fail the check.
    def unmasked(q, k, v, *, block_sizes, interpret):
        pad = -q.shape[2] % 128
        k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (k, v))
        return csa.xla_attention(q, k, v)

    result = csa.kernel_self_check("splash", interpret=True, attention_fn=unmasked)
    assert not result["passed"] and result["max_abs_error"] > result["tolerance"]


@pytest.mark.parametrize("mesh,split", [((), None), (("--dp", "2", "--tp", "1", "--sp", "4"),
                                                    "--tp 2 --sp 2 splits it")])
def test_device_oom_is_one_line_naming_stage_bytes_and_dry_run(tiny_checkpoint, tmp_path,
                                                               capsys, monkeypatch, mesh, split):
    # At tp 1 (Ulysses: the whole transformer on every chip) the line also names the flags
    # that split the weights.
    def oom(*args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate "
            "12.50G. That was not possible. There are 3.10G free.; (0x0x0_HBM0)")

    monkeypatch.setattr(stages, "compile_transformer", oom)
    out = tmp_path / "out"
    code, lines = _cli(capsys, ["--model_id", tiny_checkpoint, *SMALL, *mesh, "--output_dir",
                                str(out)])
    assert code == 1 and len(lines) == 1, lines
    line = lines[0]
    assert "out of device memory while compiling the transformer step" in line
    assert "allocating 12.50G with 3.10G free" in line
    assert "--dry_run --topology" in line and "--height 64 --width 96 --frames 9" in line
    assert (split in line) if split else ("splits it" not in line)
    assert not os.listdir(out)


@dataclasses.dataclass(frozen=True)
class FakeGpu:
    """What ``reporting.oom_hint`` reads of a device; no GPU is needed to check the words."""

    platform: str = "gpu"
    device_kind: str = "NVIDIA H200"


@pytest.mark.parametrize("attention,cudnn", [("auto", False), ("xla", True)])
def test_gpu_oom_hint_names_smaller_runs_and_cudnn_not_the_dry_run(tiny_checkpoint, attention,
                                                                    cudnn):
    # The dry run compiles for TPUs: on a GPU the hint names what shrinks the activations,
    # and cuDNN flash attention where another backend (XLA: the full score matrix) ran.
    config = gf.validate_args(gf.parse_args(["--model_id", tiny_checkpoint, *SMALL,
                                             "--attention", attention]))
    hint = reporting.oom_hint(config, [FakeGpu()] * 2, MeshShape(1, 1, 2))
    assert "--dry_run" not in hint and "--topology" not in hint
    assert "on NVIDIA H200" in hint and "fewer --frames (now 9)" in hint
    assert "smaller --height/--width (now 64x96)" in hint and "more GPUs with --sp" in hint
    assert ("--attention cudnn (flash attention) instead of --attention xla" in hint) == cudnn
    # A CPU keeps the TPU wording (the dry run is how a CPU host plans a TPU run).
    cpu = reporting.oom_hint(config, jax.devices()[:1], MeshShape(1, 1, 1))
    assert "--dry_run --topology" in cpu


def test_other_runtime_errors_are_not_called_oom():
    with pytest.raises(ValueError, match="shape"):
        with runtime.hardware_errors("placing"):
            raise ValueError("bad shape")


@pytest.mark.parametrize("text,want", [
    ("XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 40.10G of "
     "31.25G hbm. Exceeded hbm capacity by 8.85G.", "needs 40.10G of 31.25G"),
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
     "temporaries (24.48G) exceeds available HBM (15.75G)",
     "needs 24.48G (arguments and temporaries) of 15.75G"),
    ("RESOURCE_EXHAUSTED: Out of memory allocating 1048576 bytes.", "allocating 1048576 bytes"),
    ("RESOURCE_EXHAUSTED: something else", ""),
])
def test_oom_sizes_are_read_from_the_message(text, want):
    assert runtime.oom_details(text) == want


def test_undivided_weights_are_named():
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh(MeshShape(1, 4, 2), jax.devices())
    rules = ((r"a\.weight$", ("tp", None)), (r"b\.weight$", ("tp", None)))
    shapes = {"a.weight": (8, 3), "b.weight": (6, 3), "c.weight": (6, 3)}
    specs, _, unmatched = sharding.sharding_specs(shapes, rules, mesh)
    assert specs["a.weight"] == P("tp", None) and specs["b.weight"] == P(None, None)
    assert sharding.undivided_weights(specs, rules) == ["b.weight"]  # c has no rule: not a fallback
    assert unmatched == ["c.weight"]


def test_attention_the_wrapper_cannot_split_is_reported(monkeypatch):
    import torchax

    seen = []
    mesh = make_mesh(MeshShape(2, 4, 1), jax.devices())
    env = torchax.default_env()
    csa.install_sdpa_override(env, attention="splash", mesh=mesh, interpret=True,
                              on_fallback=lambda kind, detail: seen.append((kind, detail)))
    q = jnp.ones((1, 3, 16, 8), jnp.float32)  # batch 1 on dp=2, 3 heads on tp=4
    with env:
        out = torch.nn.functional.scaled_dot_product_attention(*env.j2t_iso((q, q, q)))
    assert np.allclose(np.asarray(env.t2j_iso(out)), 1.0)
    assert seen and seen[0][0] == "attention_to_xla" and "(1, 3, 16, 8)" in seen[0][1]


def test_vae_attention_never_reaches_a_splash_kernel(tiny_checkpoint, monkeypatch):
    """Even with --attention splash on one device (which the wrapper could split), the VAE's
    one-head float32 attention is traced with (chunked) XLA attention."""
    import torchax
    from diffusers import AutoencoderKLWan

    runtime.quiet_known_warnings()
    calls = {"splash": 0, "xla": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(csa, "sharded_splash_attention",
                        counting("splash", csa.sharded_splash_attention))
    # The "xla" backend's path: query-chunked XLA attention.
    monkeypatch.setattr(csa, "chunked_attention", counting("xla", csa.chunked_attention))
    mesh = make_mesh(MeshShape(1, 1, 1), jax.devices()[:1])
    csa.install_sdpa_override(torchax.default_env(), attention="splash", mesh=mesh,
                              interpret=True)
    vae = AutoencoderKLWan.from_pretrained(tiny_checkpoint, subfolder="vae",
                                           dtype=torch.float32).eval()
    placed = sharding.place_module(vae, mesh, include=wan_vae.is_vae_decode_weight)
    # Only the decode path's weights were placed; the encoder stayed on the host.
    assert placed["params"] and all(wan_vae.is_vae_decode_weight(k) for k in placed["params"])
    assert any(k.startswith("encoder.") for k in placed["module"].params)
    decoder = wan_vae.vae_decoder(placed, vae, mesh)
    latents = jnp.zeros((1, vae.config.z_dim, 2, 4, 6), jnp.float32)
    decoder.compile(latents)
    video = decoder(latents)
    assert video.shape == (1, 3, 5, 32, 48) and bool(jnp.isfinite(video).all())
    assert calls["splash"] == 0 and calls["xla"] > 0, calls


@pytest.mark.parametrize("size,given,want", [
    ((720, 1280), None, 5.0), ((1280, 720), None, 5.0), ((480, 832), None, 3.0),
    ((64, 96), None, 3.0), ((480, 832), 7.0, 7.0),
])
def test_flow_shift_defaults_by_resolution(tiny_checkpoint, size, given, want):
    argv = ["--model_id", tiny_checkpoint, "--height", str(size[0]), "--width", str(size[1])]
    if given is not None:
        argv += ["--flow_shift", str(given)]
    args = gf.validate_args(gf.parse_args(argv))
    assert args.video.flow_shift == want
    assert args.video.flow_shift_source == ("flag" if given is not None else "resolution")
