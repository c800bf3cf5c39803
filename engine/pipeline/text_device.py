"""``--text_encoder_device cpu|mesh``: where the text encoders (and the image encoders of the
image-to-video checkpoints) run.

``cpu`` (the default) is the design card's choice: plain PyTorch on the host, before JAX
places anything (``engine.pipeline.stages.encode``). ``mesh`` runs the same modules through
torchax on the run's mesh: the family's own encode functions run unchanged, and only the
``forward`` of each module the family names (``TextEncoding.encoder_modules``) is replaced by
a jitted program on the mesh (``MeshEncoders``). The pipelines pad every prompt to a fixed
length (UMT5 512, Qwen2.5-VL 1,108, ByT5 256, Gemma 3 1,024), so each module compiles once per
run; its CPU tensors in, CPU tensors out, so the embeddings, the cache and everything after
are as with ``cpu``.

Why: on a TPU host's CPU the encoders of the newer families cost seconds per prompt (Gemma 3
12B + connectors: about 26 TFLOP at 1,024 tokens); on the chips, milliseconds plus their
weights' HBM (issue 64; /work/shared/notes/whole-video.md has the sizes).

Placement: every weight of two or more dimensions is sharded over all the mesh's devices on
its largest dimension they divide (``engine.weights.sharding.sharding_specs`` with ``fsdp``
and no rule: a generic rule by shape; XLA gathers each weight where it is used), the rest
replicated. The fit (``plan``, before anything loads) counts those bytes per device from the
checkpoint's safetensors headers; the encoders run before the transformer is placed and are
freed after the encode, as the CPU path frees them, so they need to fit alone: where they do
not, the run is refused in one line. The server (``resume`` / ``rest``) keeps them placed for
every job, beside the transformer, or parks them in pinned host memory after each encode
where the devices' live bytes exceed ``PARK_FRACTION`` of the usable HBM (the mechanism and
share a two-expert model's idle expert uses), and brings them back for the next encode: the
steps and the decode get their HBM, but an encode needs them beside the transformer's
weights, which ``plan`` does not check (the transformer's bytes depend on its layout).

Attention: the encoders' SDPA calls (Qwen2.5-VL, Gemma 3, CLIP, SigLIP, the connectors) take
``splash.reference.reference_attention`` (float32 softmax; a query row with no valid key
gives zeros, as torch's CPU SDPA does since torch 2.5, where torchax's own SDPA gives NaN:
Gemma's left padding has such rows), never the run's kernel: it is scoped to the encoders'
traces by a context variable, so a step compiling on another thread meanwhile
(``--overlap_compile``) keeps the run's attention.
"""

from __future__ import annotations

import contextvars
import glob
import json
import math
import os
import time

import jax
import ml_dtypes
import numpy as np
import torch
import torchax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torch.utils import _pytree as pytree
from torchax import interop

from engine.files.checkpoint import looks_local
from engine.programs import parking
from engine.run import chips, lowering
from engine.run.errors import fail
from engine.weights import placement, sharding
from splash.reference import reference_attention

DEVICES = ("cpu", "mesh")
# The checkpoint component whose weight folders are the encoders (families/base.py
# ``Checkpoint.weight_folders``: text encoders, connectors, image encoders).
ENCODER_COMPONENT = "text_encoder"

# Set while an encoder's program is traced: its SDPA calls take the reference attention.
_ENCODING: contextvars.ContextVar[bool] = contextvars.ContextVar("encoding", default=False)


def add_flags(parser) -> None:
    """``--text_encoder_device`` in its own help group."""
    g = parser.add_argument_group("text encoders (docs/features.md)")
    g.add_argument("--text_encoder_device", choices=DEVICES, default="cpu",
                   help="where the text and image encoders run: 'cpu' (PyTorch on the host, "
                        "before the devices are used) or 'mesh' (through torchax on the run's "
                        "devices, weights sharded, compiled once for the padded length; freed "
                        "before the transformer is placed)")


def wanted(config) -> bool:
    """Whether this run encodes on the mesh: ``--text_encoder_device mesh`` in a stage that
    encodes (``all``, ``encode``)."""
    return config.run.text_encoder_device == "mesh" and config.run.stage in ("all", "encode")


def encoder_folders(config, family) -> dict:
    """{folder: path} of a local checkpoint's encoder weight folders that hold weights (a Hub
    id: none, so that the check downloads nothing the load would not)."""
    if not looks_local(config.model.model_id):
        return {}
    names = family.checkpoint.weight_folders.get(ENCODER_COMPONENT, ())
    paths = {name: os.path.join(config.model.model_id, name) for name in names}
    return {name: path for name, path in paths.items()
            if glob.glob(os.path.join(path, "*.safetensors"))}


