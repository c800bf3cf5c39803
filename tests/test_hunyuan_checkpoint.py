"""The tiny HunyuanVideo-1.5 T2V checkpoint: built offline, loaded from safetensors, runs eagerly.

Pure torch (diffusers' own pipeline on CPU): this pins down the reference the JAX port is
compared against, so a broken builder shows up here rather than as a parity failure.
"""

import os

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QUOTED = 'A sign that says "hello"'
PLAIN = "A cat walks on the grass, realistic style"
HEIGHT, WIDTH, FRAMES = 32, 48, 5  # latents (32, 2, 2, 3): non-square catches h/w swaps
WEIGHTED = ("transformer", "vae", "text_encoder", "text_encoder_2")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


@pytest.fixture(scope="session")
def hunyuan_pipe(hunyuan_checkpoint):
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(hunyuan_checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, prompt, seed=0):
    return pipe(
        prompt=prompt,
        num_frames=FRAMES,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=2,
        generator=torch.Generator("cpu").manual_seed(seed),
        output_type="np",
    ).frames


@pytest.fixture(scope="session")
def hunyuan_frames(hunyuan_pipe):
    """Frames for the quoted (ByT5) and the plain prompt, generated once."""
    return {prompt: _generate(hunyuan_pipe, prompt) for prompt in (QUOTED, PLAIN)}


def test_checkpoint_is_safetensors_only(hunyuan_checkpoint):
    files = [
        os.path.relpath(os.path.join(d, f), hunyuan_checkpoint)
        for d, _, names in os.walk(hunyuan_checkpoint)
        for f in names
    ]
    assert not [f for f in files if f.endswith(PICKLE_SUFFIXES)], files
    for name in WEIGHTED:
        assert any(f.startswith(name + os.sep) and f.endswith(".safetensors") for f in files), name


def test_from_pretrained_loads_every_component(hunyuan_checkpoint, hunyuan_pipe):
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from safetensors.torch import load_file
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextModel,
        Qwen2Tokenizer,
        T5EncoderModel,
    )

    pipe = hunyuan_pipe
    expected = {
        "transformer": HunyuanVideo15Transformer3DModel,
        "vae": AutoencoderKLHunyuanVideo15,
        "scheduler": FlowMatchEulerDiscreteScheduler,
        "text_encoder": Qwen2_5_VLTextModel,
        "tokenizer": Qwen2Tokenizer,
        "text_encoder_2": T5EncoderModel,
        "tokenizer_2": ByT5Tokenizer,
        "guider": ClassifierFreeGuidance,
    }
    assert set(pipe.components) == set(expected)
    for name, cls in expected.items():
        assert isinstance(pipe.components[name], cls), name

    cfg = pipe.transformer.config
    assert (cfg.num_layers, cfg.num_refiner_layers) == (2, 2)
    assert (cfg.num_attention_heads, cfg.attention_head_dim) == (2, 16)
    assert (cfg.in_channels, cfg.out_channels) == (65, 32)
    assert sum(cfg.rope_axes_dim) == cfg.attention_head_dim
    assert (pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal) == (16, 4)
    assert pipe.vae.config.latent_channels == cfg.out_channels
    assert pipe.scheduler.config.shift == 9.0
    assert pipe.guider.guidance_scale == 6.0
    assert pipe.tokenizer.chat_template and pipe.tokenizer.padding_side == "right"

    # The weights in memory are the ones on disk, not a fresh random init.
    for name in WEIGHTED:
        folder = os.path.join(hunyuan_checkpoint, name)
        (fname,) = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
        on_disk = load_file(os.path.join(folder, fname))
        state = pipe.components[name].state_dict()
        assert on_disk and set(on_disk) <= set(state), name
        for key, tensor in on_disk.items():
            assert state[key].dtype == torch.float32, (name, key)
            torch.testing.assert_close(state[key], tensor, rtol=0, atol=0, msg=key)


def test_chat_prefix_is_the_cropped_108_tokens(hunyuan_pipe):
    """The tiny Qwen tokenizer splits the template prefix like the real one: the crop keeps
    exactly the prompt."""
    pipe = hunyuan_pipe
    conv = [{"role": "system", "content": pipe.system_message}, {"role": "user", "content": "x"}]
    prefix = pipe.tokenizer.apply_chat_template([conv], tokenize=False)[0].split("x<|im_end|>")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 108

    embeds, mask, _, _ = pipe.encode_prompt(prompt=PLAIN, device="cpu")
    assert embeds.shape == (1, pipe.tokenizer_max_length, pipe.text_encoder.config.hidden_size)
    # Valid tokens after the crop: the prompt, then <|im_end|> \n <|im_start|> assistant \n.
    n_prompt = len(pipe.tokenizer(PLAIN).input_ids)
    assert int(mask.sum()) == n_prompt + 5
    assert mask[0, : n_prompt + 5].all() and not mask[0, n_prompt + 5 :].any()


def test_byt5_encodes_only_quoted_text(hunyuan_pipe):
    pipe = hunyuan_pipe
    _, _, embeds_q, mask_q = pipe.encode_prompt(prompt=QUOTED, device="cpu")
    _, _, embeds_p, mask_p = pipe.encode_prompt(prompt=PLAIN, device="cpu")
    assert embeds_q.shape == embeds_p.shape == (1, 256, pipe.text_encoder_2.config.d_model)
    # The pipeline encodes 'Text "hello". ' as bytes, plus </s>.
    assert int(mask_q.sum()) == len(b'Text "hello". ') + 1
    assert embeds_q[0, : int(mask_q.sum())].abs().sum() > 0
    assert int(mask_p.sum()) == 0 and not embeds_p.any()


@pytest.mark.parametrize("prompt", [QUOTED, PLAIN])
def test_eager_pipeline_frames(hunyuan_frames, prompt):
    frames = hunyuan_frames[prompt]
    assert frames.shape == (1, FRAMES, HEIGHT, WIDTH, 3)
    assert np.isfinite(frames).all()
    assert frames.min() >= 0.0 and frames.max() <= 1.0
    assert frames.std() > 0.01
    # Not one image repeated: the causal VAE decodes distinct frames.
    assert np.abs(np.diff(frames, axis=1)).max() > 1e-2


def test_prompts_give_different_frames(hunyuan_frames):
    diff = np.abs(hunyuan_frames[QUOTED] - hunyuan_frames[PLAIN])
    assert diff.max() > 1e-2, diff.max()


def test_generation_is_seeded(hunyuan_pipe, hunyuan_frames):
    again = _generate(hunyuan_pipe, QUOTED)
    np.testing.assert_array_equal(again, hunyuan_frames[QUOTED])
    other_seed = _generate(hunyuan_pipe, QUOTED, seed=1)
    assert np.abs(other_seed - hunyuan_frames[QUOTED]).max() > 1e-2
