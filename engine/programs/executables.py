"""The executable cache: compiled programs kept on disk beside JAX's persistent compilation
cache, so that a warm process neither traces, lowers nor compiles them.

JAX's own cache is keyed by the lowered program, so a warm process still traces the torch
model through torchax and lowers it (seconds to minutes for a 14B step) before it can look.
This cache is keyed by what decides the program instead, known before tracing:

- the entry (its file name): the program's name, its input signature (pytree structure,
  shapes, dtypes, shardings), the devices in mesh order and any extra static part (the VAE
  chunk's cache kinds);
- the header's parts, compared on read so a miss can name its reason: a digest of our
  sources that shape programs (``engine``, ``families``, ``splash``,
  ``custom_splash_attention.py``), the versions of jax, jaxlib, libtpu, torch, torchax and
  diffusers, the compiler's flags (``XLA_FLAGS``, ``LIBTPU_INIT_ARGS``), the platform,
  device kind and count, and the run's program-shaping settings (block sizes, attention
  backend, step cache, dtype, model configs...; the caller's dict).

An entry is two files, ``<entry>.bin`` (``jax.experimental.serialize_executable``'s payload)
then ``<entry>.json`` (the header, with the payload's size and sha256), each written to a
temporary name and renamed. A missing, truncated, corrupt, stale or mismatched entry is one
warning naming the reason, then a normal compile that replaces it; never a crash, never a
wrong executable. The key sees source files on disk, not code patched at run time.

Only a fresh compile is stored: a program to be stored is compiled past JAX's persistent
compilation cache, since an executable that cache hands back runs but, on XLA:CPU, serialises
without its code (``_compile`` says more). And a loaded program's first call is checked: one
the runtime rejects is evicted, recompiled and logged as a miss, once, and the run goes on
(``Checked``).

Trust: the payload is JAX's own pickle-based format; loading one runs code, so the cache
directory must be as trusted as the code itself (it lives in the user's cache folder). As
ssh does with its keys, an entry is loaded only when its payload and the folder are owned by
this user and writable by no one else (entries are written 0600 in a 0700 folder); any other
is a miss naming the reason, then a compile.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata as md
import json
import logging
import os
import threading
import time
from collections.abc import Callable

import jax
from jax.experimental import serialize_executable
from jax.experimental.compilation_cache import compilation_cache

from engine.run.errors import first_line

log = logging.getLogger("generate_flax")

FORMAT = 1
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE_GLOBS = (("engine", ".py"), ("families", ".py"), ("splash", ".py"))
SOURCE_FILES = ("custom_splash_attention.py",)
VERSIONED = ("jax", "jaxlib", "libtpu", "torch", "torchax", "diffusers")

# This process's programs: how many were compiled and loaded, and the seconds spent lowering
# (tracing included), compiling and loading; the report takes differences of snapshots.
# Updated under _STATS_LOCK: a background compile (engine.pipeline.ahead) adds to it too.
STATS = {"compiled": 0, "loaded": 0, "lower_s": 0.0, "compile_s": 0.0, "load_s": 0.0}
_STATS_LOCK = threading.Lock()
# (program, "loaded" | "compiled", reason or None) per program, in order.
EVENTS: list[tuple[str, str, str | None]] = []


@dataclasses.dataclass(frozen=True)
class Cache:
    """An open cache: its folder, the devices programs run on (mesh order) and the header
    parts every entry of the run must match."""

    directory: str
    devices: tuple
    parts: dict


class _Active(threading.local):
    """Each thread's stack of open caches: a background compile opens its own."""

    def __init__(self):
        self.stack: list[Cache] = []


