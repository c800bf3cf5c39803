"""Checkpoint integrity before anything loads: safetensors headers and file sizes against
the models the configs build.

A 14B checkpoint is 70 GB (114 GB for Wan 2.2 A14B); interrupted copies and mixed-up folders
are the commonest real-weight failures, and unchecked they surface minutes in, as a
safetensors or JAX traceback. This reads only each file's 8-byte header length, its JSON
header and its size, and builds each model from its ``config.json`` with meta weights, so it
takes seconds even for 114 GB (docs/models.md, "Checkpoint check"). For every component the stage
loads and every file an index names it checks:

* the header parses (and ``safetensors.safe_open`` accepts the file);
* every tensor's byte range lies inside the file, so a truncated file is caught by its size;
* an index file's ``weight_map`` names only files that exist, and tensors those files hold;
* every tensor the model built from ``config.json`` expects is present with its shape.
  Unexpected tensors beyond what the library itself ignores give a warning; dtypes may
  differ (``from_pretrained`` casts).

Which tensors a model expects follows its library's own loading rules: diffusers
(``ModelMixin._load_pretrained_model``: state-dict names, ``_keys_to_ignore_on_load_unexpected``)
and transformers 5 (``convert_and_load_state_dict_in_model``: its key renamings and
``base_model_prefix``, tied weights, ``_keys_to_ignore_on_load_missing`` /
``_keys_to_ignore_on_load_unexpected``). Unlike the libraries, a missing tensor is refused:
both would start the model with random weights for it. Tokenizers hold no safetensors and
are not checked.
"""

from __future__ import annotations

import glob
import importlib
import json
import logging
import math
import os
import re
import struct
import time

from engine.files.checkpoint import looks_local, model_config_dir, read_model_index
from engine.run.errors import UsageError, first_line

log = logging.getLogger(__name__)

# Bytes per element of each safetensors dtype (the format's own list).
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
               "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4,
               "I64": 8, "U64": 8, "F64": 8, "C64": 8}
SHOWN = 3  # missing / mismatched / unexpected tensors named in one line


class CheckpointError(UsageError):
    """A checkpoint file or config breaks a rule (one line: component, file, rule)."""


def read_header(path: str) -> dict:
    """The tensors of one safetensors file, checked against its size.

    Reads the 8-byte little-endian header length and the JSON header only.

    Returns:
        {name: (dtype, shape tuple)}.

    Raises:
        CheckpointError: the header does not parse, or a tensor's bytes lie past the end
            of the file (a truncated copy) or disagree with its dtype and shape.
    """
    name = os.path.basename(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{name}: {size} bytes, shorter than the 8-byte header "
                                  "length (truncated or empty)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{name}: truncated: the header says it is {n} bytes but "
                                  f"the file holds {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise CheckpointError(f"{name}: the JSON header does not parse ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{name}: the JSON header is not an object")
    data = size - 8 - n
    out, end = {}, 0
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = entry["dtype"], tuple(entry["shape"]), \
                entry["data_offsets"]
            want = math.prod(shape) * DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{name}: tensor {key!r} has a malformed header entry "
                                  f"{entry!r}") from None
        if stop > data:
            raise CheckpointError(
                f"{name}: truncated: tensor {key!r} ends at byte {stop} of the data but the "
                f"file holds {max(data, 0)} data bytes ({size} in all); copy or download it "
                "again")
        if not 0 <= begin <= stop or stop - begin != want:
            raise CheckpointError(f"{name}: tensor {key!r} spans bytes [{begin}, {stop}), "
                                  f"not the {want} its {dtype} {list(shape)} needs")
        out[key] = (dtype, shape)
        end = max(end, stop)
    if end != data:
        raise CheckpointError(f"{name}: the header covers {end} data bytes but the file holds "
                              f"{data}; copy or download it again")
    try:  # safetensors' own validation (overlaps, gaps): reads the header only (mmap)
        from safetensors import safe_open

        with safe_open(path, framework="pt"):
            pass
    except Exception as e:
        raise CheckpointError(f"{name}: safetensors rejects it ({first_line(e)})") from None
    return out


