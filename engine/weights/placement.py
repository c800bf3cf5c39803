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

import glob
import json
import math
import os

import jax
import ml_dtypes
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm


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
    tensor.data = torch.empty(0, dtype=tensor.dtype)


def place_array(host: np.ndarray, sharding):
    """``host`` on the devices of ``sharding``, each device receiving only its own slice.

    Args:
        host: NumPy array (any dtype JAX supports, ``ml_dtypes.bfloat16`` included).
        sharding: a ``jax.sharding.Sharding`` (usually ``NamedSharding``).

    Returns:
        ``jax.Array`` of ``host.shape`` laid out as ``sharding``, ready (transfers done).
    """
    # On the CPU backend a placed slice may alias the host memory it came from (measured: a
    # later in-place write to the torch tensor shows in the jax.Array), so each slice is
    # copied there; an accelerator's transfer copies anyway.
    cpu = all(d.platform == "cpu" for d in sharding.device_set)
    arr = jax.make_array_from_callback(
        host.shape, sharding, lambda index: np.array(host[index]) if cpu else host[index])
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
    """Bytes each device holds in its own memory of ``arrays`` (default: every live
    ``jax.Array``); arrays in host memory (``on_host``) are left out.

    Counts each array's shard shape on every device of its sharding, so a replicated array
    counts fully on each device and a whole array committed to one device counts there only.

    Returns:
        {jax.Device: bytes}.
    """
    totals: dict = {}
    for arr in jax.live_arrays() if arrays is None else arrays:
        if arr.is_deleted() or on_host(arr):
            continue
        for device in arr.sharding.device_set:
            totals[device] = totals.get(device, 0) + shard_bytes(arr)
    return totals


