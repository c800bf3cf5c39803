"""The prompt-embedding cache (``--embeddings_cache``): each TEXT's text-encoder output (a
prompt, or a negative prompt) as a safetensors file, keyed by everything that decides it, so
a repeated prompt, or the negative prompt every video shares, skips the text encoder, and a
run whose every video hits never reads the encoder from disk. The server keeps the recent
entries in memory too (``MemoryLRU``, bounded by bytes: ``--embedding_cache_bytes``).

The key is the sha256 of: the format; the family; a digest of the text encoders' files (the
folders the checkpoint's encode-only components read, and its tokenizer folders: every
file's relative path, size and modification time, so replaced weights miss; with them
HunyuanVideo-1.5's ByT5 and LTX-2's connectors); the text; the maximum sequence length; the
dtype. One text's embeddings never depend on the other text of its video: each family's
``encode_text`` encodes it alone, bitwise equal to that side of the pipeline's pair encode
(tests/test_embedding_cache.py). Entries of format 1 (keyed by the prompt PAIR) are a clean
miss. Files are written atomically (``engine.files.staging.save_tensors``); an unreadable
one is a warning and a miss, never a failed run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict

from engine.files.checkpoint import looks_local
from engine.files.staging import save_tensors
from engine.run import runtime
from engine.run.errors import first_line

log = logging.getLogger("generate_flax")

FORMAT = 2  # 2: one entry per text (1: per prompt pair, never read)


def encoder_components(family) -> tuple[str, ...]:
    """The pipeline components only the encode stage reads (the text encoders): those of
    stage "all" that neither the denoise nor the decode stage loads."""
    c = family.checkpoint.components
    later = set(c["denoise"]) | set(c["decode"])
    return tuple(name for name in c["all"] if name not in later)


def encoder_digest(model_id: str, family) -> str:
    """sha256 over the text encoders' and tokenizers' files under ``model_id``: relative
    path, size in bytes and modification time in ns of each, in sorted order."""
    folders = {f for c in encoder_components(family) for f in
               family.checkpoint.weight_folders[c]}
    folders |= {n for n in os.listdir(model_id) if n.startswith("tokenizer")}
    rows = []
    for folder in sorted(folders):
        for d, _, names in os.walk(os.path.join(model_id, folder)):
            for n in names:
                st = os.stat(os.path.join(d, n))
                rows.append(f"{os.path.relpath(os.path.join(d, n), model_id)}\0"
                            f"{st.st_size}\0{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(sorted(rows)).encode()).hexdigest()


class MemoryLRU:
    """An in-memory LRU of {name: tensor} entries bounded by their bytes (``numel *
    element_size`` summed over the tensors; dict and key overheads not counted).

    max_bytes: the budget (> 0). An entry larger than the budget is not kept; inserting
    past the budget evicts the least recently used entries (``get`` and ``put`` both mark
    an entry used) until the total fits. ``bytes``: the exact total held.
    """

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: OrderedDict[str, tuple[dict, int]] = OrderedDict()

    @staticmethod
    def size(tensors: dict) -> int:
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def get(self, key: str) -> dict | None:
        if key not in self.entries:
            return None
        self.entries.move_to_end(key)
        return self.entries[key][0]

    def put(self, key: str, tensors: dict) -> None:
        if key in self.entries:
            self.bytes -= self.entries.pop(key)[1]
        n = self.size(tensors)
        if n > self.max_bytes:
            return
        self.entries[key] = (tensors, n)
        self.bytes += n
        while self.bytes > self.max_bytes:
            self.bytes -= self.entries.popitem(last=False)[1][1]


class EmbeddingsCache:
    """The cache of one checkpoint's texts: a folder of safetensors files (None: none on
    disk) and an optional ``MemoryLRU`` in front of it (the server's).

    directory: the cache's folder (created on the first store) or None. family: the
    ``ModelFamily`` (its name keys the entries; ``text.prompt_sides`` says which texts a
    video holds). encoder: ``encoder_digest`` of the checkpoint. memory: a ``MemoryLRU``
    or None.
    """

    def __init__(self, directory: str | None, family, encoder: str,
                 memory: MemoryLRU | None = None):
        self.directory, self.family, self.encoder = directory, family, encoder
        self.memory = memory

    def key_parts(self, config, text: str) -> dict:
        """What decides one text's embeddings under ``config``'s settings; with a ``--lora``
        that touches a host component (``engine.weights.lora.Lora.host``: a text connector),
        its files' sha256 and scales too (absent otherwise, so earlier keys stay valid)."""
        parts = dict(format=FORMAT, family=self.family.name, text_encoder=self.encoder,
                     text=text, max_sequence_length=config.video.max_sequence_length,
                     dtype=config.model.dtype)
        host = [[x.sha256, x.scale] for x in config.model.lora or () if x.host]
        if host:
            parts["host_loras"] = host
        return parts

    def digest(self, config, text: str) -> str:
        return hashlib.sha256(json.dumps(self.key_parts(config, text), sort_keys=True)
                              .encode()).hexdigest()

    def path(self, config, text: str) -> str:
        return os.path.join(self.directory, f"{self.digest(config, text)}.safetensors")

    def load(self, config, text: str) -> dict | None:
        """{name: CPU tensor} of ``text`` (unprefixed names, ``family.text.encode_text``'s),
        from memory or disk, or None on a miss (a damaged file is a warning and a miss)."""
        key = self.digest(config, text)
        got = self.memory.get(key) if self.memory is not None else None
        if got is None and self.directory is not None:
            got = self._read(self.path(config, text), self.key_parts(config, text))
            if got is not None and self.memory is not None:
                self.memory.put(key, got)
        return got

    def _read(self, path: str, parts: dict) -> dict | None:
        from safetensors import safe_open

        if not os.path.isfile(path):
            return None
        try:
            with safe_open(path, framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("key", "null"))
                if meta != parts:
                    raise ValueError("its recorded key differs")
                return {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises several types
            log.warning("embeddings cache: %s unreadable (%s); encoding the text", path,
                        first_line(e))
            return None

    def load_video(self, config) -> dict | None:
        """One video's embeddings (every side of ``family.text.prompt_sides``, names
        prefixed) when each of its texts is cached, else None."""
        out = {}
        for prefix, text in self.family.text.prompt_sides(config):
            got = self.load(config, text)
            if got is None:
                return None
            out.update({prefix + k: v for k, v in got.items()})
        return out

    def store(self, config, text: str, embeds: dict) -> None:
        """Keep ``text``'s ``embeds`` in memory and write them (process 0 only: every host
        encodes the same prompts); a failed write (full disk...) is a warning."""
        if self.memory is not None:
            self.memory.put(self.digest(config, text), embeds)
        if self.directory is None or not runtime.is_writer():
            return
        path = self.path(config, text)
        try:
            os.makedirs(self.directory, exist_ok=True)
            save_tensors(embeds, path, {"key": self.key_parts(config, text)})
        except Exception as e:  # noqa: BLE001 - a cache write must never fail a run
            log.warning("embeddings cache: could not store %s (%s)", path, first_line(e))


def open_cache(config, family, memory_bytes: int = 0) -> EmbeddingsCache | None:
    """The run's cache, or None when there is neither a folder nor memory: no folder when
    ``--embeddings_cache`` is "none", the stage is not ``all``, or ``--model_id`` is a Hub
    id (its files are not on disk to digest, so nothing is cached then). ``memory_bytes``:
    the in-memory LRU's budget (the server's ``--embedding_cache_bytes``; 0: none)."""
    directory = config.run.embeddings_cache
    model_id = config.model.model_id
    if config.run.stage != "all" or not looks_local(model_id) or not os.path.isdir(model_id):
        return None
    if directory.lower() == "none":
        if memory_bytes <= 0:
            return None
        directory = None
    memory = MemoryLRU(memory_bytes) if memory_bytes > 0 else None
    return EmbeddingsCache(directory, family, encoder_digest(model_id, family), memory)