_ACTIVE = _Active()


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 of every source file that shapes a program: relative paths and contents, in
    sorted order (read once per process)."""
    paths = [os.path.join(ROOT, f) for f in SOURCE_FILES]
    for folder, ext in SOURCE_GLOBS:
        for d, _, names in os.walk(os.path.join(ROOT, folder)):
            paths += [os.path.join(d, n) for n in names if n.endswith(ext)]
    h = hashlib.sha256()
    for path in sorted(p for p in paths if os.path.isfile(p)):
        h.update(os.path.relpath(path, ROOT).encode() + b"\0")
        with open(path, "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()


def versions() -> dict:
    """{package: version or None} of the libraries that build or run programs."""
    out = {}
    for pkg in VERSIONED:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def compiler_flags(env=os.environ, platform: str | None = None) -> list[str]:
    """The compiler's flags that can change ``platform``'s code, sorted: ``XLA_FLAGS`` (its
    ``--xla_gpu_*`` ones only on a GPU) and, on a TPU, ``LIBTPU_INIT_ARGS``; never the dump
    flags (``--xla_dump*``, ``--xla_jf_dump*``: they write files, not code; the dry run's
    estimate sets them, and its exported programs must match a run's key). ``platform``
    None keeps every flag.

    Part of every entry's key: a program compiled under other flags is other code (on an
    H200, ``--xla_gpu_enable_triton_gemm=false`` changes every GEMM's kernel; before this
    was keyed, a run with that flag loaded the Triton build and its frames and s/step were
    the first run's, 2026-11-27). ``--quantize fp8`` sets that flag on every platform
    (``engine.weights.quantize.prefer_cublas_fp8``), so a TPU's key must not see it: a
    dry run's exported fp8 programs would never match."""
    tokens = env.get("XLA_FLAGS", "").split()
    if platform in (None, "tpu"):
        tokens += env.get("LIBTPU_INIT_ARGS", "").split()
    gpu = platform in (None, "gpu", "cuda", "rocm")
    return sorted(t for t in tokens if "_dump" not in t.split("=")[0]
                  and (gpu or not t.startswith("--xla_gpu")))


def run_parts(settings: dict, devices) -> dict:
    """The header parts every entry of a run shares (JSON values)."""
    return dict(source=source_digest(), versions=versions(),
                compiler_flags=compiler_flags(platform=devices[0].platform),
                platform=devices[0].platform, device_kind=devices[0].device_kind,
                device_count=len(devices), processes=jax.process_count(),
                settings=json.loads(json.dumps(settings, sort_keys=True, default=str)))


@contextlib.contextmanager
def caching(directory: str | None, settings: dict, mesh):
    """Within the block, ``compile_program`` uses the cache in ``directory`` (None or "none":
    off) for programs on ``mesh``; ``settings`` are the run's program-shaping settings.
    Off in a multi-process run: each process would need its own entries."""
    if directory is None or directory.lower() == "none" or jax.process_count() > 1:
        yield None
        return
    os.makedirs(directory, mode=0o700, exist_ok=True)
    devices = tuple(mesh.devices.flat)
    _ACTIVE.stack.append(Cache(directory, devices, run_parts(settings, devices)))
    try:
        yield _ACTIVE.stack[-1]
    finally:
        _ACTIVE.stack.pop()


def signature(args, extra=None) -> dict:
    """The input signature of ``args`` (a tuple of positional arguments): the pytree
    structure and each leaf's shape, dtype and sharding; ``extra``: static parts (JSON)."""
    leaves, tree = jax.tree.flatten((tuple(args), {}))
    return dict(tree=str(tree), extra=json.loads(json.dumps(extra, default=str)),
                leaves=[[list(x.shape), str(x.dtype), repr(getattr(x, "sharding", None))]
                        for x in leaves])


def compile_program(name: str, lower: Callable, args: tuple, *, extra=None,
                    meta: Callable | None = None):
    """The compiled program ``lower()`` (a ``jax.stages.Lowered`` of ``args``) gives: loaded
    from the active cache when an entry matches, else lowered and compiled (and stored).

    Args:
        name: the program's name ("transformer_step", "vae_decode_chunk", ...).
        lower: ``() -> jax.stages.Lowered``; not called on a hit (no tracing).
        args: the positional arguments it is lowered and called with (arrays or
            ``ShapeDtypeStruct``s), for the input signature.
        extra: JSON-able static parts of the program the signature cannot see.
        meta: ``() -> JSON-able``, called after lowering, stored with the entry (what the
            caller learns while tracing, e.g. the VAE chunk's output cache kinds).

    Returns:
        (``jax.stages.Compiled``, the meta value: stored on a hit, ``meta()`` on a compile,
        None without ``meta``). A loaded program comes as a ``Checked`` (the same calls and
        attributes), whose first call is checked (see ``Checked``).
    """
    cache = _ACTIVE.stack[-1] if _ACTIVE.stack else None
    entry = sig = None
    if cache is not None:
        sig = dict(program=name, signature=signature(args, extra),
                   devices=[d.id for d in cache.devices])
        entry = os.path.join(cache.directory, hashlib.sha256(
            json.dumps(sig, sort_keys=True).encode()).hexdigest()[:40])
        loaded, reason = _load(entry, cache, args)
        if loaded is not None:
            EVENTS.append((name, "loaded", None))
            redo = functools.partial(_compile, name, lower, meta, cache, entry, sig)
            return Checked(loaded[0], name, entry, redo), loaded[1]
        if reason is not None:
            log.warning("executable cache: %s: %s; compiling", name, reason)
    return _compile(name, lower, meta, cache, entry, sig)


def _compile(name: str, lower: Callable, meta, cache: Cache | None, entry: str | None,
             sig: dict | None, reason: str | None = None):
    """Lower and compile (tracing included), count it, and store it in ``cache`` under
    ``entry`` when one is open; returns (compiled, ``meta()`` or None).

    A program to be stored is compiled past JAX's persistent compilation cache
    (``_fresh_compiles``): an executable that cache hands back is fit to run, not to be
    serialised again. XLA:CPU deserialises a cached executable without the object code of
    its fused functions, and ``serialize_executable.serialize`` of it then writes a payload
    that loads but cannot run ("Function select_compare_fusion not found" at the first
    dispatch; a toy program's payload shrank from 20,961 to 12,478 bytes; jax 0.10.2,
    2026-12-02). Skipping JAX's cache costs nothing the executable cache does not repay:
    the next run loads the stored program without tracing or compiling."""
    t0 = time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    with _fresh_compiles() if entry is not None else contextlib.nullcontext():
        hits = _jax_cache_hits()
        compiled = lowered.compile()
        served = _jax_cache_hits() > hits
    t2 = time.perf_counter()
    _count(compiled=1, lower_s=t1 - t0, compile_s=t2 - t1)
    value = meta() if meta is not None else None
    stored = entry is not None and not served
    EVENTS.append((name, "compiled", reason or ("stored" if stored else None)))
    if stored:
        _store(entry, cache, compiled, value, sig)
    elif entry is not None:  # another thread turned JAX's cache back on mid-compile
        log.warning("executable cache: %s: not stored (JAX's compilation cache served it, "
                    "and such an executable cannot be serialised again)", name)
    return compiled, value


class _Hits(threading.local):
    n = 0


_HITS = _Hits()
_BYPASS = dict(depth=0, toggled=False)
_BYPASS_LOCK = threading.Lock()


def _count_hit(event: str, **_) -> None:
    # jax.monitoring calls listeners synchronously in the compiling thread
    # (jax/_src/compiler.py: compile_or_get_cached), so a thread-local count is this
    # thread's compiles' alone.
    if event == "/jax/compilation_cache/cache_hits":
        _HITS.n += 1


@functools.lru_cache(maxsize=1)
def _listening() -> bool:
    jax.monitoring.register_event_listener(_count_hit)
    return True


def _jax_cache_hits() -> int:
    """This thread's count of programs JAX's persistent cache has served."""
    _listening()
    return _HITS.n


@contextlib.contextmanager
def _fresh_compiles():
    """Within the block, JAX's persistent compilation cache is off (neither read nor
    written), for every thread: JAX reads its setting once and keeps it process-wide
    (``compilation_cache.is_cache_used``), so it is turned off and reset, then on and reset
    (``compilation_cache.reset_cache``, as ``engine.run.runtime.enable_compilation_cache``
    does). Blocks may nest and overlap across threads (a background compile,
    ``engine.pipeline.ahead``): the first to enter turns it off, the last to leave back on.
    Another thread's compile meanwhile compiles instead of reading the cache."""
    with _BYPASS_LOCK:
        if _BYPASS["depth"] == 0:
            _BYPASS["toggled"] = (jax.config.jax_enable_compilation_cache
                                  and jax.config.jax_compilation_cache_dir is not None)
            if _BYPASS["toggled"]:
                jax.config.update("jax_enable_compilation_cache", False)
                compilation_cache.reset_cache()
        _BYPASS["depth"] += 1
    try:
        yield
    finally:
        with _BYPASS_LOCK:
            _BYPASS["depth"] -= 1
            if _BYPASS["depth"] == 0 and _BYPASS["toggled"]:
                jax.config.update("jax_enable_compilation_cache", True)
                compilation_cache.reset_cache()


class Checked:
    """A program loaded from the cache whose first call is checked: it is run to completion
    (``jax.block_until_ready``); if the runtime rejects it (``JaxRuntimeError``: an entry
    that loads but cannot run, e.g. one written before ``_compile`` skipped JAX's cache),
    the entry is evicted, the program recompiled (and stored again), one warning names the
    reason, and the call is answered by the new program, once. Later calls go straight to
    the program: one attribute test each. Other attributes (``memory_analysis``...) are the
    program's."""

    def __init__(self, compiled, name: str, entry: str, redo: Callable):
        self.compiled, self._name, self._entry, self._redo = compiled, name, entry, redo

    def __call__(self, *args, **kwargs):
        if self._redo is None:
            return self.compiled(*args, **kwargs)
        try:
            out = jax.block_until_ready(self.compiled(*args, **kwargs))
        except jax.errors.JaxRuntimeError as e:
            reason = f"loaded program failed at its first call ({first_line(e)})"
            log.warning("executable cache: %s: %s; evicted, compiling", self._name, reason)
            for suffix in (".json", ".bin"):  # the header first: no reader sees half an entry
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self._entry + suffix)
            _count(loaded=-1)
            self.compiled, _ = self._redo(reason=reason)
            out = self.compiled(*args, **kwargs)
        self._redo = None  # drops the lowering closure (and what it holds)
        return out

    def __getattr__(self, attr):
        if attr == "compiled":  # not yet set: no recursion
            raise AttributeError(attr)
        return getattr(self.compiled, attr)