def read_folder(folder: str) -> tuple[dict, list[str]]:
    """Every tensor of a component folder: ({name: (dtype, shape)}, {name: its file}, the
    name of the index file or of the one weights file, for messages).

    With a ``*.safetensors.index.json`` its ``weight_map`` decides (the files it names must
    exist and hold the tensors it places there); otherwise every ``*.safetensors`` file.

    Raises:
        CheckpointError: no weights, an unreadable index, a file it names is missing, or
            any file breaks ``read_header``'s rules.
    """
    index = sorted(glob.glob(os.path.join(folder, "*.safetensors.index.json")))
    if index:
        iname = os.path.basename(index[0])
        try:
            with open(index[0]) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{iname}: unreadable index ({first_line(e)})") from None
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if missing:
            raise CheckpointError(f"{iname}: its weight_map names {len(missing)} file(s) that "
                                  f"do not exist: {', '.join(missing[:SHOWN])}")
    else:
        files = sorted(os.path.basename(p)
                       for p in glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise CheckpointError("*.safetensors: none in the folder (no weights)")
        weight_map = None
    tensors, where = {}, {}
    for file in files:
        for key, value in read_header(os.path.join(folder, file)).items():
            tensors[key], where[key] = value, file
    if weight_map is not None:
        wrong = [k for k, f in weight_map.items() if where.get(k) != f]
        if wrong:
            k = wrong[0]
            raise CheckpointError(f"{iname}: its weight_map places {len(wrong)} tensor(s) in "
                                  f"files whose headers lack them, e.g. {k!r} in "
                                  f"{weight_map[k]}")
    return tensors, where, iname if weight_map is not None else (
        files[0] if len(files) == 1 else "*.safetensors")


def _library_module(library: str):
    """The module ``from_pretrained`` takes a component class from: a library ("diffusers",
    "transformers"), or a diffusers pipeline folder's own module ("ltx2" ->
    ``diffusers.pipelines.ltx2``), as diffusers' ``load_sub_model`` resolves it."""
    try:
        return importlib.import_module(library)
    except ImportError:
        return importlib.import_module(f"diffusers.pipelines.{library}")


def build_empty(library: str, class_name: str, folder: str):
    """The model ``from_pretrained`` would build from ``folder/config.json``, with meta
    weights (no RAM for them).

    Raises:
        CheckpointError: the config does not parse, or the model does not build from it.
    """
    from accelerate import init_empty_weights

    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            json.load(f)
    except OSError as e:
        raise CheckpointError(f"config.json: unreadable ({e.strerror or e})") from None
    except ValueError as e:
        raise CheckpointError(f"config.json: does not parse ({e})") from None
    try:
        cls = getattr(_library_module(library), class_name)
    except (ImportError, AttributeError):
        raise CheckpointError(f"model_index.json: class {library}.{class_name} not found") \
            from None
    try:
        with init_empty_weights():
            if library == "transformers":
                return cls._from_config(cls.config_class.from_pretrained(folder))
            return cls.from_config(cls.load_config(folder))
    except Exception as e:  # a config the model cannot be built from: any error type
        raise CheckpointError(f"config.json: {class_name} does not build from it "
                              f"({type(e).__name__}: {first_line(e, 200)})") from None


def compare(model, library: str, tensors: dict) -> tuple[list, list, list]:
    """(missing names, mismatched (name, expected shape, file shape), unexpected names)
    of checkpoint ``tensors`` ({name: (dtype, shape)}) against ``model`` (meta weights), by
    the rules its library loads with (module docstring)."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found, reshaped = {}, set()  # model name -> shape; names a converter fuses or splits
    if library == "transformers":
        ignore_missing = list(model._keys_to_ignore_on_load_missing or ())
        ignore_unexpected = list(model._keys_to_ignore_on_load_unexpected or ())
        # transformers' _adjust_missing_and_unexpected_keys drops these for every model.
        if any(n.endswith("rotary_emb.inv_freq") for n, _ in model.named_buffers()):
            ignore_unexpected.append(r"rotary_emb\.inv_freq")
        if any(n.endswith("position_ids") for n, _ in model.named_buffers()):
            ignore_unexpected.append(r"(^|\.)position_ids$")
        unexpected = _transformers_names(model, tensors, expected, found, reshaped)
        for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
            if target in found or source in found:  # tie_weights fills either from the other
                found.setdefault(target, expected.get(target))
                found.setdefault(source, expected.get(source))
    else:
        ignore_missing = []
        ignore_unexpected = list(type(model)._keys_to_ignore_on_load_unexpected or ())
        found = {k: s for k, (_, s) in tensors.items() if k in expected}
        unexpected = [k for k in tensors if k not in expected]
    missing = sorted(k for k in expected if k not in found
                     and not any(re.search(p, k) for p in ignore_missing))
    mismatched = sorted((k, expected[k], found[k]) for k in expected
                        if k in found and k not in reshaped and found[k] is not None
                        and found[k] != expected[k])
    unexpected = sorted(k for k in unexpected
                        if not any(re.search(p, k) for p in ignore_unexpected))
    return missing, mismatched, unexpected


def _transformers_names(model, tensors: dict, expected: dict, found: dict,
                        reshaped: set) -> list:
    """Map checkpoint names to model names as transformers 5 loads them (its renamings,
    converters and ``base_model_prefix``); fills ``found`` and ``reshaped``, returns the
    names that map to nothing."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    mapping = get_model_conversion_mapping(model) or []
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    prefix, unexpected = model.base_model_prefix, []
    for key, (_, shape) in tensors.items():
        name, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if name not in expected and key in expected:  # as convert_and_load_state_dict...
            name, pattern = rename_source_key(key, [], [], prefix, expected)
        if name not in expected:
            unexpected.append(key)
        elif pattern is not None:  # fused or split on load: its file shape differs
            found[name] = expected[name]
            reshaped.add(name)
        else:
            found[name] = shape
    return unexpected


def _fmt(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def check_component(folder: str, library: str, class_name: str, *,
                    weights: bool = True) -> dict:
    """Check one component folder (``weights=False``: its config only, as a dry run does).

    Returns:
        dict(cls, files, tensors, unexpected=[names]) (files and tensors None without
        ``weights``).

    Raises:
        CheckpointError: the first rule broken (module docstring), without the component
            prefix.
    """
    model = build_empty(library, class_name, folder)
    if not weights:
        return dict(cls=class_name, files=None, tensors=None, unexpected=[])
    tensors, where, name = read_folder(folder)
    missing, mismatched, unexpected = compare(model, library, tensors)
    if mismatched and not missing:
        name = where.get(mismatched[0][0], name)
    if missing or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) {class_name} expects are missing: "
                         + ", ".join(missing[:SHOWN]) + (", ..." if len(missing) > SHOWN
                                                         else ""))
        if mismatched:
            parts.append(f"{len(mismatched)} tensor(s) have the wrong shape for config.json: "
                         + ", ".join(f"{k} {_fmt(got)}, expected {_fmt(want)}"
                                     for k, want, got in mismatched[:SHOWN])
                         + (", ..." if len(mismatched) > SHOWN else ""))
        raise CheckpointError(f"{name}: does not match config.json: " + "; ".join(parts))
    return dict(cls=class_name, files=len(set(where.values())), tensors=len(tensors),
                unexpected=unexpected)


