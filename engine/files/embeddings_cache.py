"""The prompt-embedding cache (``--embeddings_cache``): each video's text-encoder output as
a safetensors file, keyed by everything that decides it, so a repeated prompt skips the text
encoder, and a run whose every video hits never reads the encoder from disk.

The key is the sha256 of: the family; a digest of the text encoders' files (the folders
the checkpoint's encode-only components read, and its tokenizer folders: every file's
relative path, size and modification time, so replaced weights miss); the prompt; the
negative prompt; whether the negative side exists (CFG); the maximum sequence length; the
dtype. Files are written atomically (``engine.files.staging.save_tensors``); an unreadable
one is a warning and a miss, never a failed run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

from engine.files.checkpoint import looks_local
from engine.files.staging import save_tensors
from engine.run import runtime
from engine.run.errors import first_line

log = logging.getLogger("generate_flax")

FORMAT = 1


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


class EmbeddingsCache:
    """The cache folder of one run's checkpoint.

    directory: the cache's folder (created on the first store).
    family_name: the ``ModelFamily``'s name; encoder: ``encoder_digest`` of the checkpoint.
    """

    def __init__(self, directory: str, family_name: str, encoder: str):
        self.directory, self.family_name, self.encoder = directory, family_name, encoder

    def key_parts(self, config) -> dict:
        """What decides one video's embeddings under ``config`` (its prompt and settings)."""
        v = config.video
        return dict(format=FORMAT, family=self.family_name, text_encoder=self.encoder,
                    prompt=v.prompt, negative_prompt=v.negative_prompt, cfg=v.use_cfg,
                    max_sequence_length=v.max_sequence_length, dtype=config.model.dtype)

    def path(self, config) -> str:
        digest = hashlib.sha256(json.dumps(self.key_parts(config), sort_keys=True)
                                .encode()).hexdigest()
        return os.path.join(self.directory, f"{digest}.safetensors")

    def load(self, config) -> dict | None:
        """{name: CPU tensor} stored for ``config``, or None on a miss (a damaged file is a
        warning and a miss)."""
        from safetensors import safe_open

        path = self.path(config)
        if not os.path.isfile(path):
            return None
        try:
            with safe_open(path, framework="pt") as f:
                meta = json.loads((f.metadata() or {}).get("key", "null"))
                if meta != self.key_parts(config):
                    raise ValueError("its recorded key differs")
                return {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises several types
            log.warning("embeddings cache: %s unreadable (%s); encoding the prompt", path,
                        first_line(e))
            return None

    def store(self, config, embeds: dict) -> None:
        """Write ``embeds`` for ``config`` (process 0 only: every host encodes the same
        prompts); a failure (full disk...) is a warning."""
        if not runtime.is_writer():
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            save_tensors(embeds, self.path(config), {"key": self.key_parts(config)})
        except Exception as e:  # noqa: BLE001 - a cache write must never fail a run
            log.warning("embeddings cache: could not store %s (%s)", self.path(config),
                        first_line(e))


def open_cache(config, family) -> EmbeddingsCache | None:
    """The run's cache, or None when ``--embeddings_cache`` is "none", the stage is not
    ``all``, or ``--model_id`` is a Hub id (its files are not on disk to digest)."""
    directory = config.run.embeddings_cache
    if directory.lower() == "none" or config.run.stage != "all" or not looks_local(
            config.model.model_id) or not os.path.isdir(config.model.model_id):
        return None
    return EmbeddingsCache(directory, family.name, encoder_digest(config.model.model_id, family))
