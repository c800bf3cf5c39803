"""The chunked, width-sharded Wan VAE encode (families/wan_vae.py) against diffusers'
``AutoencoderKLWan.encode(x).latent_dist.mode()``, on 1 and 8 devices: Wan 2.1's VAE and
Wan 2.2's (patchify, residual down blocks; TI2V-5B's one-frame image encode)."""

import jax
import numpy as np
import pytest
import torch

from engine.run.mesh import spatial_mesh
from engine.weights.sharding import place_module
from families import wan_vae


def wan21_vae():
    """A small random Wan 2.1-style VAE; a fresh one per test, since placing its weights
    frees the module's own tensors."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def wan22_vae():
    """A small random Wan 2.2-style VAE: z_dim 48, 2x2 patchify, residual blocks, 16x."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=8, decoder_base_dim=12, z_dim=48, dim_mult=[1, 1, 1, 1],
                            num_res_blocks=1, temperal_downsample=[False, True, True],
                            is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                            scale_factor_spatial=16).eval()


@pytest.fixture
def vae():
    return wan21_vae()


# (VAE, input (1, 3, F, H, W), expected mode shape, programs). Wan 2.1: 9 frames = frame 0
# and two 4-frame chunks at 64 x 128 (width 128 splits over 8). Wan 2.2: TI2V-5B's image
# encode, one 64 x 256 frame patchified inside its one program (latent width 16 over 8).
CASES = {"wan21": (wan21_vae, (1, 3, 9, 64, 128), (1, 16, 3, 8, 16), 3),
         "wan22_one_frame": (wan22_vae, (1, 3, 1, 64, 256), (1, 48, 1, 4, 16), 1)}


@pytest.mark.parametrize("n_devices", [1, 8])
@pytest.mark.parametrize("case", CASES)
def test_chunked_encode_equals_diffusers(case, n_devices):
    make, shape, expected, programs = CASES[case]
    vae = make()
    x = torch.rand(*shape, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.no_grad():
        want = vae.encode(x).latent_dist.mode().numpy()
    encode = wan_vae.DeviceEncode(vae, jax.devices()[:n_devices])
    got = encode(x).latent_dist.mode().numpy()
    assert got.shape == want.shape == expected
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert np.abs(want).max() > 0.05  # a real encode, not zeros
    # Wan 2.1: first frame, first chunk, later chunks
    assert len(encode.encoders[shape].programs) == programs


def test_one_device_encode_serves_many_calls_and_shapes():
    """The server's case: one ``DeviceEncode`` kept across jobs places the weights once
    (placing frees the module's host copies) and encodes a second video of the same shape
    and a third of another shape on them, each equal to diffusers' encode of a fresh VAE
    with the same weights."""
    vae, reference = wan21_vae(), wan21_vae()
    encode = wan_vae.DeviceEncode(vae, jax.devices()[:1])
    g = torch.Generator().manual_seed(2)
    for shape in ((1, 3, 1, 16, 32), (1, 3, 1, 16, 32), (1, 3, 1, 32, 16)):
        x = torch.rand(*shape, generator=g) * 2 - 1
        with torch.no_grad():
            want = reference.encode(x).latent_dist.mode().numpy()
        np.testing.assert_allclose(encode(x).latent_dist.mode().numpy(), want, atol=1e-5,
                                   rtol=0)
    assert sorted(encode.encoders) == [(1, 3, 1, 16, 32), (1, 3, 1, 32, 16)]
    assert encode.seconds["compile_s"] > 0  # the new shape compiled; the repeat did not
    # The host copies are gone (placing freed them): only the placed weights can serve.
    assert all(p.numel() == 0 for n, p in vae.named_parameters()
               if wan_vae.is_encode_weight(n))


def test_encode_shards_the_width_on_every_device(vae):
    """On 8 devices the input chunks, the carried caches and the output are width-sharded:
    each device holds 1/8 of the width of each, nothing whole."""
    devices = jax.devices()[:8]
    mesh = spatial_mesh(devices)
    placed = place_module(vae, mesh, include=wan_vae.is_encode_weight, desc="VAE encoder")
    encoder = wan_vae.ChunkedEncoder(placed, mesh, vae)
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