def components_to_check(family, stage: str, dry_run: bool) -> tuple[str, ...]:
    """Checkpoint subfolders the run reads: the stage's components' weight folders, or, for
    a dry run, the configs it reads (transformer and VAE)."""
    checkpoint = family.checkpoint
    if dry_run:
        return ("transformer", "vae") + tuple(f for f in checkpoint.optional_folders
                                              if f in checkpoint.weight_folders["transformer"])
    return tuple(f for c in checkpoint.components[stage] for f in checkpoint.weight_folders[c])


def check_checkpoint(config, family) -> dict:
    """Check every component ``config.run.stage`` loads (configs only for ``--dry_run``)
    before any model loads; logs one warning per component with unexpected tensors.

    Returns:
        the report's ``checkpoint_check`` entry: dict(ran, seconds, weights, components=
        {subfolder: dict(cls, files, tensors, unexpected)}), or dict(ran=False, reason)
        for a Hub id (its files download when the pipeline loads).

    Raises:
        UsageError: one line, ``--model_id='...': <subfolder>/<file>: <rule>`` (exit 2).
    """
    t0 = time.perf_counter()
    root = model_config_dir(config.model.model_id) if config.dry.dry_run else config.model.model_id
    if root is None or not looks_local(root):
        return dict(ran=False, reason="Hub id: its files download when the pipeline loads")
    index = read_model_index(config.model.model_id)
    out = {}
    for sub in components_to_check(family, config.run.stage, config.dry.dry_run):
        spec = index.get(sub)
        if sub in family.checkpoint.optional_folders and not (isinstance(spec, list) and all(spec)):
            continue  # e.g. Wan's transformer_2: [null, null] unless the model has two experts
        if not (isinstance(spec, list) and len(spec) == 2 and all(spec)):
            raise UsageError(f"--model_id={config.model.model_id!r}: model_index.json: no "
                             f"[library, class] for {sub!r}")
        try:
            out[sub] = check_component(os.path.join(root, sub), *spec,
                                       weights=not config.dry.dry_run)
        except CheckpointError as e:
            raise CheckpointError(f"--model_id={config.model.model_id!r}: {sub}/{e}") from None
        extra = out[sub]["unexpected"]
        if extra:
            log.warning("%s: %d tensor(s) in the checkpoint that %s does not use, ignored as "
                        "from_pretrained ignores them: %s", sub, len(extra), spec[1],
                        ", ".join(extra[:SHOWN]) + (", ..." if len(extra) > SHOWN else ""))
    return dict(ran=True, weights=not config.dry.dry_run, seconds=time.perf_counter() - t0,
                components=out)
