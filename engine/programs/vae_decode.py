"""The chunked, sharded VAE decode program.

A video VAE's decoder is causal in time: decoding latent frame i needs a cache of what its
convolutions saw at frames < i. Jitting the whole time loop unrolls it (at Wan 720p x 81
frames XLA then needs 88 GB of temporaries per v6e chip). ``ChunkedDecoder`` instead runs
one compiled program per latent frame with the cache as explicit arrays in and out. The
cache's *structure* (which entries are absent, placeholders or tensors: its "kinds") is
static per program, so a decode compiles to a handful of programs (first frame, second
frame, every later frame) whose memory is one frame's worth. Each frame's width is split
over every mesh device (GSPMD partitions the convs spatially and exchanges halos).

A family supplies the per-frame torch function (``chunk_fn``) and, optionally, a one-program
function for the whole latent tensor (``full_fn``, e.g. diffusers' tiled decode).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop

from custom_splash_attention import forced_attention
from engine.programs import executables


class ChunkedDecoder:
    """Latents (1, C, F', h, w) float32 -> video (1, 3, F, H, W) float32 in [-1, 1], on device.

    Args:
        placed: the VAE's decode weights as ``sharding.place_module`` returns them
            (``ShapeDtypeStruct``s with ``abstract=True``).
        mesh: the run's mesh.
        chunk_fn: ``f(jm, kinds, first, record, spatial) -> torch function``
            ``(params, buffers, z (1, C, 1, h, w), mean, inv_std, cache list) ->
            (frames chunk, new cache list)``; it writes the kinds of the cache it returns to
            ``record[(kinds, first)]``. ``spatial`` is the width ``NamedSharding`` or None.
        initial_kinds: the cache structure before the first frame.
        latents_mean, latents_std: per-channel (C,) statistics; latents are de-normalised as
            ``z / inv_std + mean`` inside the programs.
        full_fn: optional ``f(jm) -> torch function (params, buffers, latents, mean, inv_std)
            -> video``; used instead of the chunks when given.
        abstract: deviceless AOT compile (dry run): shapes only.
        fallbacks: ``sharding.Fallbacks``; told when the width cannot be split.

    ``compile(latents)`` AOT-compiles every program and returns seconds; ``memory()`` gives
    the compiled programs' per-device HBM.
    """

    def __init__(self, placed: dict, mesh, *, chunk_fn, initial_kinds: tuple, latents_mean,
                 latents_std, full_fn=None, abstract: bool = False, fallbacks=None):
        self.placed, self.chunk_fn, self.full_fn = placed, chunk_fn, full_fn
        self.initial_kinds, self.fallbacks = tuple(initial_kinds), fallbacks
        self.replicated = NamedSharding(mesh, P())
        c = len(latents_mean)
        mean = np.asarray(latents_mean, np.float32).reshape(1, c, 1, 1, 1)
        inv_std = 1.0 / np.asarray(latents_std, np.float32).reshape(1, c, 1, 1, 1)
        if abstract:
            mean, inv_std = (jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.replicated)
                             for a in (mean, inv_std))
        else:
            mean, inv_std = jax.device_put((mean, inv_std), self.replicated)
        self.mean, self.inv_std = mean, inv_std
        self.kinds_out: dict = {}
        self.programs: dict = {}  # (kinds, first, cache shapes) -> (compiled, out cache avals)
        self._slicers: dict = {}
        self.full = None
        self.calls: dict = {}  # program key -> frames it decodes, counted by ``compile``

    def _frame(self, latents, i):
        """Latent frame i as (1, C, 1, h, w), laid out as the chunk programs expect."""
        sharding = self.spatial(latents.shape) or self.replicated
        if sharding not in self._slicers:
            self._slicers[sharding] = jax.jit(
                lambda z, i: jax.lax.dynamic_slice_in_dim(z, i, 1, axis=2),
                out_shardings=sharding)
        return self._slicers[sharding](latents, i)

    def spatial(self, shape):
        """Width sharding over every mesh device when the latent width allows it, else None."""
        mesh = self.replicated.mesh
        if mesh.size == 1:
            return None
        if shape[-1] % mesh.size:
            if self.fallbacks is not None:
                self.fallbacks("vae_decode_replicated",
                               f"latent width {shape[-1]} (--width / 8) does not divide over "
                               f"{mesh.size} devices: every device decodes whole frames")
            return None
        return NamedSharding(mesh, P(None, None, None, None, mesh.axis_names))

    def _args(self, z, cache):
        p = self.placed
        return (p["params"], p["buffers"], z, self.mean, self.inv_std, cache)

    @staticmethod
    def _key(kinds, first, cache) -> tuple:
        """A frame program's key: its cache kinds, first frame or not, the cache's shapes."""
        return (kinds, first, tuple((c.shape, str(c.dtype)) for c in cache))

    def _program(self, kinds, first, z, cache):
        key = self._key(kinds, first, cache)
        if key not in self.programs:
            spatial = self.spatial(z.shape)
            args = self._args(z, cache)

            def lower():
                fn = self.chunk_fn(self.placed["module"], kinds, first, self.kinds_out, spatial)
                with forced_attention("xla"):  # one float32 head of 384: see forced_attention
                    return jax.jit(interop.jax_view(fn)).lower(*args)

            # The output cache's kinds are learnt while tracing: a loaded program brings them.
            compiled, kinds_out = executables.compile_program(
                "vae_decode_chunk", lower, args, extra=[kinds, first],
                meta=lambda: self.kinds_out[(kinds, first)])
            self.kinds_out[(kinds, first)] = _tuples(kinds_out)
            cache_out = compiled.out_info[1]
            if spatial is not None:
                cache_out = [jax.ShapeDtypeStruct(c.shape, c.dtype, sharding=spatial)
                             for c in cache_out]
            self.programs[key] = (compiled, cache_out)
        return self.programs[key]

    def compile(self, latents) -> float:
        """AOT-compile every program decoding ``latents`` (array or ShapeDtypeStruct)."""
        t0 = time.perf_counter()
        if self.full_fn is not None:
            args = self._args(latents, [])[:5]

            def lower():
                with forced_attention("xla"):
                    return jax.jit(interop.jax_view(self.full_fn(self.placed["module"])),
                                   out_shardings=self.replicated).lower(*args)

            self.full, _ = executables.compile_program("vae_decode_full", lower, args)
            return time.perf_counter() - t0
        b, c, f, h, w = latents.shape
        z = jax.ShapeDtypeStruct((b, c, 1, h, w), latents.dtype,
                                 sharding=self.spatial(latents.shape) or self.replicated)
        kinds, cache, self.calls = self.initial_kinds, [], {}
        for i in range(f):
            key = self._key(kinds, i == 0, cache)
            _, cache = self._program(kinds, i == 0, z, cache)
            self.calls[key] = self.calls.get(key, 0) + 1
            kinds = self.kinds_out[(kinds, i == 0)]
        return time.perf_counter() - t0

    def program_calls(self) -> list:
        """[(compiled program, calls per decode)] of the last ``compile``: the dry run's
        decode estimate (``engine.dry_run.estimate.decode_floor``)."""
        if self.full is not None:
            return [(self.full, 1)]
        return [(self.programs[key][0], n) for key, n in self.calls.items()]

    def adopt(self, other: ChunkedDecoder) -> None:
        """Take ``other``'s compiled programs (and the cache kinds learnt tracing them):
        ``other`` was built from shapes (``abstract=True``) for weights, statistics and
        latents of this decoder's signature, which the caller checked
        (``engine.pipeline.ahead.Ahead.decoder_for``). A program takes its weights as
        arguments, so it runs this decoder's own."""
        self.programs, self.kinds_out, self.full = other.programs, other.kinds_out, other.full

    def memory(self) -> dict:
        """Peak per-device bytes over the compiled programs (they run one at a time).

        Returns dict(argument_bytes, output_bytes, temp_bytes, peak_bytes, programs).
        """
        programs = [self.full] if self.full is not None else [
            c for c, _ in self.programs.values()]
        stats = [c.memory_analysis() for c in programs]

        def total(m):
            return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                    - m.alias_size_in_bytes)

        peak = max(stats, key=total)
        return dict(argument_bytes=peak.argument_size_in_bytes,
                    output_bytes=peak.output_size_in_bytes, temp_bytes=peak.temp_size_in_bytes,
                    peak_bytes=total(peak), programs=len(programs))

    def __call__(self, latents):
        if self.full is not None:
            return self.full(*self._args(latents, [])[:5])
        kinds, cache, chunks = self.initial_kinds, [], []
        for i in range(latents.shape[2]):
            z = self._frame(latents, i)
            compiled, _ = self._program(kinds, i == 0, z, cache)
            out, cache = compiled(*self._args(z, cache))
            kinds = self.kinds_out[(kinds, i == 0)]
            chunks.append(out)
        return jnp.concatenate(chunks, axis=2)


def _tuples(x):
    """JSON's lists back to the tuples the cache kinds are (nested)."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x
