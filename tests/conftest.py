"""Shared fixtures: the tiny Wan and HunyuanVideo-1.5 checkpoints, built once per session
through save_pretrained."""

import os
import subprocess
import sys
import tempfile

import pytest
from serve_util import create_database, drop_database

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Tests run on CPU; the Makefile also gives JAX 8 host devices for the sharding tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The default --compilation_cache_dir lives under XDG_CACHE_HOME: keep the tests' compiled
# programs out of the user's cache (subprocesses inherit this).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="wan-flax-test-cache-")


def _build(tmp_path_factory, tool: str, name: str, *flags) -> str:
    """Run the builder ``tools/<tool>`` into a fresh folder ``name``; returns its path."""
    path = tmp_path_factory.mktemp(name) / name
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), "--output", str(path),
                    *flags], check=True, capture_output=True, text=True)
    return str(path)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """Path of a freshly built tiny random Wan 2.1 checkpoint (diffusers format)."""
    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan")


@pytest.fixture(scope="session")
def tiny_checkpoint_8h(tmp_path_factory):
    """A tiny checkpoint with 8 heads, so tensor parallelism up to 8 ways divides them."""
    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan-8h", "--heads", "8",
                  "--head_dim", "12", "--ffn_dim", "64")


@pytest.fixture(scope="session")
def hunyuan_checkpoint(tmp_path_factory):
    """Path of a freshly built tiny random HunyuanVideo-1.5 T2V checkpoint."""
    return _build(tmp_path_factory, "make_tiny_hunyuan_checkpoint.py", "tiny-hunyuan15")


@pytest.fixture(scope="session")
def ti2v_checkpoint(tmp_path_factory):
    """A tiny random Wan 2.2 TI2V-5B-style checkpoint (48 channels, the Wan 2.2 VAE,
    ``expand_timesteps``): text-to-video, and image-to-video with --image."""
    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan22-ti2v", "--ti2v")


@pytest.fixture(scope="session")
def i2v_checkpoint(tmp_path_factory):
    """A tiny random Wan 2.1 I2V-style checkpoint (``WanImageToVideoPipeline``, CLIP image
    encoder, 36 input channels): image-to-video only."""
    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan-i2v", "--i2v")


@pytest.fixture
def torchax_env():
    """torchax's default env with the torch SDPA op restored after the test (the env is shared
    by the whole session; tests install overrides on it)."""
    torch = pytest.importorskip("torch")
    torchax = pytest.importorskip("torchax")
    env = torchax.default_env()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    saved = env._ops.get(sdpa)
    yield env
    if saved is None:
        env._ops.pop(sdpa, None)
    else:
        env._ops[sdpa] = saved


# A real PostgreSQL server for the shared job store's tests: .ci/run starts a throwaway
# cluster (tools/postgres.sh) and exports its URL here.
POSTGRES_ENV = "GENERATE_FLAX_TEST_POSTGRES"


def new_database():
    """A new, empty database on the test PostgreSQL server: a generator yielding its URL,
    dropping it after. Skips (with the reason) without a server, except under CI, where it
    fails."""
    base = os.environ.get(POSTGRES_ENV)
    if not base:
        reason = (f"needs a PostgreSQL server: eval \"$(tools/postgres.sh start)\" sets "
                  f"${POSTGRES_ENV}")
        if os.environ.get("CI"):
            pytest.fail(reason + " (.ci/run starts one)")
        pytest.skip(reason)
    url = create_database(base, "test")
    yield url
    drop_database(base, url)


@pytest.fixture
def postgres_url():
    """The URL of a new, empty database for one test (``new_database``)."""
    yield from new_database()


@pytest.fixture(scope="module")
def postgres_url_module():
    """The URL of a new, empty database shared by a module's tests (``new_database``)."""
    yield from new_database()