def sharded_bytes(shape: tuple, itemsize: int, n_devices: int) -> int:
    """Bytes one device holds of a weight of ``shape`` under the generic rule: a weight of 2+
    dims split ``n_devices`` ways on its largest dimension they divide (as
    ``sharding.sharding_specs(..., fsdp=True)`` with no rule), else whole."""
    total = math.prod(shape) * itemsize
    if len(shape) >= 2 and n_devices > 1 and any(d % n_devices == 0 for d in shape):
        return total // n_devices
    return total


def folder_bytes(folder: str, dtype: torch.dtype, n_devices: int) -> tuple[int, int]:
    """(bytes per device, bytes in all) of one encoder folder's weights on the mesh, from the
    safetensors headers (no weight is read): floating tensors in the run ``dtype``, as
    ``from_pretrained`` casts them; others in their file dtype."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_device = whole = 0
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with open(path, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            shape = tuple(entry["shape"])
            size = itemsize if entry["dtype"] in ("F64", "F32", "F16", "BF16") \
                else _FILE_ITEMSIZE.get(entry["dtype"], 8)
            per_device += sharded_bytes(shape, size, n_devices)
            whole += math.prod(shape) * size
    return per_device, whole


_FILE_ITEMSIZE = {"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def plan(config, family, devices, chip) -> dict | None:
    """The encoders' fit on the mesh, before anything loads (None: ``cpu``, or a stage that
    does not encode).

    Returns:
        dict(device="mesh", bytes_per_device={folder: bytes}, total_bytes_per_device,
        capacity_bytes (the chip's usable HBM per device; None off TPU: not checked),
        after_encode: "freed" (a run: they run before the transformer is placed and are
        freed after the encode, so they never share HBM with it) or "resident or parked"
        (``--serve``: decided after each encode, ``rest``)).

    Raises:
        UsageError: the encoders' weights per device exceed the chip's usable HBM.
    """
    if not wanted(config):
        return None
    dtype = getattr(torch, config.model.dtype)
    folders = encoder_folders(config, family)
    per = {name: folder_bytes(path, dtype, len(devices))[0] for name, path in folders.items()}
    total = sum(per.values())
    capacity = chip.usable_hbm_bytes if chip is not None else None
    if capacity is not None and total > capacity:
        fail("--text_encoder_device", "mesh", f"the encoders ({', '.join(per)}) need "
             f"{_size(total)} per device sharded over {len(devices)} devices, more than the "
             f"{_size(capacity)} usable on a {chip.name} device; use --text_encoder_device "
             "cpu or more devices")
    return dict(device="mesh", bytes_per_device=per, total_bytes_per_device=total,
                capacity_bytes=capacity,
                after_encode="freed" if config.serve is None else "resident or parked")


def _size(nbytes: int) -> str:
    """Bytes as GiB, or MiB / bytes where GiB would round to 0.00."""
    if nbytes >= 2**27:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**14 else f"{nbytes} bytes"


class MeshEncoders:
    """Encoder modules whose ``forward`` runs on ``mesh`` through torchax.

    Each module's weights are placed (``place``: the generic sharded rule; the host copies
    stay, so the module is whole again after ``release``) and its instance ``forward``
    replaced by one that moves the call's CPU tensors to the mesh (replicated), runs the
    module's own class ``forward`` as a jitted program (one per distinct call signature:
    non-tensor arguments, shapes, dtypes), and returns CPU tensors in the output's own
    structure (a ``transformers`` ``ModelOutput`` included); non-tensor outputs (a KV cache)
    come back as None.

    ``report()``: {name: dict(bytes_per_device, bytes, programs, calls)}; ``place_s``.
    """

    def __init__(self, modules: dict, mesh):
        self.mesh, self.modules = mesh, modules
        self.replicated = NamedSharding(mesh, P())
        self.placed: dict = {}
        self.stats: dict = {}
        self.attention = self.entry = None  # set by ``start``
        self.homes: dict = {}  # each weight's home sharding while parked
        self.parked = False
        t0 = time.perf_counter()
        for name, module in modules.items():
            self._place(name, module)
        self.place_s = time.perf_counter() - t0

    def _place(self, name: str, module) -> None:
        jm = interop.JittableModule(module)
        specs, _, _ = sharding.sharding_specs({k: tuple(v.shape) for k, v in jm.params.items()},
                                              (), self.mesh, fsdp=True)
        params = placement.place_tensors(
            jm.params, {k: NamedSharding(self.mesh, specs[k]) for k in jm.params},
            desc=name, release_host=False)
        buffers = placement.place_tensors(
            jm.buffers, {k: self.replicated for k in jm.buffers}, desc=f"{name} buffers",
            release_host=False)
        arrays = [*params.values(), *buffers.values()]
        self.placed[name] = (jm, params, buffers)
        self.stats[name] = dict(
            bytes_per_device=max(placement.per_device_bytes(arrays).values(), default=0),
            bytes=sum(a.nbytes for a in arrays), programs=0, calls=0)
        module.forward = self._forward(name, module)

    def _forward(self, name: str, module):
        """The instance ``forward`` that runs ``module``'s class forward on the mesh."""
        jm, params, buffers = self.placed[name]
        programs: dict = {}
        method = type(module).forward

        def forward(*args, **kwargs):
            leaves, spec = pytree.tree_flatten((args, kwargs))
            is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
            static = [None if t else x for x, t in zip(leaves, is_tensor, strict=True)]
            tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
            key = (repr(spec), repr(static), tuple((tuple(x.shape), x.dtype) for x in tensors))
            if key not in programs:
                programs[key] = self._program(jm, method, spec, is_tensor, static)
                self.stats[name]["programs"] += 1
            program, out = programs[key]
            arrays = [placement.place_array(placement.host_array(x), self.replicated)
                      for x in tensors]
            results = iter(to_torch(r) for r in program(params, buffers, arrays))
            self.stats[name]["calls"] += 1
            return pytree.tree_unflatten([next(results) if t else None for t in out["is_tensor"]],
                                         out["spec"])

        return forward

    def _program(self, jm, method, spec, is_tensor: list, static: list):
        """(the jitted program of one call signature, its output structure, filled while
        it traces)."""
        out: dict = {}

        def call(params, buffers, tensors):
            given = iter(tensors)
            args, kwargs = pytree.tree_unflatten(
                [next(given) if t else s for t, s in zip(is_tensor, static, strict=True)], spec)
            token = _ENCODING.set(True)
            try:
                result = jm.functional_call(method, params, buffers, *args, **kwargs)
            finally:
                _ENCODING.reset(token)
            leaves, out["spec"] = pytree.tree_flatten(result)
            out["is_tensor"] = [isinstance(x, torch.Tensor) for x in leaves]
            return [x for x in leaves if isinstance(x, torch.Tensor)]

        return jax.jit(interop.jax_view(call), out_shardings=self.replicated), out

    def report(self) -> dict:
        return {name: dict(s) for name, s in self.stats.items()}

    def park(self) -> None:
        """Every placed weight into pinned host memory at its own spec (no HBM held),
        one weight at a time (``parking.move_array``); ``unpark`` brings each back to its
        home sharding. The weights the programs take are replaced in place, so the next
        call runs on the unparked arrays."""
        for name, (_, params, buffers) in self.placed.items():
            for group, arrays in (("params", params), ("buffers", buffers)):
                for k, arr in list(arrays.items()):
                    self.homes[(name, group, k)] = arr.sharding
                    arrays[k] = parking.move_array(arr, NamedSharding(
                        self.mesh, arr.sharding.spec, memory_kind="pinned_host"))
        self.parked = True

    def unpark(self) -> None:
        for name, (_, params, buffers) in self.placed.items():
            for group, arrays in (("params", params), ("buffers", buffers)):
                for k, arr in list(arrays.items()):
                    arrays[k] = parking.move_array(arr, self.homes[(name, group, k)])
        self.parked = False

    def release(self) -> None:
        """Each module's own ``forward`` back (its host weights were kept) and its device
        arrays deleted."""
        for name, module in self.modules.items():
            module.__dict__.pop("forward", None)
            _, params, buffers = self.placed.pop(name, (None, {}, {}))
            for arr in [*params.values(), *buffers.values()]:
                arr.delete()


