"""Shared fixtures: the tiny Wan and HunyuanVideo-1.5 checkpoints, built once per session
through save_pretrained."""

import os
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Tests run on CPU; the Makefile also gives JAX 8 host devices for the sharding tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The default --compilation_cache_dir lives under XDG_CACHE_HOME: keep the tests' compiled
# programs out of the user's cache (subprocesses inherit this).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="wan-flax-test-cache-")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Path of a freshly built tiny random Wan 2.1 checkpoint (diffusers format)."""
    path = tmp_path_factory.mktemp("ckpt") / "tiny-wan"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "make_tiny_checkpoint.py"),
         "--output", str(path)],
        check=True, capture_output=True, text=True,
    )
    return str(path)


@pytest.fixture(scope="session")
def tiny_checkpoint_8h(tmp_path_factory):
    """A tiny checkpoint with 8 heads, so tensor parallelism up to 8 ways divides them."""
    path = tmp_path_factory.mktemp("ckpt8") / "tiny-wan-8h"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "make_tiny_checkpoint.py"),
         "--output", str(path), "--heads", "8", "--head_dim", "12", "--ffn_dim", "64"],
        check=True, capture_output=True, text=True,
    )
    return str(path)


@pytest.fixture(scope="session")
def hunyuan_checkpoint(tmp_path_factory):
    """Path of a freshly built tiny random HunyuanVideo-1.5 T2V checkpoint."""
    path = tmp_path_factory.mktemp("ckpt-hy15") / "tiny-hunyuan15"
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "make_tiny_hunyuan_checkpoint.py"),
         "--output", str(path)],
        check=True, capture_output=True, text=True,
    )
    return str(path)
