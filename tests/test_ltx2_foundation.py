"""LTX-2 foundation (issue 56): the tiny checkpoint (tools/make_tiny_ltx2_checkpoint.py) is a
complete ``LTX2Pipeline`` checkpoint, the pipeline's transformer passes per step are as
docs/models.md ("LTX-2: what diffusers runs per step") says, and diffusers' LTX-2 transformer
runs under torchax (jit, float32) equal to its eager forward on the inputs the pipeline gives it.

Two things make the torchax forward exact (``torchax_forward``; a family can reuse both):

- the ``addcmul_`` write-back (``engine.run.lowering.INPLACE_ON_VIEWS``, installed by
  ``lowering.install``): torchax 0.0.13 decomposes ``addcmul_`` with its view arguments
  materialised, so the in-place update of a slice is lost. diffusers' split RoPE
  (``apply_split_rotary_emb``, transformer_ltx2.py:46-84) updates two slices of ``out`` with
  ``addcmul_``; without the fix the rotated halves keep only ``x * cos`` (the test below shows
  an error > 0.01). The fix registers ``addcmul_`` as torchax registers ``add_``: the functional
  op plus a write-back through the view (``torchax.ops.op_base.InplaceOp``).
- float64 RoPE frequencies: the RoPE builds ``theta ** linspace`` in float64
  (``rope_double_precision``, transformer_ltx2.py:1029) before casting to float32; JAX without
  x64 computes it in float32, which moved the outputs by up to 4e-5 here. The jitted forward is
  traced under ``jax.enable_x64(True)`` so the tables match torch's.

Our weights are random; the checkpoint is tiny (2 blocks, 64 x 64 pixels, 9 frames).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline, LTX2VideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx2 import apply_split_rotary_emb
from PIL import Image
from torchax import interop

from custom_splash_attention import install_sdpa_override
from engine.run import lowering

REAL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                    "Lightricks", "LTX-2")
PROMPT = "A cat walks on the grass"
# 64 x 64 pixels, 9 frames: a 2 x 2 x 2 latent grid (32x spatial, 8x temporal compression).
CALL = dict(prompt=PROMPT, negative_prompt="blurry", height=64, width=64, num_frames=9,
            frame_rate=24.0)
VIDEO_TOKENS = 2 * 2 * 2
# round(9 / 24 s x 16000 Hz / 160 hop / 4) = round(9.375) latent audio frames
# (pipeline_ltx2.py:1306-1310).
AUDIO_TOKENS = 9
# STG on the last block of the 2-block tiny transformer (the pipeline's default is [28] of 48).
STG_BLOCKS = [1]


def _record(pipe, **call):
    """Run the pipeline; returns (its output, the keyword arguments of every transformer call)."""
    calls = []
    forward = pipe.transformer.forward

    def spy(**kwargs):
        calls.append(kwargs)
        return forward(**kwargs)

    pipe.transformer.forward = spy
    try:
        out = pipe(**CALL, **call, generator=torch.Generator().manual_seed(0), return_dict=False)
    finally:
        del pipe.transformer.forward
    return out, calls


@pytest.fixture(scope="module")
def pipe(ltx2_checkpoint):
    return LTX2Pipeline.from_pretrained(ltx2_checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def default_run(pipe):
    """Two steps at the pipeline's default guidance, decoded: (video, audio), calls."""
    return _record(pipe, num_inference_steps=2, output_type="np")


def _json(*parts):
    with open(os.path.join(*parts)) as f:
        return json.load(f)


@pytest.mark.parametrize("component", ["transformer", "connectors", "vae", "audio_vae", "vocoder",
                                       "scheduler", "."])
def test_tiny_configs_change_only_sizes_of_the_real_ones(ltx2_checkpoint, component):
    """Same keys and components as configs/Lightricks/LTX-2; only integer sizes differ."""
    name = {"scheduler": "scheduler_config.json", ".": "model_index.json"}.get(component,
                                                                               "config.json")
    real, tiny = _json(REAL, component, name), _json(ltx2_checkpoint, component, name)
    assert real.keys() == tiny.keys()
    changed = {k for k in real if real[k] != tiny[k] and k != "_diffusers_version"}
    sizes = {k for k in changed if not isinstance(real[k], (bool, str, float))
             and all(isinstance(v, int) for v in np.ravel(real[k]).tolist())}
    assert changed == sizes
    if component == "transformer":
        assert changed >= {"num_layers", "attention_head_dim", "in_channels"}


