"""The JAX process around a run: platform choice, compilation cache, multi-host runtime,
host gathers, the deviceless TPU compile setup, and one-line device out-of-memory errors."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import logging
import math
import os
import re
import sys
import warnings
import zlib
from collections.abc import Mapping, MutableMapping

import jax
import numpy as np
import torch
from jax.experimental.compilation_cache import compilation_cache

import custom_splash_attention as csa
from engine.run.errors import GenerationError, UsageError, fail, first_line

log = logging.getLogger("generate_flax")

# Deviceless compiles for these chips load a newer libtpu than the one real runs use: jax
# 0.10.2's [tpu] extra pins libtpu 0.0.42.*, whose static profile aborts on tpu7x. 0.0.51
# loads under jax/jaxlib 0.10.2 and profiles tpu7x, our kernel included; 0.0.52 (the newest
# on 2026-11-24) aborts the profile of any Pallas kernel with a branch on tpu7x ("LLO_CHECK
# failure ... LloOpcodeIsScalarBranch"), and 0.0.43.2-0.0.51 profile a trivial one.
# `make venv` installs it apart, in ``<venv>/libtpu-next`` (``pip install --target``), and
# ``TPU_LIBRARY_PATH`` selects it for the dry run only; runs on chips keep the pinned libtpu
# until a TPU confirms the newer one.
PROFILE_LIBTPU_VERSION = "0.0.51"
PROFILE_LIBTPU_CHIPS = ("tpu7x",)


def has_tpu_device_files() -> bool:
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def has_gpu_device_files() -> bool:
    """An NVIDIA driver's device files and JAX's CUDA plugin (``requirements-gpu.txt``)."""
    plugins = ("jax_cuda13_plugin", "jax_cuda12_plugin")
    return bool(glob.glob("/dev/nvidia[0-9]*")) and any(
        importlib.util.find_spec(p) is not None for p in plugins)


@dataclasses.dataclass(frozen=True)
class ProcessEnv:
    """Environment settings that XLA and libtpu read once, when their backend starts, as a
    value: validation computes them (``engine.weights.quantize.check_flag``), the dry run adds
    its own (``deviceless_tpu_env``), and only ``apply_process_env`` writes them, where the
    runtime starts. Validating in-process (a test, the server) thus leaves the environment
    as it was.

    xla_flags / libtpu_args: flags ("--name=value" or "--name") added at the end of
        ``XLA_FLAGS`` / ``LIBTPU_INIT_ARGS``, each unless the variable already names it (the
        user's own setting wins).
    defaults: (variable, value) pairs set unless the variable is set.
    overrides: (variable, value) pairs set whatever the variable holds.
    """

    xla_flags: tuple[str, ...] = ()
    libtpu_args: tuple[str, ...] = ()
    defaults: tuple[tuple[str, str], ...] = ()
    overrides: tuple[tuple[str, str], ...] = ()

    def __add__(self, other: ProcessEnv) -> ProcessEnv:
        """Both settings, ``self``'s first (their flags in that order)."""
        return ProcessEnv(**{f.name: getattr(self, f.name) + getattr(other, f.name)
                             for f in dataclasses.fields(self)})

    def changes(self, env: Mapping[str, str]) -> dict[str, str]:
        """{variable: new value} that applying these settings to ``env`` would write; reads
        ``env`` only."""
        out = {}
        for name, flags in (("XLA_FLAGS", self.xla_flags),
                            ("LIBTPU_INIT_ARGS", self.libtpu_args)):
            value = env.get(name, "")
            for flag in flags:
                if flag.split("=")[0] not in value:
                    value = f"{value} {flag}".strip()
            if value != env.get(name, ""):
                out[name] = value
        out.update((k, v) for k, v in self.defaults if k not in env and k not in out)
        out.update(self.overrides)
        return out


def apply_process_env(settings: ProcessEnv | None,
                      env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Write ``settings`` (None: nothing) into ``env``, the process environment: the one
    writer of ``ProcessEnv``s, called where the runtime starts (``start_distributed``, the dry
    run's deviceless setup, a profiling process), before JAX initialises a backend and libtpu
    loads, which read these variables once. Returns {variable: value} written."""
    changes = {} if settings is None else settings.changes(env)
    env.update(changes)
    return changes


def configure_jax_platform() -> None:
    """Keep JAX on CPU on hosts with no TPU and no NVIDIA GPU unless the user chose a
    platform.

    ``jax[tpu]`` installs libtpu everywhere; on a CPU host its probe prints a screen of
    TPU-detection errors before falling back to CPU. Setting ``JAX_PLATFORMS=cpu`` only when no
    TPU device file exists keeps real TPU errors visible on TPU VMs; a GPU host with JAX's
    CUDA plugin gets ``cuda`` (the TPU probe's noise skipped there too).
    """
    if "JAX_PLATFORMS" in os.environ or has_tpu_device_files():
        return
    os.environ["JAX_PLATFORMS"] = "cuda" if has_gpu_device_files() else "cpu"


def topology_desc(topology: str):
    """``jax.experimental.topologies.get_topology_desc`` for a TPU topology name ("v6e:2x4").

    A single chip ("v6e:1x1", "v5e:1x1") is refused by JAX with its default hosts' bounds
    ("not divisible by ... chips_per_host_bounds 2x2x1"): one chip is one host's whole
    slice, so it is described with ``chips_per_host_bounds=(1, 1, 1)``."""
    from jax.experimental import topologies

    dims = [int(x) for x in topology.split(":")[1].split("x")]
    bounds = dict(chips_per_host_bounds=(1, 1, 1)) if math.prod(dims) == 1 else {}
    return topologies.get_topology_desc(platform="tpu", topology_name=topology, **bounds)


def use_deviceless_tpu(topology: str, *, fast_convs: bool = False,
                       profile_libtpu: bool = False) -> None:
    """Apply ``deviceless_tpu_env`` (same arguments) to the process environment: the start of
    a process that compiles for a TPU it does not have. Call before JAX touches the TPU
    backend.

    Raises:
        UsageError: a tpu7x topology without the libtpu installed apart.
    """
    apply_process_env(deviceless_tpu_env(topology, fast_convs=fast_convs,
                                         profile_libtpu=profile_libtpu))


def deviceless_tpu_env(topology: str, *, fast_convs: bool = False,
                       profile_libtpu: bool = False) -> ProcessEnv:
    """What lets libtpu compile for ``topology`` (e.g. "v6e:2x4") on a host with no TPU, as a
    ``ProcessEnv`` (the environment is read, not written).

    Sets, unless already set, the variables libtpu reads when it first initialises: an
    accelerator type (the topology name passed to ``get_topology_desc``, not this, picks the
    compile target), a single localhost worker, no metadata-server query, and no libtpu lock
    (no chip is opened, so concurrent compiles need not take it).

    With ``profile_libtpu`` (the dry run, the profiling subprocesses), topologies of
    ``PROFILE_LIBTPU_CHIPS`` (tpu7x) select the libtpu installed apart
    (``profile_libtpu_path``) through ``TPU_LIBRARY_PATH``, unless the user set that to
    another library. It takes effect only if libtpu has not loaded yet in this process.

    ``fast_convs`` drops libtpu's search for the fastest emitter of every 3D conv (5-70 s
    each, most of a VAE compile). Memory and FLOP figures came out byte-identical for the
    14B step and the 720p VAE decode, at a fifth to a tenth of the compile time.

    Raises:
        UsageError: a tpu7x topology without the libtpu installed apart.
    """
    chip, dims = topology.split(":")
    count = math.prod(int(x) for x in dims.split("x"))
    # ``import libtpu`` (Pallas TPU imports it) sets TPU_LIBRARY_PATH to the pinned library's
    # own path: that is not a choice of the user's.
    chosen = os.environ.get("TPU_LIBRARY_PATH") not in (None, "", _pinned_libtpu_path())
    library = ()
    if profile_libtpu and chip in PROFILE_LIBTPU_CHIPS and not chosen:
        path = profile_libtpu_path()
        if not os.path.exists(path):
            fail("--topology", topology, f"{chip} compiles with libtpu "
                 f"{PROFILE_LIBTPU_VERSION} installed apart, not found at {path} "
                 "(`make venv` installs it)")
        library = (("TPU_LIBRARY_PATH", path),)
    return ProcessEnv(
        libtpu_args=("--xla_jf_convolution_performance_target=0",) if fast_convs else (),
        defaults=(("TPU_ACCELERATOR_TYPE", f"{chip}-{count}"),
                  ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_SKIP_MDS_QUERY", "1"),
                  ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")),
        overrides=library)


def _pinned_libtpu_path() -> str | None:
    spec = importlib.util.find_spec("libtpu")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(spec.submodule_search_locations[0], "libtpu.so")


def profile_libtpu_path() -> str:
    """Where `make venv` installs libtpu ``PROFILE_LIBTPU_VERSION``: beside the venv's own
    packages, so that the pinned libtpu stays the one ``import libtpu`` finds."""
    return os.path.join(sys.prefix, "libtpu-next", "libtpu", "libtpu.so")


def quiet_known_warnings() -> None:
    """Silence three warnings that are understood and harmless, so real ones stay visible."""
    # torchax writes float32 RoPE products into a bf16 buffer through a JAX scatter where
    # engine.run.lowering is not installed (or declines the key); torch casts on assignment
    # too, so the values are the ones diffusers computes.
    warnings.filterwarnings("ignore", message="scatter inputs have incompatible types",
                            category=FutureWarning)
    # torch int64 indices become int32 under JAX's default x64=False; our sizes are far below 2^31.
    warnings.filterwarnings("ignore", message="Explicitly requested dtype int64",
                            category=UserWarning)
    # imageio-ffmpeg starts ffmpeg with fork+exec; exec follows fork at once, so JAX's threads
    # are never used in the child.
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)


# Persistent-cache traffic of this process, from JAX's monitoring events.
CACHE_STATS = {"hits": 0, "misses": 0, "compile_time_saved_s": 0.0}
_CACHE_EVENTS = {"/jax/compilation_cache/cache_hits": "hits",
                 "/jax/compilation_cache/cache_misses": "misses"}


def _count_cache_event(event: str, **_) -> None:
    if event in _CACHE_EVENTS:
        CACHE_STATS[_CACHE_EVENTS[event]] += 1


def _count_cache_saving(event: str, seconds: float, **_) -> None:
    if event == "/jax/compilation_cache/compile_time_saved_sec":
        CACHE_STATS["compile_time_saved_s"] += seconds


def cache_events_since(before: dict) -> dict:
    """Persistent-cache hits and misses since the ``CACHE_STATS`` snapshot ``before``: a
    program compiled (or loaded from the cache) meanwhile shows here."""
    return {k: CACHE_STATS[k] - before[k] for k in ("hits", "misses")}


def enable_compilation_cache(path: str) -> bool:
    """Turn on JAX's persistent compilation cache at ``path``; returns whether it is on.

    Every compiled program is cached (no minimum compile time or size): the VAE decode and the
    transformer step are the slow ones, and a warm process then skips XLA compilation entirely.
    Hits, misses and the compile seconds saved are counted in ``CACHE_STATS`` (the report's
    ``compilation_cache``) through ``jax.monitoring`` listeners.

    JAX's cache settings are process-wide, and JAX reads them once, at the first compile: a
    run with ``path`` "none" in a process where an earlier run had turned the cache on (a test
    after another in one pytest worker) still compiled into that run's folder (measured: 5
    misses, then 5 hits on a rerun, under "none"). A changed setting therefore resets JAX's
    cache, so that the next compile reads the new one.
    """
    if path.lower() == "none":
        if jax.config.jax_compilation_cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir", None)
            compilation_cache.reset_cache()
        return False
    os.makedirs(path, exist_ok=True)
    changed = jax.config.jax_compilation_cache_dir != path
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    if changed:
        compilation_cache.reset_cache()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if not getattr(enable_compilation_cache, "listening", False):
        jax.monitoring.register_event_listener(_count_cache_event)
        jax.monitoring.register_event_duration_secs_listener(_count_cache_saving)
        enable_compilation_cache.listening = True
    return True


# Seconds without a heartbeat after which JAX's coordination service declares a process dead
# and stops the others (JAX's default is 100 s); heartbeats come from a background thread, so
# long compiles do not count against it.
DISTRIBUTED_HEARTBEAT_TIMEOUT_S = 30


def start_distributed(coordinator_address, num_processes, process_id,
                      process_env: ProcessEnv | None = None) -> bool:
    """Start a run's runtime: apply ``process_env`` (the run's ``RunConfig.process_env``,
    ``apply_process_env``), choose the platform, and join JAX's multi-controller runtime when
    the run spans several processes (hosts).

    With ``num_processes`` > 1 the arguments say who is who; off TPU the processes talk
    through JAX's CPU collectives (gloo). On a TPU VM without them, ``jax.distributed.
    initialize`` finds the slice's hosts itself (a single host finds one process). Must run
    before any other JAX call. Returns whether more than one process takes part.

    Raises:
        GenerationError: the runtime could not start (coordinator unreachable...).
    """
    apply_process_env(process_env)
    configure_jax_platform()
    explicit = num_processes is not None
    if explicit and num_processes == 1:
        return False
    if not explicit and not has_tpu_device_files():
        return False
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes,
            process_id=process_id, heartbeat_timeout_seconds=DISTRIBUTED_HEARTBEAT_TIMEOUT_S)
    except ValueError as e:
        if explicit:
            raise GenerationError(f"could not join the multi-host runtime: {e}") from None
        # Auto-detection found no cluster (JAX leaves the coordinator unset): a TPU host
        # outside a managed slice runs on its own chips, as it did before multi-host support.
        log.warning("no multi-host TPU slice detected (%s): using this host's chips only", e)
        return False
    except Exception as e:  # the runtime's errors are long; one line names the cause
        raise GenerationError(f"could not join the multi-host runtime: {first_line(e)}") \
            from None
    return jax.process_count() > 1


def in_multi_process_run() -> bool:
    return jax.distributed.is_initialized() and jax.process_count() > 1


def process_index() -> int:
    return jax.process_index()


def is_writer() -> bool:
    """Only process 0 writes files (mp4, JSON, intermediates, profile)."""
    return process_index() == 0


def to_host(x) -> np.ndarray:
    """A ``jax.Array`` as a NumPy array on this host; gathered from every process when its
    shards live on several (``multihost_utils.process_allgather``)."""
    if x.is_fully_addressable:
        return np.array(jax.device_get(x))  # a writable copy
    from jax.experimental import multihost_utils

    return np.array(multihost_utils.process_allgather(x, tiled=True))


def torch_from_jax(x):
    """A ``jax.Array`` gathered to this host as a CPU torch tensor."""
    return torch.from_numpy(to_host(x))


def check_same_on_every_host(what: str, array: np.ndarray) -> None:
    """Every process computed ``array`` itself (text encoder, seeded noise); refuse to go on
    if the hosts disagree (a different checkpoint, prompt or library on one host), instead of
    silently mixing their halves of a batch.

    Raises:
        GenerationError: the hosts' arrays differ.
    """

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    digest = np.uint32(zlib.crc32(np.ascontiguousarray(array).view(np.uint8)))
    try:
        multihost_utils.assert_equal(digest, f"{what} differ between hosts")
    except AssertionError as e:
        raise GenerationError(f"{e}: every host must run the same command on the same "
                              "checkpoint and library versions") from None


OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory", "exceeds available HBM",
               "Ran out of memory")


def oom_details(text: str) -> str:
    """The sizes an XLA/PJRT out-of-memory message states, as a short phrase ("" if none)."""
    size = r"([\d.]+\s?[KMGT]i?B?)"
    for pattern, fmt in (
        # libtpu's "temporaries" figure includes the arguments (engine.dry_run.fit._oom_row).
        (rf"temporaries \({size}\) exceeds available HBM \({size}\)",
         "needs {0} (arguments and temporaries) of {1}"),
        (rf"[Uu]sed {size} of {size}", "needs {0} of {1}"),
        (rf"allocate {size}.*?{size} free", "allocating {0} with {1} free"),
        (rf"allocat\w* {size}", "allocating {0}"),
        (r"allocating (\d+) bytes", "allocating {0} bytes"),
    ):
        m = re.search(pattern, text, flags=re.S)
        if m:
            return fmt.format(*m.groups())
    return ""


@contextlib.contextmanager
def hardware_errors(stage: str, hint: str = ""):
    """Turn a device out-of-memory error inside the block into a one-line ``GenerationError``.

    It names ``stage``, the sizes the runtime reported, and ``hint``
    (``engine.files.report.oom_hint``: on a TPU the ``--dry_run`` command that predicts the
    failure without one, on a GPU what shrinks the memory). Any other error passes through
    unchanged.
    """
    try:
        yield
    except (UsageError, GenerationError):
        raise
    except Exception as e:
        text = str(e)
        if not any(marker in text for marker in OOM_MARKERS):
            raise
        details = oom_details(text)
        raise GenerationError(
            f"out of device memory while {stage}" + (f" ({details})" if details else "")
            + (f"; {hint}" if hint else "")) \
            from None


def check_attention_kernel(attention: str, *, interpret: bool) -> dict | None:
    """Self-check the kernel ``attention`` names (a Splash kernel, or cuDNN for "cudnn": the
    prologue lets "cudnn" through on a GPU only) on the default device (see
    ``custom_splash_attention.kernel_self_check``); None for "xla".

    Raises:
        GenerationError: the kernel's error exceeds the tested tolerance.
    """
    if attention not in (*csa.SPLASH_KERNELS, "cudnn"):
        return None
    result = csa.kernel_self_check(attention, interpret=interpret)
    if not result["passed"]:
        other = "--attention stock_splash" if attention == "splash" else "--attention xla"
        raise GenerationError(
            f"--attention {attention}: kernel self-check failed on "
            f"{jax.devices()[0].device_kind}: max error {result['max_abs_error']:.3g} against "
            f"the float32 reference exceeds {result['tolerance']} (bf16 "
            f"{'x'.join(map(str, result['shape']))}); rerun with {other}")
    logging.getLogger("generate_flax").info("kernel self-check %s: max error %.2e in %.3f s",
                                            attention, result["max_abs_error"],
                                            result["seconds"])
    return result


def add_host_flags(group) -> None:
    """The multi-host flags (one process per host), for jax.distributed.initialize."""
    group.add_argument("--coordinator_address", default=None,
                       help="HOST:PORT of process 0's coordinator, for "
                            "jax.distributed.initialize (default: found by JAX on Cloud TPU, "
                            "else one process)")
    group.add_argument("--num_processes", type=int,
                       help="hosts in all (default: found by JAX)")
    group.add_argument("--process_id", type=int,
                       help="this process, 0-based (default: found by JAX)")


def validate_distributed_flags(args) -> None:
    """--coordinator_address/--num_processes/--process_id: all three or none."""
    given = [args.coordinator_address is not None, args.num_processes is not None,
             args.process_id is not None]
    if any(given) and not all(given):
        fail("--coordinator_address/--num_processes/--process_id",
             f"{args.coordinator_address}/{args.num_processes}/{args.process_id}",
             "give all three or none (on Cloud TPU, none: JAX finds them)")
    if not any(given):
        return
    if args.num_processes < 1:
        fail("--num_processes", args.num_processes, "must be >= 1")
    if not 0 <= args.process_id < args.num_processes:
        fail("--process_id", args.process_id,
             f"must satisfy 0 <= id < --num_processes ({args.num_processes})")
    if not re.fullmatch(r"[\w.\-\[\]:]+:\d{1,5}", args.coordinator_address):
        fail("--coordinator_address", args.coordinator_address, "must be HOST:PORT")
    if args.dry_run:
        fail("--num_processes", args.num_processes, "--dry_run compiles for every host in "
             "one process; run it without the multi-host flags")
