"""``--park_weights``: shard the transformer's replicated weights over every device while the
VAE decodes, and gather them back afterwards.

Why: a layout that replicates the weights over some mesh axes (Ulysses ``sp``, ``dp``) keeps
a whole copy on each chip. Wan 14B at dp2 x sp4 on v6e-8 holds 26.7 GiB of weights per chip;
its 720p x 81 step fits in 31.25 GiB, but the VAE decode beside those weights needs 32.3
(``--dry_run``). The transformer does nothing during the decode, so its weights need not be
whole there: parked, each chip keeps 1/8 of every weight (3.3 GiB).

Parking is a local slice (each device keeps its part of a copy it already holds: no
interconnect traffic); the way back is one all-gather per weight over the interconnect
(about 23 GiB received per chip at 14B over 8 chips, ~0.06 s at v6e's 400 GB/s ICI egress:
an estimate, not a measurement). Both are timed inside the decode (``vae_decode_s``), and
``park_s`` / ``restore_s`` are reported per run.

The placed dicts (``placed["params"]``, ``placed["buffers"]``) are changed in place, so every
program bound to them (the step, the step cache, both experts of a two-expert model) sees the
restored arrays on its next call. Each weight moves on its own (``jax.device_put``, then the
old copy is deleted), so at most one weight is held twice.
"""

from __future__ import annotations

import time

import jax

from engine.weights import layout, placement

MODES = ("auto", "on", "off")


# Where a weight goes while parked: engine.weights.placement (placement streams a two-expert
# model's idle expert straight there).
parked_spec = placement.parked_spec
parked_sharding = placement.parked_sharding


def weights_bytes(weights: list) -> tuple[int, int]:
    """(bytes per device now, bytes per device parked) of the placed weights ``weights``
    (dicts with ``params`` and ``buffers``: ``jax.Array``s or sharded ``ShapeDtypeStruct``s),
    the largest over devices, in HBM (weights in host memory count nothing). Works
    deviceless (``--dry_run``)."""
    arrays = [a for placed in weights for group in ("params", "buffers")
              for a in placed[group].values() if not placement.on_host(a)]  # no HBM
    parked = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=parked_sharding(a))
              for a in arrays]
    return (sum(placement.shard_bytes(a) for a in arrays),
            sum(placement.shard_bytes(a) for a in parked))


def should_park(mode: str, need_bytes: int, saved_bytes: int, capacity: int | None) -> bool:
    """Whether to park: ``on`` always, ``off`` never; ``auto`` when the decode's peak beside
    the resident weights (``need_bytes`` per device) exceeds ``capacity`` (the chip's usable
    HBM per device; None, e.g. on CPU, never parks) and parking saves something."""
    if mode == "on":
        return True
    if mode == "off" or capacity is None or saved_bytes <= 0:
        return False
    return need_bytes > capacity


def decode_memory(mode: str, memory: str, need_bytes: int, weights_bytes: int,
                  parked_bytes: int, capacity: int | None) -> str | None:
    """Where the transformer's weights go while the VAE decodes: None (they stay), "device"
    (sharded over every device, ``parked_bytes`` per device left in HBM) or "pinned_host"
    (host memory: none left in HBM).

    Args:
        mode: ``--park_weights`` ("auto", "on", "off"): whether to park (``should_park``).
        memory: ``--park_memory`` ("auto", "device", "pinned_host"). "auto" takes HBM where
            sharding over the devices brings the decode under ``capacity``, host memory where
            it does not (one chip: sharding saves nothing). An explicit choice is kept.
        need_bytes: the decode's peak per device beside the resident weights.
        weights_bytes / parked_bytes: the weights' HBM bytes per device, whole and parked.
        capacity: usable HBM bytes per device, or None (CPU: "auto" never parks).
    """
    saved = weights_bytes - parked_bytes
    if memory == "device":
        return "device" if should_park(mode, need_bytes, saved, capacity) else None
    if not should_park(mode, need_bytes, weights_bytes, capacity):  # host saves it all
        return None
    if memory == "pinned_host":
        return "pinned_host"
    # "auto": HBM where the sharded copy is enough (no host-link traffic), else host memory.
    fits_sharded = saved > 0 and (capacity is None or need_bytes - saved <= capacity)
    return "device" if fits_sharded else "pinned_host"


def kept_bytes(memory: str | None, parked_bytes: int) -> int:
    """HBM bytes per device the transformer's weights keep while parked in ``memory``
    (``decode_memory``'s answer): none in host memory, ``parked_bytes`` sharded in HBM."""
    return 0 if memory == "pinned_host" else parked_bytes


