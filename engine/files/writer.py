"""Writing videos off the critical path: one background thread, first in first out.

A run hands each finished video's host frames to ``VideoWriter.submit`` and starts the next
video at once; the thread converts them to uint8, encodes the mp4 and muxes the audio
(``engine.files.videos.write_video``) while the devices denoise the next one. One thread
keeps the files in the order they were submitted; at most ``depth`` writes wait or run
beside the video being computed, so the host holds at most ``depth + 1`` videos' frames.

A write that fails is not lost: its error (one line naming the file, a
``GenerationError``) is raised by the next ``submit`` or by ``wait``, which the run calls
before it reports and exits.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor


class VideoWriter:
    """A single writer thread with a bounded queue (``depth`` pending writes, >= 1).

    Use as a context manager, or call ``wait`` then ``close``; ``close`` after a failure
    elsewhere lets the running write end and drops the ones not started.
    """

    def __init__(self, depth: int = 1):
        if depth < 1:
            raise ValueError(f"depth={depth!r}: must be >= 1")
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="video-writer")
        self._pending: collections.deque[Future] = collections.deque()

    def submit(self, write, *args, **kwargs) -> Future:
        """Queue ``write(*args, **kwargs)`` behind the writes already submitted; returns its
        future. Blocks while ``depth`` writes are pending (the oldest must finish first).

        Raises:
            Exception: the first failure of an earlier write (``GenerationError`` for a file
                that could not be written), before this one is queued.
        """
        self._reap(block=False)
        while len(self._pending) >= self.depth:
            self._pending.popleft().result()
        future = self._pool.submit(write, *args, **kwargs)
        self._pending.append(future)
        return future

    def wait(self) -> None:
        """Block until every submitted write has finished.

        Raises:
            Exception: the first failed write's error (``close`` then drops the rest).
        """
        self._reap(block=True)

    def _reap(self, block: bool) -> None:
        while self._pending and (block or self._pending[0].done()):
            self._pending.popleft().result()

    def close(self) -> None:
        """Stop the thread: the running write finishes, writes not started are dropped (a
        run that failed elsewhere leaves no partial file: each write renames into place)."""
        for future in self._pending:
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True)

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(self, kind, error, tb) -> None:
        try:
            if kind is None:
                self.wait()
        finally:
            self.close()