def _load(entry: str, cache: Cache, args):
    """((compiled, meta), None) from a matching entry, else (None, the reason for the miss;
    None when there is no entry at all)."""
    t0 = time.perf_counter()
    if not os.path.exists(entry + ".json"):
        return None, None
    try:
        with open(entry + ".json") as f:
            header = json.load(f)
        if not isinstance(header, dict):
            raise ValueError("not an object")
    except (OSError, ValueError) as e:
        return None, f"unreadable header ({first_line(e)})"
    reason = _mismatch(header, cache.parts)
    if reason is not None:
        return None, reason
    untrusted = _untrusted(entry + ".bin") or _untrusted(cache.directory)
    if untrusted is not None:
        return None, untrusted
    try:
        with open(entry + ".bin", "rb") as f:
            payload = f.read()
    except OSError as e:
        return None, f"payload unreadable ({first_line(e)})"
    if len(payload) != header.get("payload_bytes"):
        return None, (f"truncated payload ({len(payload)} of {header.get('payload_bytes')} "
                      "bytes)")
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        return None, "corrupt payload (sha256 differs)"
    try:
        out_tree = jax.tree_util.PyTreeDef.deserialize_using_proto(
            jax.tree_util.default_registry, base64.b64decode(header["out_tree"]))
        in_tree = jax.tree.structure((tuple(args), {}))
        compiled = serialize_executable.deserialize_and_load(
            payload, in_tree, out_tree, backend=cache.devices[0].client,
            execution_devices=list(cache.devices))
    except Exception as e:  # noqa: BLE001 - any failure to load is a miss, then a compile
        return None, f"could not load ({type(e).__name__}: {first_line(e)})"
    _count(loaded=1, load_s=time.perf_counter() - t0)
    return (compiled, header.get("meta")), None