class ParkingDecoder:
    """A VAE decoder (``ChunkedDecoder`` or a family's) that parks ``weights`` while it runs.

    Args:
        decoder: ``latents -> video`` with ``compile`` / ``memory`` (delegated to).
        weights: the placed transformer dicts (one, or both experts'), changed in place.
        mode: ``auto`` / ``on`` / ``off`` (``--park_weights``).
        capacity: usable HBM bytes per device (``chips.Chip.usable_hbm_bytes``), or None.
        memory: ``--park_memory`` ("auto", "device", "pinned_host"): where parked weights
            go (``decode_memory``). On one chip sharding saves nothing, so "auto" parks the
            transformer in host memory there when the decode would not fit beside it.

    ``decision`` (after the first call): dict(parked, memory, mode, weights_bytes_per_device,
    parked_bytes_per_device, decode_peak_bytes, capacity_bytes); ``parked_bytes_per_device``
    is what stays in HBM (0 in host memory). ``last``: the last call's
    dict(park_s, restore_s) when it parked, else {}.
    """

    def __init__(self, decoder, weights: list, mode: str, capacity: int | None,
                 memory: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"park_weights: expected one of {MODES}, got {mode!r}")
        if memory not in layout.PARK_MEMORY:
            raise ValueError(f"park_memory: expected one of {layout.PARK_MEMORY}, "
                             f"got {memory!r}")
        self.decoder, self.weights, self.mode, self.capacity = decoder, weights, mode, capacity
        self.memory = memory
        self.decision: dict | None = None
        self.last: dict = {}

    def __getattr__(self, name):  # compile, memory, placed, spatial: the decoder's
        if name == "decoder":
            raise AttributeError(name)
        return getattr(self.decoder, name)

    def with_decoder(self, decoder) -> ParkingDecoder:
        """The same parking around another decoder (another shape's programs)."""
        return ParkingDecoder(decoder, self.weights, self.mode, self.capacity, self.memory)

    def decide(self) -> dict:
        """Decide once, from the decode's compiled peak and the weights' bytes per device:
        what ``--dry_run`` adds up too (``engine.dry_run.fit``)."""
        if self.decision is None:
            now, parked = weights_bytes(self.weights)
            peak = self.decoder.memory()["peak_bytes"]
            where = decode_memory(self.mode, self.memory, now + peak, now, parked,
                                  self.capacity)
            parked = kept_bytes(where, parked)
            self.decision = dict(parked=where is not None, memory=where, mode=self.mode,
                                 weights_bytes_per_device=now, parked_bytes_per_device=parked,
                                 decode_peak_bytes=peak, capacity_bytes=self.capacity)
            if where:
                print(f"--park_weights {self.mode}: the transformer weights go from "
                      f"{now / 2**30:.2f} to {parked / 2**30:.2f} GiB per device "
                      f"{'(host memory) ' if where == 'pinned_host' else ''}while the VAE "
                      f"decodes (its peak {peak / 2**30:.2f} GiB)", flush=True)
        return self.decision

    def __call__(self, latents):
        if not self.decide()["parked"]:
            self.last = {}
            return self.decoder(latents)
        t0 = time.perf_counter()
        homes = _move(self.weights, None, self.decision["memory"])
        t1 = time.perf_counter()
        # A two-expert model whose idle expert is parked (``experts.ExpertParking``) keeps
        # everything parked after the decode: the next step gathers the expert it runs,
        # which a restore here would only have to park again.
        owner = self.weights[0].get("expert_parking")
        try:
            video = self.decoder(latents)
            video.block_until_ready()
        finally:
            t2 = time.perf_counter()
            if owner is None:
                _move(self.weights, homes)
            else:
                owner.release()
            self.last = dict(park_s=t1 - t0, restore_s=time.perf_counter() - t2)
        return video


def _move(weights: list, homes: dict | None, memory: str = "device") -> dict:
    """Park every weight (``homes`` None; returns each moved weight's original sharding) in
    ``memory`` ("device" or "pinned_host"), or put each back at its ``homes`` sharding. One
    weight at a time, its old buffer donated (deleted across memory kinds)."""
    moved = {}
    for i, placed in enumerate(weights):
        for group in ("params", "buffers"):
            arrays = placed[group]
            for name, arr in list(arrays.items()):
                key = (i, group, name)
                if homes is None:
                    target = parked_sharding(arr, memory)
                    # Already parked: sharded in HBM, or (``--park_memory pinned_host``) a
                    # two-expert model's idle expert in host memory, which holds no HBM.
                    if placement.on_host(arr) or target.is_equivalent_to(arr.sharding,
                                                                         arr.ndim):
                        continue
                    moved[key] = arr.sharding
                elif key in homes:
                    target = homes[key]
                else:
                    continue
                arrays[name] = move_array(arr, target)
    return moved


def move_array(arr, target, on_move=None):
    """``arr`` resharded to ``target`` (a parking slice is local; a restore is an all-gather
    over the interconnect), then the old buffer deleted: at most one weight is held twice.

    ``on_move``: optional ``f()`` called while both copies are live (the transient the dry
    run charges: ``tests/test_expert_parking.py`` samples the live bytes there)."""
    # Donation across memory kinds (HBM <-> pinned host) is not implemented in JAX; there
    # the old buffer is deleted below instead.
    same = target.memory_kind == arr.sharding.memory_kind
    new = jax.block_until_ready(jax.device_put(arr, target, donate=same))
    if on_move is not None:
        on_move()
    if not arr.is_deleted():  # donate is a hint JAX may ignore; the copy is ours
        arr.delete()
    return new