def to_torch(arr) -> torch.Tensor:
    """A replicated ``jax.Array`` as a CPU torch tensor (this process's copy: no gather
    across hosts); bf16 through its bits, as ``placement.host_array`` goes. int32 comes back
    as int64: JAX runs without x64, so torch's int64 results (masks built by ``.to(int64)``,
    torch's default integer type) are int32 here."""
    host = np.array(arr.addressable_data(0))  # a writable copy
    if host.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(host.view(np.int16)).view(torch.bfloat16)
    if host.dtype == np.int32:
        return torch.from_numpy(host.astype(np.int64))
    return torch.from_numpy(host)


class EncodingAttention:
    """The encoders' SDPA while ``MeshEncoders`` programs trace: the reference attention
    inside their traces (``_ENCODING``), whatever is installed (torchax's own, the run's
    kernel) everywhere else. ``restore()`` puts the previous definition back, unless another
    was installed meanwhile (the run's own ``install_sdpa_override``)."""

    def __init__(self):
        env = self.env = torchax.default_env()
        self.op = torch.nn.functional.scaled_dot_product_attention
        previous = self.previous = env._ops.get(self.op)

        def routed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                   scale=None, enable_gqa=False):
            if not _ENCODING.get():
                return _call_op(previous, env, query, key, value, attn_mask, dropout_p,
                                is_causal, scale, enable_gqa)
            if enable_gqa:  # heads of k/v repeated, as torch's enable_gqa
                key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
                value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
            q, k, v = env.t2j_iso((query, key, value))
            mask = None if attn_mask is None else env.t2j_iso(attn_mask)
            return env.j2t_iso(reference_attention(q, k, v, scale=scale, mask=mask,
                                                   is_causal=is_causal))

        env.override_op_definition(self.op, routed)
        self.installed = env._ops[self.op]

    def restore(self) -> None:
        ops = self.env._ops
        if ops.get(self.op) is self.installed:
            if self.previous is None:
                ops.pop(self.op, None)
            else:
                ops[self.op] = self.previous


