"""Streamed, sharded placement: host torch tensors straight into their device shards.

Why this exists: torchax's ``env.t2j_copy`` turns a torch tensor into ``jnp.asarray(...)``,
which puts the **whole** tensor on JAX's default device (TPU chip 0), through a float32 copy
for bf16. Placing 14B weights that way needs ~29 GB of bf16 weights plus an 11 GB float32
temporary on chip 0 before anything is sharded: more than a v6e chip's 31.25 GiB. Here each
weight goes host -> shards with ``jax.make_array_from_callback``: every device receives
only the slice its ``NamedSharding`` gives it (a whole copy only where the spec replicates),
bf16 reaches NumPy as a zero-copy ``ml_dtypes.bfloat16`` view, and each torch tensor's
storage is released once its array is on the devices, so host memory peaks near one copy of
the weights.

``make_array_from_callback`` asks only for the shards of this process's devices, so the
same code places a multi-host mesh with each host touching its own slices.
"""

from __future__ import annotations

import math

import numpy as np


def host_array(tensor) -> np.ndarray:
    """A CPU torch tensor as a NumPy array without a copy where possible.

    bf16 has no NumPy dtype of its own: its bits are viewed as int16 and reinterpreted as
    ``ml_dtypes.bfloat16`` (JAX's own bf16 type), so no float32 round trip happens.

    Args:
        tensor: a CPU ``torch.Tensor`` (a ``Parameter`` is fine) of any shape.

    Returns:
        ``np.ndarray`` of the same shape and dtype sharing the tensor's memory (a contiguous
        copy only when the tensor is not contiguous).
    """
    import ml_dtypes
    import torch

    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def release(tensor) -> None:
    """Drop a torch tensor's storage in place (its ``Parameter`` object stays, now empty).

    Called once the tensor's device copy exists, so host RAM is freed weight by weight.
    """
    import torch

    tensor.data = torch.empty(0, dtype=tensor.dtype)


def place_array(host: np.ndarray, sharding):
    """``host`` on the devices of ``sharding``, each device receiving only its own slice.

    Args:
        host: NumPy array (any dtype JAX supports, ``ml_dtypes.bfloat16`` included).
        sharding: a ``jax.sharding.Sharding`` (usually ``NamedSharding``).

    Returns:
        ``jax.Array`` of ``host.shape`` laid out as ``sharding``, ready (transfers done).
    """
    import jax

    arr = jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return arr.block_until_ready()


def place_tensors(tensors: dict, shardings: dict, *, desc: str, release_host: bool = True,
                  on_placed=None) -> dict:
    """Stream torch tensors into their shardings, one at a time, with a progress bar.

    Args:
        tensors: {name: CPU torch tensor}.
        shardings: {name: ``jax.sharding.Sharding``} for every name in ``tensors``.
        desc: progress-bar label ("transformer", "VAE decoder").
        release_host: free each torch tensor's storage once it is placed.
        on_placed: optional ``f(name, jax.Array)`` called after each placement (tests and
            benchmarks account memory there).

    Returns:
        {name: ``jax.Array``} in the order of ``tensors``.
    """
    from tqdm import tqdm

    total = sum(int(math.prod(t.shape)) * t.element_size() for t in tensors.values())
    out = {}
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, leave=False,
              desc=f"placing {desc}", mininterval=1.0) as bar:
        for name, tensor in tensors.items():
            nbytes = int(math.prod(tensor.shape)) * tensor.element_size()
            out[name] = place_array(host_array(tensor), shardings[name])
            if release_host:
                release(tensor)
            if on_placed is not None:
                on_placed(name, out[name])
            bar.update(nbytes)
    return out


def per_device_bytes(arrays=None) -> dict:
    """Bytes each device holds of ``arrays`` (default: every live ``jax.Array``).

    Counts each array's shard shape on every device of its sharding, so a replicated array
    counts fully on each device and a whole array committed to one device counts there only.

    Returns:
        {jax.Device: bytes}.
    """
    import jax

    totals: dict = {}
    for arr in jax.live_arrays() if arrays is None else arrays:
        if arr.is_deleted():
            continue
        shard = math.prod(arr.sharding.shard_shape(arr.shape)) * arr.dtype.itemsize
        for device in arr.sharding.device_set:
            totals[device] = totals.get(device, 0) + shard
    return totals
