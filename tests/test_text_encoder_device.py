"""``--text_encoder_device mesh`` (issue 64 item 1): the encoders' forwards through torchax on
the run's mesh (engine/pipeline/text_device.py).

References: the same family's own encode functions (``family.text.encode_text``, diffusers'
``encode_image``) run eagerly on the CPU, float32, on the same tiny checkpoint and texts,
before the modules move; the frames of a ``--text_encoder_device cpu`` run with the same
flags. The mesh programs are XLA's, not torch's CPU kernels, so equal means within float32
rounding: the bounds below are the measured differences times about 10.
"""

import json
import os
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import torch
from PIL import Image
from torchax import interop
from torchax.ops import ops_registry

import generate_flax
from engine.pipeline import generate, prologue, text_device
from engine.run.errors import UsageError
from engine.run.mesh import make_mesh
from engine.weights import placement
from families import FAMILIES

SMALL = ["--height", "32", "--width", "32", "--frames", "5", "--num_inference_steps", "2",
         "--dtype", "float32", "--attention", "xla", "--warmup_steps", "1",
         "--num_iterations", "1", "--guidance_scale", "5"]
IMAGE = os.path.join(os.path.dirname(__file__), "data", "first_frame.png")
# float32 through XLA against torch's CPU kernels, 8 devices, measured: UMT5 1.2e-6, ByT5
# 1.2e-6, Qwen2.5-VL 7.5e-9 (its embeddings are below 0.07), Gemma 3 + connectors 2.2e-6,
# CLIP 4.8e-7 (embeddings up to 3.9). Before torchax's in-place-on-view fix was installed for
# the encoders, LTX-2's connectors were off by 0.23: the bound catches such a bug.
EMBEDDING_ATOL = 1e-5
# Frames in [0, 1]: measured 3.0e-7 (Wan, one device and eight).
FRAMES_ATOL = 1e-5


def _config(checkpoint, *extra):
    return generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, *SMALL, "--compilation_cache_dir", "none", *extra]))


def _loaded(checkpoint, n_devices: int, *extra):
    """(config with --text_encoder_device mesh, family, the loaded pipeline, the run's mesh
    on ``n_devices`` CPU devices)."""
    config = _config(checkpoint, "--text_encoder_device", "mesh", *extra)
    family = FAMILIES[config.model.family]
    start = prologue.start(config, family, jax.devices()[:n_devices])
    pipe, _ = start.load(())
    return config, family, pipe, make_mesh(start.mesh_shape, start.devices)


def _assert_close(ours: dict, want: dict, what: str) -> float:
    worst = 0.0
    for name, w in want.items():
        o = ours[name]
        assert o.shape == w.shape and o.dtype == w.dtype, (what, name, o.shape, w.shape)
        diff = (o.double() - w.double()).abs().max().item() if w.numel() else 0.0
        assert diff <= EMBEDDING_ATOL, f"{what} {name}: {diff:.3g} > {EMBEDDING_ATOL}"
        worst = max(worst, diff)
    return worst


def _on_mesh(pipe, family, config, mesh, encode, names: tuple):
    """``encode()`` with the family's encoders on ``mesh``; (its result, the report entry).
    Checks every module in ``names`` ran there, sharded where the mesh has devices to
    shard over, and has its own forward and CPU weights back after."""
    report: dict = {}
    modules = family.text.encoder_modules(pipe)
    assert set(names) <= set(modules), (names, list(modules))
    encoders = text_device.start(pipe, family, config, mesh, report)
    try:
        out = encode()
    finally:
        text_device.finish(encoders)
    entry = report["text_encoders"]
    assert entry["device"] == "mesh" and entry["after_encode"] == "freed"
    for name in names:
        stats = entry["modules"][name]
        assert stats["calls"] >= 1 and stats["programs"] >= 1, (name, stats)
        if mesh.size > 1:
            assert stats["bytes_per_device"] < stats["bytes"], (name, stats)
        assert "forward" not in modules[name].__dict__
    return out, entry