def _call_op(op, env, *args):
    """Call a torchax op registry entry as torchax's dispatch would (torch tensors in)."""
    kwargs = dict(env=env) if op.needs_env else {}
    if op.is_jax_function:
        return env.j2t_iso(op.func(*env.t2j_iso(args), **kwargs))
    return op.func(*args, **kwargs)


def start(pipe, family, config, mesh, report: dict) -> MeshEncoders | None:
    """The family's encoder modules on ``mesh`` (``MeshEncoders``, with ``EncodingAttention``)
    when the run asks for it (``wanted``); else None and nothing moves.
    ``report["text_encoders"]`` gets where they run ("cpu" or "mesh"); ``finish`` adds the
    modules' entries. Call ``finish`` after the encode."""
    report["text_encoders"] = dict(device="cpu")
    if not wanted(config):
        return None
    modules = {} if family.text.encoder_modules is None else family.text.encoder_modules(pipe)
    # torchax's exact lowerings and its in-place-on-view fix (a split RoPE's addcmul_ on a
    # slice, LTX-2's connectors: without it their embeddings moved by 0.23), as every run
    # installs them before its step traces.
    lowering.install(torchax.default_env())
    attention = EncodingAttention()
    encoders = MeshEncoders(modules, mesh)
    encoders.attention = attention
    report["text_encoders"] = encoders.entry = dict(device="mesh", place_s=encoders.place_s)
    return encoders


def finish(encoders: MeshEncoders | None) -> None:
    """After the encode: every module's own forward back, its device memory freed (the
    encoders never share HBM with the transformer), the SDPA definition restored, and the
    report's entry completed (each module's bytes, programs and calls). None: nothing."""
    if encoders is None:
        return
    encoders.entry.update(modules=encoders.report(), after_encode="freed")
    encoders.release()
    encoders.attention.restore()


# A server keeps its encoders for every job (``resume`` / ``rest``). After an encode they
# are parked in pinned host memory where the devices' live bytes (the transformer's weights,
# the encoders', anything else placed) exceed this share of a device's usable HBM, the share
# at which a two-expert model parks its idle expert (``engine.programs.experts``).
PARK_FRACTION = 0.875


def device_capacity(mesh) -> int | None:
    """Usable HBM bytes of one of ``mesh``'s devices (``chips``), None off TPU."""
    chip = chips.chip_for_device_kind(mesh.devices.flat[0].device_kind)
    return chip and chip.usable_hbm_bytes


def resume(encoders: MeshEncoders | None, pipe, family, config, mesh,
           report: dict) -> MeshEncoders | None:
    """Before a served encode (the server keeps its encoders): the first call places them
    (``start``), a later one brings parked weights back to the devices; each installs the
    encoders' attention (the run's kernel was installed since). None: ``cpu``."""
    if not wanted(config):
        return None
    if encoders is None:
        return start(pipe, family, config, mesh, report)
    lowering.install(torchax.default_env())
    encoders.attention = EncodingAttention()
    if encoders.parked:
        encoders.unpark()
    return encoders


def rest(encoders: MeshEncoders | None) -> None:
    """After a served encode: the attention restored; the encoders parked in pinned host
    memory where the live device bytes exceed ``PARK_FRACTION`` of the usable HBM
    (``device_capacity``; never off TPU), else left on the devices for the next job. The
    report's entry gets each module's counts and ``after_encode``: "parked" or "resident"."""
    if encoders is None:
        return
    encoders.attention.restore()
    capacity = device_capacity(encoders.mesh)
    live = max(placement.per_device_bytes().values(), default=0)
    if capacity is not None and live > PARK_FRACTION * capacity:
        encoders.park()
    encoders.entry.update(modules=encoders.report(),
                          after_encode="parked" if encoders.parked else "resident")