def test_pipeline_runs_the_tiny_checkpoint_end_to_end(pipe, default_run):
    (video, audio), _ = default_run
    assert video.shape == (1, 9, 64, 64, 3) and video.dtype == np.float32
    assert np.isfinite(video).all() and 0.0 <= video.min() and video.max() <= 1.0
    # Audio VAE: 4 x 9 - 3 = 33 causal mel frames (autoencoder_kl_ltx2_audio.py:612-615);
    # vocoder: 6 x 5 x 2 x 2 x 2 = 240 samples per frame, stereo, 24 kHz.
    assert pipe.vocoder.config.output_sampling_rate == 24000
    assert tuple(audio.shape) == (1, 2, (4 * AUDIO_TOKENS - 3) * 240)
    assert torch.isfinite(audio).all() and audio.abs().max() <= 1.0  # tanh output
    assert audio.std() > 0 and video.std() > 0


def _passes(calls):
    """(batch, isolate_modalities, STG blocks) of each transformer call."""
    return [(c["hidden_states"].shape[0], c["isolate_modalities"],
             c["spatio_temporal_guidance_blocks"]) for c in calls]


def test_default_step_is_three_passes(default_run):
    """CFG (negative and positive in one batch of 2), STG (positive, blocks [28]), modality
    isolation (positive, a2v/v2a cross-attention off); per step."""
    _, calls = default_run
    step = [(2, False, None), (1, False, [28]), (1, True, None)]
    assert _passes(calls) == step * 2
    for c in calls:
        assert c["hidden_states"].shape[1:] == (VIDEO_TOKENS, 8)
        assert c["audio_hidden_states"].shape[1:] == (AUDIO_TOKENS, 32)
        assert c["encoder_hidden_states"].shape[1] == 1024  # max_sequence_length
        assert c["use_cross_timestep"] is True and c["perturbation_mask"] is None


@pytest.mark.parametrize("scales, step", [
    (dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
          modality_scale=1.0, audio_modality_scale=1.0), [(1, False, None)]),
    (dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0),
     [(2, False, None)]),
    # guidance_scale=1.0 alone (the distilled example in diffusers' docs) keeps CFG: the audio
    # scale defaults to 7.0 and either scale > 1 turns it on (pipeline_ltx2.py:902-903).
    (dict(guidance_scale=1.0), [(2, False, None), (1, False, [28]), (1, True, None)]),
], ids=["guidance_off", "cfg_only", "guidance_scale_1_only"])
def test_passes_per_step(pipe, scales, step):
    _, calls = _record(pipe, num_inference_steps=2, output_type="latent", **scales)
    assert _passes(calls) == step * 2


def test_image_to_video_runs_on_the_same_checkpoint(pipe):
    """``LTX2ImageToVideoPipeline`` takes the same components. Its video timestep is per token,
    0 on the image's latent frame (pipeline_ltx2_image2video.py:1487); audio keeps t. The
    default CRF 33 re-compression of the image needs PyAV, which is not installed:
    ``image_crf=0`` skips it."""
    i2v = LTX2ImageToVideoPipeline(**pipe.components)
    image = Image.fromarray(np.random.RandomState(0).randint(0, 256, (64, 64, 3), np.uint8))
    _, calls = _record(i2v, image=image, image_crf=0, num_inference_steps=2,
                       output_type="latent")
    assert _passes(calls) == [(2, False, None), (1, False, [28]), (1, True, None)] * 2
    first_frame = VIDEO_TOKENS // 2  # 2 x 2 tokens of the 2 latent frames
    for c in calls:
        t = c["timestep"]
        assert t.shape == c["hidden_states"].shape[:2] and c["audio_timestep"].ndim == 1
        assert (t[:, :first_frame] == 0).all() and (t[:, first_frame:] > 0).all()