def _untrusted(path: str) -> str | None:
    """Why ``path`` may not be loaded (another owner, or writable by group or others), or
    None. A payload is code (pickle), so only this user may have written it."""
    try:
        st = os.stat(path)
    except OSError as e:
        return f"payload unreadable ({first_line(e)})"
    if st.st_uid != os.getuid():
        return f"untrusted: {os.path.basename(path)} is owned by uid {st.st_uid}, not this user"
    if st.st_mode & 0o022:
        return (f"untrusted: {os.path.basename(path)} is writable by group or others "
                f"(mode {st.st_mode & 0o777:o})")
    return None


def _mismatch(header: dict, parts: dict) -> str | None:
    """The first header part that differs from this run's, named; None when all match."""
    if header.get("format") != FORMAT:
        return f"format {header.get('format')} (expected {FORMAT})"
    stored = header.get("parts") or {}
    if stored.get("source") != parts["source"]:
        return "stale: the program sources changed (source digest differs)"
    old, new = stored.get("versions") or {}, parts["versions"]
    changed = [f"{k} {old.get(k)} -> {new[k]}" for k in new if old.get(k) != new[k]]
    if changed:
        return f"version mismatch ({', '.join(changed)})"
    if stored.get("compiler_flags") != parts["compiler_flags"]:
        return (f"compiler flags changed ({' '.join(stored.get('compiler_flags') or []) or 'none'}"
                f" -> {' '.join(parts['compiler_flags']) or 'none'})")
    for key in ("platform", "device_kind", "device_count", "processes"):
        if stored.get(key) != parts[key]:
            return f"{key} mismatch ({stored.get(key)} -> {parts[key]})"
    old, new = stored.get("settings") or {}, parts["settings"]
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if changed:
        return f"settings changed ({', '.join(changed)})"
    return None