def test_encoding_attention_is_torchs_sdpa_inside_its_scope_only(torchax_env):
    """The encoders' SDPA against torch's own CPU SDPA (the reference): grouped keys
    (``enable_gqa``, as transformers passes it without a mask), a boolean mask with a fully
    masked query row (torch gives zeros there) and an additive one. Outside the scope the
    previous definition runs: torchax's own gives NaN on the empty row."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=g) for shape in ((1, 4, 6, 8), (1, 2, 6, 8),
                                                                (1, 2, 6, 8)))
    mask = torch.rand((1, 1, 6, 6), generator=g) > 0.4
    mask[0, 0, 2] = False  # query 2 sees no key
    additive = torch.randn((1, 1, 6, 6), generator=g)
    cases = [dict(enable_gqa=True), dict(attn_mask=mask, enable_gqa=True),
             dict(attn_mask=additive, enable_gqa=True)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # torchax's own SDPA outside the scope, whatever an earlier test installed (the fixture
    # restores that after)
    torchax_env._ops[sdpa] = ops_registry.all_torch_functions[sdpa]

    def traced(scoped: bool, kwargs: dict, k=k, v=v):
        def fn(q, k, v, m):
            token = text_device._ENCODING.set(scoped)
            try:
                return sdpa(q, k, v, **({**kwargs, "attn_mask": m} if m is not None
                                        else kwargs))
            finally:
                text_device._ENCODING.reset(token)

        m = kwargs.get("attn_mask")
        arrays = [jax.numpy.asarray(x.numpy()) for x in (q, k, v)]
        out = jax.jit(interop.jax_view(fn))(*arrays, None if m is None else
                                            jax.numpy.asarray(m.numpy()))
        return torch.from_numpy(np.array(out))

    attention = text_device.EncodingAttention()
    try:
        for kwargs in cases:
            want = sdpa(q, k, v, **kwargs)
            got = traced(True, kwargs)
            assert (got - want).abs().max().item() <= 1e-6, kwargs
        assert torch.equal(sdpa(q, k, v, **cases[1])[0, :, 2], torch.zeros(4, 8))
        outside = traced(False, dict(attn_mask=mask), k.repeat_interleave(2, 1),
                         v.repeat_interleave(2, 1))  # torchax's own SDPA
        assert torch.isnan(outside[0, :, 2]).all()
    finally:
        attention.restore()
    assert torchax_env._ops.get(sdpa) is attention.previous


TEXTS = ("a red fox in the snow", 'a sign that reads "OPEN"')


@pytest.mark.parametrize("fixture, names", [
    ("tiny_checkpoint", ("text_encoder",)),  # UMT5
    ("hunyuan_checkpoint", ("text_encoder", "text_encoder_2")),  # Qwen2.5-VL, ByT5 (quotes)
    ("ltx2_checkpoint", ("text_encoder", "connectors")),  # Gemma 3, LTX2TextConnectors
])
def test_mesh_embeddings_equal_the_cpus(request, fixture, names):
    """Sharded over 8 CPU devices, each text's embeddings equal the CPU encode's, and the
    modules are whole and on the CPU again after (a CPU encode then is bitwise the first)."""
    extra = ("--frames", "9") if fixture == "ltx2_checkpoint" else ()  # 8n + 1
    config, family, pipe, mesh = _loaded(request.getfixturevalue(fixture), 8, *extra)
    want = {t: family.text.encode_text(pipe, config, t) for t in TEXTS}
    ours, entry = _on_mesh(pipe, family, config, mesh,
                           lambda: {t: family.text.encode_text(pipe, config, t) for t in TEXTS},
                           names)
    for text in TEXTS:
        _assert_close(ours[text], want[text], f"{fixture} {text!r}")
    # The padded length compiles once: every text of one module runs one program.
    assert all(s["programs"] == 1 for s in entry["modules"].values()), entry
    again = family.text.encode_text(pipe, config, TEXTS[0])
    assert all(torch.equal(again[k], v) for k, v in want[TEXTS[0]].items())


@pytest.fixture(scope="module")
def hunyuan_i2v_checkpoint(tmp_path_factory):
    from conftest import _build

    return _build(tmp_path_factory, "make_tiny_hunyuan_checkpoint.py", "tiny-hunyuan15-i2v",
                  "--i2v")


@pytest.mark.parametrize("fixture", [
    "i2v_checkpoint",
    # its own checkpoint build (~7 s) and a SigLIP compile: CLIP keeps the path in CI
    pytest.param("hunyuan_i2v_checkpoint", marks=pytest.mark.slow)])
def test_mesh_image_embeddings_equal_the_cpus(request, fixture):
    """The image encoders (Wan 2.1 I2V's CLIP: penultimate hidden states; HunyuanVideo-1.5
    I2V's SigLIP: last hidden state), by the pipelines' own ``encode_image``, 8 devices."""
    config, family, pipe, mesh = _loaded(request.getfixturevalue(fixture), 8,
                                         "--image", IMAGE)
    image = Image.open(IMAGE).convert("RGB")
    cpu = torch.device("cpu")

    def encode():
        with torch.no_grad():
            if fixture == "i2v_checkpoint":
                return {"image_embeds": pipe.encode_image(image, cpu)}
            return {"image_embeds": pipe.encode_image(image=image, batch_size=1, device=cpu,
                                                      dtype=torch.float32)}

    want = encode()
    ours, _ = _on_mesh(pipe, family, config, mesh, encode, ("image_encoder",))
    _assert_close(ours, want, fixture)


def test_plan_counts_the_placed_bytes_and_refuses_what_does_not_fit(ltx2_checkpoint):
    """The fit plan, from the safetensors headers before any load, equals the bytes per
    device the placement holds (Gemma 3 + connectors, 8 devices); a chip too small is
    refused in one line naming the flag; a cpu run plans nothing."""
    config, family, pipe, mesh = _loaded(ltx2_checkpoint, 8, "--frames", "9")
    devices = list(mesh.devices.flat)
    plan = text_device.plan(config, family, devices, None)
    assert set(plan["bytes_per_device"]) == {"text_encoder", "connectors"}
    assert plan["capacity_bytes"] is None  # CPU: nothing to check against
    _, entry = _on_mesh(pipe, family, config, mesh, lambda: family.text.encode_text(
        pipe, config, TEXTS[0]), ("text_encoder", "connectors"))
    for name, placed in entry["modules"].items():
        # The placed module also holds its non-persistent buffers (RoPE tables): not in
        # the files, replicated, a few KiB here.
        assert 0 <= placed["bytes_per_device"] - plan["bytes_per_device"][name] <= 16384, (
            name, placed, plan)
    chip = SimpleNamespace(name="v6e", usable_hbm_bytes=plan["total_bytes_per_device"] - 1)
    with pytest.raises(UsageError) as e:
        text_device.plan(config, family, devices, chip)
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        "--text_encoder_device='mesh': the encoders (text_encoder, connectors) need ")
    assert "per device sharded over 8 devices" in message
    assert message.endswith("use --text_encoder_device cpu or more devices")
    fits = SimpleNamespace(name="v6e", usable_hbm_bytes=plan["total_bytes_per_device"])
    assert text_device.plan(config, family, devices, fits)["total_bytes_per_device"] > 0
    served = text_device.plan(config.replace(serve=object()), family, devices, None)
    assert served["after_encode"] == "resident or parked"
    assert text_device.plan(config.replace(text_encoder_device="cpu"), family, devices,
                            None) is None


def test_too_small_chip_is_one_line_before_anything_loads(tiny_checkpoint, monkeypatch,
                                                         capsys):
    """Through the CLI: the refusal comes from the prologue, before the pipeline loads."""
    from engine.run import chips

    small = SimpleNamespace(name="v6e", usable_hbm_bytes=1000)
    monkeypatch.setattr(chips, "chip_for_device_kind", lambda kind: small)
    loads = []
    monkeypatch.setattr(prologue.Prologue, "load", lambda self, skip=(): loads.append(1))
    code = generate_flax.cli(["--model_id", tiny_checkpoint, *SMALL, "--compilation_cache_dir",
                              "none", "--text_encoder_device", "mesh"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == generate_flax.EXIT_USAGE and not loads
    assert len(err) == 1 and err[0].startswith(
        "generate_flax.py: error: --text_encoder_device='mesh': the encoders (text_encoder) "
        "need "), err


def _frames_cpu_and_mesh(checkpoint, n_devices: int, cache_dir, monkeypatch):
    """(a cpu run's frames and report, a mesh run's), same flags. The default run must never
    build ``MeshEncoders``; the second run loads the first's programs from the executable
    cache (--text_encoder_device changes no program), and the embedding cache is off."""
    extra = ["--compilation_cache_dir", str(cache_dir / "jax"), "--executable_cache_dir",
             str(cache_dir / "exe"), "--embeddings_cache", "none"]
    out = []
    for device in ("cpu", "mesh"):
        config = _config(checkpoint, *extra, "--text_encoder_device", device)
        with monkeypatch.context() as m:
            if device == "cpu":
                def refuse(*args, **kwargs):
                    raise AssertionError("a default run moved an encoder to the mesh")

                m.setattr(text_device, "MeshEncoders", refuse)
            frames, report = generate(config, FAMILIES[config.model.family],
                                      jax.devices()[:n_devices])
        out.append((np.asarray(frames), report))
    return out


def _check_frames(runs) -> None:
    (cpu, cpu_report), (mesh, mesh_report) = runs
    assert cpu_report["text_encoders"] == {"device": "cpu"}
    entry = mesh_report["text_encoders"]
    # CFG on: the prompt and the negative, one program for both.
    assert entry["device"] == "mesh" and entry["modules"]["text_encoder"]["calls"] == 2
    assert entry["modules"]["text_encoder"]["programs"] == 1
    assert mesh_report["timings"]["text_encode_s"] > 0
    assert mesh_report["executable_cache"]["programs_compiled"] == 0, json.dumps(
        mesh_report["executable_cache"])
    assert cpu.shape == mesh.shape == (5, 32, 32, 3)
    diff = float(np.abs(cpu - mesh).max())
    assert diff <= FRAMES_ATOL, diff


def test_mesh_run_frames_equal_a_cpu_runs(tiny_checkpoint, tmp_path, monkeypatch):
    """Wan, one device: the frames of a --text_encoder_device mesh run equal a cpu run's
    (measured 3.0e-7), and the cpu run never moved an encoder."""
    _check_frames(_frames_cpu_and_mesh(tiny_checkpoint, 1, tmp_path, monkeypatch))


@pytest.mark.slow
def test_sharded_mesh_run_frames_equal_a_cpu_runs(tiny_checkpoint, tmp_path, monkeypatch):
    """As above on 8 CPU devices: UMT5's weights sharded 8 ways (measured 3.0e-7)."""
    runs = _frames_cpu_and_mesh(tiny_checkpoint, 8, tmp_path, monkeypatch)
    stats = runs[1][1]["text_encoders"]["modules"]["text_encoder"]
    assert stats["bytes_per_device"] < stats["bytes"]
    _check_frames(runs)


def test_served_encoders_park_in_host_memory_and_come_back(tiny_checkpoint, monkeypatch):
    """The server's path (``resume`` / ``rest``), UMT5 sharded over 8 devices: with HBM short
    (a capacity the live bytes exceed) the encoders go to pinned host memory after the
    encode, holding no HBM, and the next encode brings them back and gives the first's
    embeddings bit for bit on the same program; with room they stay on the devices."""
    config, family, pipe, mesh = _loaded(tiny_checkpoint, 8, "--serve")
    want = family.text.encode_text(pipe, config, TEXTS[0])
    report: dict = {}
    encoders = text_device.resume(None, pipe, family, config, mesh, report)
    first = family.text.encode_text(pipe, config, TEXTS[0])
    _assert_close(first, want, "served")
    monkeypatch.setattr(text_device, "device_capacity", lambda mesh: 1)  # HBM short
    text_device.rest(encoders)
    _, params, buffers = encoders.placed["text_encoder"]
    arrays = [*params.values(), *buffers.values()]
    assert encoders.parked and report["text_encoders"]["after_encode"] == "parked"
    assert all(a.sharding.memory_kind == "pinned_host" for a in arrays)
    assert placement.per_device_bytes(arrays) == {}  # no HBM held
    assert text_device.resume(encoders, pipe, family, config, mesh, report) is encoders
    assert not encoders.parked
    assert all(a.sharding.memory_kind != "pinned_host" for a in [*params.values(),
                                                                   *buffers.values()])
    again = family.text.encode_text(pipe, config, TEXTS[0])
    assert all(torch.equal(again[k], v) for k, v in first.items())
    monkeypatch.setattr(text_device, "device_capacity", lambda mesh: None)  # room (CPU)
    text_device.rest(encoders)
    stats = report["text_encoders"]["modules"]["text_encoder"]
    assert report["text_encoders"]["after_encode"] == "resident" and not encoders.parked
    assert stats["programs"] == 1 and stats["calls"] == 2, stats
    encoders.release()


@pytest.mark.slow
def test_served_job_with_mesh_encoders_equals_a_cpu_servers(tiny_checkpoint, tmp_path,
                                                            monkeypatch):
    """Two servers (engine.serve.model.build), one job each: encoders on the mesh, parked
    in host memory between encodes (HBM made short), against encoders on the CPU; the job's
    frames agree within FRAMES_ATOL and the mesh server's encoders ran on one program per
    module (the build's encode, the job's, and the job after the step's kernel was
    installed)."""
    from engine.serve import model as served_model
    from engine.serve.requests import VideoJob

    job = VideoJob(prompt=TEXTS[1], negative_prompt="blurry", width=32, height=32,
                   num_frames=5, seconds="0.3", num_inference_steps=2, guidance_scale=5.0,
                   guidance_scale_2=None, seed=3, fps=16, model="tiny-wan")
    frames = {}
    for device in ("cpu", "mesh"):
        config = _config(tiny_checkpoint, "--serve", "--embeddings_cache", "none",
                         "--output_dir", str(tmp_path), "--text_encoder_device", device)
        with monkeypatch.context() as m:
            m.setattr(text_device, "device_capacity", lambda mesh: 1)
            warm = served_model.build(config, FAMILIES[config.model.family],
                                      jax.devices()[:8])
            frames[device], *_ = warm.run(device, job, None, lambda i, n: None)
        if device == "mesh":
            entry = warm.encoders_report["text_encoders"]
            assert entry["after_encode"] == "parked" and warm.mesh_encoders.parked
            assert entry["modules"]["text_encoder"]["programs"] == 1, entry
        else:
            assert warm.mesh_encoders is None
    diff = float(np.abs(np.asarray(frames["cpu"]) - np.asarray(frames["mesh"])).max())
    assert diff <= FRAMES_ATOL, diff
    assert np.asarray(frames["cpu"]).std() > 0.01