def test_stg_changes_nothing_in_ltx2_0_blocks(pipe, default_run):
    """LTX-2.0's config has ``perturbed_attn`` false: its blocks never pass the perturbation
    to attention (transformer_ltx2.py:644-646), so the STG pass equals the plain pass. (The
    pipeline's block 28 does not exist in the 2-block tiny model: block 1 here.)"""
    _, calls = default_run
    stg = {**calls[1], "spatio_temporal_guidance_blocks": STG_BLOCKS}
    with torch.no_grad():
        got = pipe.transformer(**stg)
        want = pipe.transformer(**{**stg, "spatio_temporal_guidance_blocks": None})
    assert not pipe.transformer.config.perturbed_attn
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.fixture
def env(torchax_env):
    """torchax's env with XLA attention and the engine's lowerings (which include the
    ``addcmul_`` write-back through views, ``engine.run.lowering.INPLACE_ON_VIEWS``)."""
    install_sdpa_override(torchax_env, attention="xla")
    lowering.install(torchax_env)
    yield torchax_env
    lowering.install(torchax_env)  # a test may have removed the write-back


def test_split_rope_needs_the_inplace_fix_under_torchax(env):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 32)  # (batch, tokens, heads x head_dim), 2 heads
    cos, sin = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    want = apply_split_rotary_emb(x, (cos, sin)).numpy()
    args = [jnp.asarray(t.numpy()) for t in (x, cos, sin)]

    def jitted():
        return np.asarray(jax.jit(interop.jax_view(
            lambda x, c, s: apply_split_rotary_emb(x, (c, s))))(*args))

    np.testing.assert_allclose(jitted(), want, rtol=1e-6, atol=1e-6)
    env._ops.pop(torch.ops.aten.addcmul_.default)  # torchax's own decomposition
    assert np.abs(jitted() - want).max() > 1e-2


def torchax_forward(transformer, env, **static):
    """``transformer``'s forward jitted through torchax: a function of the tensor keyword
    arguments (traced); ``static`` holds the rest (ints, flags, the STG block list), fixed at
    trace time. Traced under x64 so the RoPE's float64 frequencies stay float64."""
    jm = interop.JittableModule(transformer)
    params, buffers = env.t2j_copy(jm.params), env.t2j_copy(jm.buffers)

    def run(params, buffers, tensors):
        return jm.functional_call("forward", params, buffers, **tensors, **static)

    jitted = jax.jit(interop.jax_view(run))

    def call(tensors):
        with jax.enable_x64(True):
            arrays = {k: jnp.asarray(v.numpy()) for k, v in tensors.items()}
            return [np.asarray(o) for o in jitted(params, buffers, arrays)]
    return call


def _split(kwargs):
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in kwargs.items() if k not in tensors}


def _perturbed(transformer):
    """The same weights with ``perturbed_attn`` on (as LTX-2.3), so STG skips attention."""
    model = LTX2VideoTransformer3DModel.from_config(
        {**transformer.config, "perturbed_attn": True}).eval()
    model.load_state_dict(transformer.state_dict(), strict=True)
    return model


@pytest.mark.parametrize("which", ["cfg_batch", "stg_perturbed", "isolated"])
def test_transformer_under_torchax_equals_eager(pipe, default_run, env, which):
    """Each pass of the first default step: torchax (jit, XLA attention) vs eager, float32.
    Measured max |diff| (this 2-core CPU host): 1.2e-6 video, 2.2e-6 audio, on outputs of
    magnitude up to 2.4."""
    _, calls = default_run
    kwargs = calls[{"cfg_batch": 0, "stg_perturbed": 1, "isolated": 2}[which]]
    transformer = pipe.transformer
    if which == "stg_perturbed":
        transformer = _perturbed(transformer)
        kwargs = {**kwargs, "spatio_temporal_guidance_blocks": STG_BLOCKS}
    tensors, static = _split(kwargs)
    with torch.no_grad():
        want = [o.numpy() for o in transformer(**kwargs)]
        if which == "stg_perturbed":  # the skip is live: STG moves the output
            plain = transformer(**{**kwargs, "spatio_temporal_guidance_blocks": None})
            assert np.abs(plain[0].numpy() - want[0]).max() > 1e-2
    got = torchax_forward(transformer, env, **static)(tensors)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
