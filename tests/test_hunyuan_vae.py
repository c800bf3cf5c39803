"""The HunyuanVideo-1.5 decode program (families/hunyuan_vae.py) against diffusers' own
``AutoencoderKLHunyuanVideo15.decode``, eager PyTorch on CPU, on the tiny checkpoint."""

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from engine.run.mesh import MeshShape, make_mesh
from engine.weights.sharding import place_module
from families import hunyuan_vae

# 4 latent frames: the first-frame program once and the later-frame program three times.
# Latent width 8 divides over 8 devices, so the frames are width-sharded there.
LATENTS = (1, 32, 4, 3, 8)


def _load(checkpoint):
    from diffusers import AutoencoderKLHunyuanVideo15

    return AutoencoderKLHunyuanVideo15.from_pretrained(checkpoint, subfolder="vae",
                                                       use_safetensors=True).eval()


@pytest.fixture
def vae(hunyuan_checkpoint):
    """A fresh VAE per test: placement frees each torch weight once it is on the devices."""
    return _load(hunyuan_checkpoint)


@pytest.fixture(scope="module")
def latents():
    return torch.randn(LATENTS, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def reference(hunyuan_checkpoint, latents):
    """diffusers' decode as ``HunyuanVideo15Pipeline`` calls it (latents / scaling_factor),
    clamped to [-1, 1] as the video processor does before mapping to [0, 1]."""
    vae = _load(hunyuan_checkpoint)
    with torch.no_grad():
        video = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
    return video.clamp(-1, 1).numpy()


def _decode(vae, latents, n_devices):
    mesh = make_mesh(MeshShape(1, 1, n_devices), jax.devices()[:n_devices])
    placed = place_module(vae, mesh, include=hunyuan_vae.is_vae_decode_weight, desc="vae")
    decoder = hunyuan_vae.vae_decoder(placed, vae, mesh)
    z = jax.device_put(latents.numpy(), NamedSharding(mesh, P()))
    decoder.compile(z)
    return decoder, placed, decoder(z)


@pytest.mark.parametrize("n_devices", [1, 8])
def test_decode_equals_diffusers(vae, latents, reference, n_devices):
    decoder, placed, video = _decode(vae, latents, n_devices)
    assert video.shape == reference.shape == (1, 3, 13, 48, 128)
    # float32 both sides; only the summation order differs (measured ~1.5e-6).
    np.testing.assert_allclose(np.asarray(video), reference, atol=1e-5)
    # The mid program plus two frame programs (first frame, every later frame).
    assert decoder.memory()["programs"] == 3
    # Calls per decode (the dry run's decode estimate): mid once, first frame, 3 later frames.
    assert [n for _, n in decoder.program_calls()] == [1, 1, 3]
    if n_devices == 8:
        # Per-device accounting: the frames come back split over the width, 1/8 per device;
        # the decode weights are the decoder's only (the encoder stays on the host), whole
        # on every device (a conv net's weights are small; its activations are what shards).
        assert {s.data.shape[-1] for s in video.addressable_shards} == {128 // 8}
        assert len(video.addressable_shards) == 8
        assert placed["params"] and all(n.startswith("decoder.") for n in placed["params"])
        for array in placed["params"].values():
            assert {tuple(s.data.shape) for s in array.addressable_shards} == {array.shape}


def test_a_width_the_devices_do_not_divide_is_split_inside(hunyuan_checkpoint):
    """Latent width 5 over 8 devices (as 1080p's 119): the frame programs split their
    activations unevenly instead of decoding whole frames on every device (their convs then
    trade halos: collective-permutes, none before). Same frames as diffusers. (CPU's memory
    analysis at this size is all padding and halos; the saving shows at 1080p on v6e:
    benchmarks/dry_run_results.md.)"""
    latents = torch.randn((1, 32, 2, 3, 5), generator=torch.Generator().manual_seed(1))
    vae = _load(hunyuan_checkpoint)
    with torch.no_grad():
        want = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
    decoder, _, video = _decode(_load(hunyuan_checkpoint), latents, 8)
    np.testing.assert_allclose(np.asarray(video), want.clamp(-1, 1).numpy(), atol=1e-5)
    for compiled, _ in decoder.frames.programs.values():
        assert "collective-permute" in compiled.as_text()


def test_block_causal_attention_equals_the_dense_mask():
    """Against diffusers' own mask (its Python loop) through torch SDPA."""
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import (
        HunyuanVideo15AttnBlock,
    )

    frames, hw, c = 3, 5, 16
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, frames * hw, c, generator=g) for _ in range(3))
    mask = HunyuanVideo15AttnBlock.prepare_causal_attention_mask(frames, hw, torch.float32,
                                                                 "cpu", batch_size=2)
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, None], k[:, None], v[:, None], attn_mask=mask[:, None])[:, 0].numpy()
    got = hunyuan_vae.block_causal_attention(q.numpy(), k.numpy(), v.numpy(), frames)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    # Row chunks under a score budget: 1, 2 (a padded last chunk) and 5 rows per chunk.
    for rows in (1, 2, 5):
        budget = 4 * 2 * frames * hw * rows
        chunked = hunyuan_vae.block_causal_attention(q.numpy(), k.numpy(), v.numpy(), frames,
                                                     score_bytes=budget)
        np.testing.assert_allclose(np.asarray(chunked), want, atol=1e-5)
    # The mask matters: the first frame's rows differ from full attention.
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v).numpy()
    assert np.abs(full[:, :hw] - want[:, :hw]).max() > 1e-2


def test_vae_tiling_is_refused(vae):
    from engine.run.errors import GenerationError

    with pytest.raises(GenerationError, match="--vae_tiling"):
        hunyuan_vae.vae_decoder({}, vae, None, tiling=True)
