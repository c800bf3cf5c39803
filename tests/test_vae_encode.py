"""The chunked, width-sharded Wan VAE encode (engine/vae_encode.py) against diffusers'
``AutoencoderKLWan.encode(x).latent_dist.mode()``, on 1 and 8 devices."""

import jax
import numpy as np
import pytest
import torch

from engine import vae_encode
from engine.sharding import place_module


@pytest.fixture
def vae():
    """A small random Wan 2.1-style VAE; a fresh one per test, since placing its weights
    frees the module's own tensors."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


@pytest.mark.parametrize("n_devices", [1, 8])
def test_chunked_encode_equals_diffusers(vae, n_devices):
    """9 frames (frame 0 and two 4-frame chunks) at 64 x 128: width 128 splits over 8."""
    x = torch.rand(1, 3, 9, 64, 128, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        want = vae.encode(x).latent_dist.mode().numpy()
    encode = vae_encode.DeviceEncode(vae, jax.devices()[:n_devices])
    got = encode(x).latent_dist.mode().numpy()
    assert got.shape == want.shape == (1, 16, 3, 8, 16)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.abs(want).max() > 0.05  # a real encode, not zeros
    assert len(encode.encoder.programs) == 3  # first frame, first chunk, later chunks


def test_encode_shards_the_width_on_every_device(vae):
    """On 8 devices the input chunks, the carried caches and the output are width-sharded:
    each device holds 1/8 of the width of each, nothing whole."""
    devices = jax.devices()[:8]
    mesh = vae_encode.mesh_for(devices)
    placed = place_module(vae, mesh, include=vae_encode.is_encode_weight, desc="VAE encoder")
    encoder = vae_encode.ChunkedEncoder(placed, mesh, vae)
    x = jax.device_put(np.zeros((1, 3, 5, 32, 128), np.float32),
                       encoder.spatial((1, 3, 5, 32, 128)))
    out = encoder(x)
    assert out.shape == (1, 16, 2, 4, 16)
    for shard in out.addressable_shards:
        assert shard.data.shape == (1, 16, 2, 4, 2)
    _, cache = encoder._program(*next(iter(k[:2] for k in encoder.programs)),
                                encoder._chunk(x, 0, 1), [])
    for c in cache:  # each cache entry's width is split 8 ways on every device
        assert c.sharding.shard_shape(c.shape)[-1] * 8 == c.shape[-1]