# JAX memory kinds outside the device's HBM (``jax.Device.addressable_memories``).
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def parked_spec(spec, shape: tuple, mesh):
    """``spec`` with every mesh axis it leaves unused (size > 1) added to one dimension.

    The dimension is the largest one whose size divides by its current shards times the
    unused axes' product; with none (a small 1-D bias, an odd shape), ``spec`` is returned
    unchanged and the weight stays as it is.

    Args:
        spec: the weight's ``PartitionSpec``.
        shape: the weight's global shape.
        mesh: the run's ``jax.sharding.Mesh``.
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    axes_of = [() if e is None else (e if isinstance(e, tuple) else (e,)) for e in entries]
    used = {a for axes in axes_of for a in axes}
    free = tuple(a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1)
    if not free:
        return spec
    extra = math.prod(mesh.shape[a] for a in free)
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[d] % (math.prod(mesh.shape[a] for a in axes_of[d]) * extra) == 0:
            entries[d] = axes_of[d] + free
            return P(*entries)
    return spec


def parked_sharding(arr, memory_kind: str | None = None):
    """The ``NamedSharding`` ``arr`` (a ``jax.Array`` or sharded ``ShapeDtypeStruct``) takes
    while parked (``parked_spec`` of its own), in ``memory_kind`` (None or "device": the
    devices' own memory; "pinned_host": their host's, which costs no HBM: ``--park_memory``)."""
    sh = arr.sharding
    return NamedSharding(sh.mesh, parked_spec(sh.spec, tuple(arr.shape), sh.mesh),
                         memory_kind=None if memory_kind == "device" else memory_kind)


def on_host(arr) -> bool:
    """Whether ``arr`` (a ``jax.Array`` or a ``ShapeDtypeStruct`` with a sharding) lives in
    host memory (``HOST_MEMORY_KINDS``): it holds no HBM."""
    return getattr(arr.sharding, "memory_kind", None) in HOST_MEMORY_KINDS


def shard_bytes(arr) -> int:
    """Bytes one device holds of ``arr`` (a ``jax.Array`` or a ``ShapeDtypeStruct`` with a
    sharding): its shard shape times the item size (the whole array where replicated)."""
    return math.prod(arr.sharding.shard_shape(tuple(arr.shape))) * arr.dtype.itemsize


def per_host_bytes(arrays) -> dict:
    """Bytes of the distinct slices each process's devices hold of ``arrays``.

    What a host must read from the checkpoint for its own devices: a slice two of its
    devices share (replicated, or split only over other hosts' axes) counts once.
    ``arrays`` may be ``jax.Array``s or ``ShapeDtypeStruct``s with shardings, so a dry run
    can answer for a topology it does not have.

    Returns:
        ({process_index: bytes}, largest single slice in bytes).
    """
    totals: dict = {}
    largest = 0
    for arr in arrays:
        itemsize = arr.dtype.itemsize
        seen: dict = {}
        for device, index in arr.sharding.devices_indices_map(tuple(arr.shape)).items():
            bounds = tuple(s.indices(n)[:2] for s, n in zip(index, arr.shape, strict=True))
            nbytes = math.prod(hi - lo for lo, hi in bounds) * itemsize
            largest = max(largest, nbytes)
            if bounds not in seen.setdefault(device.process_index, set()):
                seen[device.process_index].add(bounds)
                totals[device.process_index] = totals.get(device.process_index, 0) + nbytes
    return totals, largest


class SafetensorsReader:
    """Slices of a diffusers component's tensors, read straight from its safetensors files.

    ``read(name, index)`` returns only the requested slice (``safe_open(...).get_slice``
    reads just those bytes from the memory-mapped file), so no host ever holds a whole
    checkpoint, nor a whole tensor that its devices hold only part of. Handles a single
    ``*.safetensors`` file and sharded checkpoints with a ``*.safetensors.index.json``.
    Counts the bytes it returns (``bytes_read``).

    Raises:
        FileNotFoundError: the folder holds no safetensors file.
    """

    def __init__(self, folder: str):
        from safetensors import safe_open

        index = glob.glob(os.path.join(folder, "*.safetensors.index.json"))
        if index:
            with open(index[0]) as f:
                weight_map = json.load(f)["weight_map"]
            self.file_of = {k: os.path.join(folder, v) for k, v in weight_map.items()}
        else:
            self.file_of = {}
            for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
                with safe_open(path, framework="pt") as f:
                    self.file_of.update({k: path for k in f.keys()})
        if not self.file_of:
            raise FileNotFoundError(f"no safetensors weights in {folder}")
        self._handles: dict = {}
        self.bytes_read = 0

    def keys(self) -> set:
        return set(self.file_of)

    def source(self, name: str) -> str:
        """The file tensor a read of ``name`` draws on (itself here; a reader that derives
        tensors, ``engine.weights.quantize.QuantizingReader``, names the one it reads)."""
        return name

    def _slice(self, name: str):
        from safetensors import safe_open

        path = self.file_of[name]
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return self._handles[path].get_slice(name)

    def read(self, name: str, index: tuple, dtype, fuse=None) -> np.ndarray:
        """Tensor ``name`` at ``index`` (a tuple of slices), cast to torch ``dtype`` as
        ``from_pretrained`` casts it, as a NumPy array (bf16 as ``ml_dtypes.bfloat16``).

        ``fuse``: optional ``f(index) -> float32 torch tensor``, the slice's LoRA delta
        (``engine.weights.lora.fusers``): added to the slice in float32 before the cast."""
        sl = self._slice(name)
        tensor = sl[index] if sl.get_shape() else self._handles[self.file_of[name]].get_tensor(
            name)
        if fuse is not None:
            tensor = tensor.float() + fuse(index)
        out = host_array(tensor.to(dtype))
        self.bytes_read += out.nbytes
        return out


def place_from_safetensors(reader: SafetensorsReader, params: dict, shardings: dict, *,
                           desc: str, stacked: dict | None = None, on_placed=None,
                           fuse: dict | None = None) -> dict:
    """Place weights whose values are read, slice by slice, from safetensors files.

    Args:
        reader: the component's ``SafetensorsReader``.
        params: {name: torch tensor or meta tensor}: only shape and dtype are used (the
            target dtype, e.g. bf16, while the file may hold float32).
        shardings: {name: ``jax.sharding.Sharding``}.
        desc: progress-bar label.
        stacked: {name: [per-layer file names]} for weights stacked along a leading layer
            axis (``--scan_layers``): slice ``index`` reads ``index[1:]`` of each layer
            ``index[0]`` selects, and stacks them.
        on_placed: optional ``f(name, jax.Array)`` after each weight.
        fuse: optional {file tensor name: ``f(index) -> float32 delta``} (LoRAs,
            ``engine.weights.lora.fusers``): each slice read gets its own slice of the delta, per
            layer for stacked weights, so no host forms a whole fused weight its devices
            split.

    Returns:
        {name: ``jax.Array``}. Each device receives only its own slice; slices shared by
        several local devices (replicated weights) are read once.
    """
    stacked, fuse = stacked or {}, fuse or {}
    total = sum(int(math.prod(t.shape)) * t.element_size() for t in params.values())
    out = {}
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, leave=False,
              desc=f"placing {desc}", mininterval=1.0) as bar:
        for name, t in params.items():
            cache: dict = {}

            def read(index, name=name, dtype=t.dtype, shape=tuple(t.shape), cache=cache):
                key = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
                if key not in cache:
                    if name in stacked:
                        layers = range(len(stacked[name]))[index[0]]
                        files = stacked[name]
                        cache[key] = np.stack([reader.read(files[i], index[1:], dtype,
                                                           fuse.get(reader.source(files[i])))
                                               for i in layers])
                    else:
                        cache[key] = reader.read(name, index, dtype,
                                                 fuse.get(reader.source(name)))
                return cache[key]

            arr = jax.make_array_from_callback(tuple(t.shape), shardings[name], read)
            out[name] = arr.block_until_ready()
            cache.clear()
            if on_placed is not None:
                on_placed(name, out[name])
            bar.update(int(math.prod(t.shape)) * t.element_size())
    return out
