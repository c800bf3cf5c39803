"""Where served videos live: the ``Storage`` interface and its one implementation, a folder
every server reaches.

With several servers on one job store, a job created on server A may run on B and be
downloaded from C, so the folder must be shared: NFS, Filestore, or a Cloud Storage bucket
mounted with GCS FUSE (docs/serving.md). Files are written to a hidden ``.partial`` name in
the same folder and renamed (``engine.files.report.atomic_write``): a reader on any server
sees a whole file or none, on a filesystem whose rename is atomic (POSIX local disks and
NFS; GCS FUSE uploads the finished object on close, so a reader there also never sees a
partial object).

An object store without a mount (S3, GCS through its API) fits the same four calls: ``save``
uploads after the local write, ``path`` becomes a local cache fill (or a signed-URL
redirect in the HTTP layer), ``remove`` deletes the object.
"""

from __future__ import annotations

import os
from typing import Protocol

from engine.files import videos


class Storage(Protocol):
    """The files of served jobs, by name (a job id's ``<id>.mp4``, ``<id>.frames.
    safetensors``)."""

    folder: str

    def save(self, config, frames, job_id: str, audio=None) -> list[str]:
        """Write a job's mp4 (and frames with --save_frames) atomically, with its sound
        (``engine.files.report.Audio`` or None) muxed in; the names."""

    def write(self, config, frames, job_id: str, audio=None) -> tuple[list[str], dict]:
        """``save``, timed: (the names, ``engine.files.videos.write_video``'s timings:
        uint8_s, write_s, written_at). Raises ``GenerationError``: one line naming the file
        that could not be written (the worker's writer thread calls it)."""

    def path(self, name: str) -> str:
        """A local path to read ``name`` from."""

    def exists(self, name: str) -> bool:
        """Whether ``name`` is stored."""

    def remove(self, name: str) -> None:
        """Remove ``name`` if stored."""


class SharedFolder:
    """``Storage`` in a folder (``--output_dir``), local or shared between servers."""

    def __init__(self, folder: str):
        self.folder = folder

    def save(self, config, frames, job_id: str, audio=None) -> list[str]:
        """(F, H, W, 3) float32 ``frames`` in [0, 1] to ``<job_id>.mp4`` (and its frames),
        with ``audio`` (``engine.files.report.Audio``: an AAC track, and the frames file's
        "audio"), as the CLI writes them; returns the file names."""
        return self.write(config, frames, job_id, audio)[0]

    def write(self, config, frames, job_id: str, audio=None) -> tuple[list[str], dict]:
        paths, timings = videos.write_video(config, frames, job_id, None, audio)
        return [os.path.basename(p) for p in paths], timings

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def exists(self, name: str) -> bool:
        return os.path.exists(self.path(name))

    def remove(self, name: str) -> None:
        try:
            os.remove(self.path(name))
        except FileNotFoundError:
            pass  # another server removed it first (both swept or deleted the job)