def _store(entry: str, cache: Cache, compiled, meta, key: dict) -> None:
    """Write the entry: payload then header (with ``key``, what the entry's name hashes, for
    whoever must find why a run missed it), each atomically; a program that cannot be
    serialized (or a full disk) is a warning, the run goes on."""
    try:
        payload, _, out_tree = serialize_executable.serialize(compiled)
        header = dict(format=FORMAT, parts=cache.parts, meta=meta, key=key,
                      payload_bytes=len(payload),
                      payload_sha256=hashlib.sha256(payload).hexdigest(),
                      out_tree=base64.b64encode(out_tree.serialize_using_proto()).decode())
        _atomic(entry + ".bin", payload)
        _atomic(entry + ".json", json.dumps(header, sort_keys=True).encode())
    except Exception as e:  # noqa: BLE001 - a cache write must never fail a run
        log.warning("executable cache: could not store %s (%s: %s)", os.path.basename(entry),
                    type(e).__name__, first_line(e))


def _atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.partial"
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _count(**added) -> None:
    with _STATS_LOCK:
        for k, v in added.items():
            STATS[k] += v


def stats_snapshot() -> dict:
    """A consistent copy of ``STATS`` (for ``stats_since``)."""
    with _STATS_LOCK:
        return dict(STATS)


def stats_since(before: dict) -> dict:
    """``STATS`` minus the snapshot ``before``: programs compiled and loaded meanwhile, and
    their lower / compile / load seconds."""
    now = stats_snapshot()
    return {k: now[k] - before[k] for k in now}
