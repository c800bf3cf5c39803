"""Validation reads the environment and never writes it; the XLA and libtpu settings the
flags ask for (``engine.run.runtime.ProcessEnv``) are applied where the runtime starts, with
the values the flags set before they moved there (the strings below are the ones
``check_flag`` and ``use_deviceless_tpu`` wrote into the environment then)."""

import itertools
import os

import pytest

import generate_flax as gf
from engine.dry_run import fit
from engine.files import integrity
from engine.run import runtime
from engine.run.errors import UsageError
from engine.weights import quantize
from families import FAMILIES

FUSION = f"{quantize.TPU_INPUT_FUSION}=true"
TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"
FAST_CONVS = "--xla_jf_convolution_performance_target=0"
DEVICELESS = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "TPU_SKIP_MDS_QUERY",
              "ALLOW_MULTIPLE_LIBTPU_LOAD", "TPU_LIBRARY_PATH")
PLATFORMS = (None, "cpu", "tpu,cpu")
SMALL = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "2",
         "--compilation_cache_dir", "none"]


def _environment(monkeypatch, platforms, xla=None, libtpu=None):
    """The variables the settings touch, as a test case sets them (restored afterwards)."""
    for name, value in (("JAX_PLATFORMS", platforms), ("XLA_FLAGS", xla),
                        ("LIBTPU_INIT_ARGS", libtpu)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    for name in DEVICELESS:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("platforms", PLATFORMS)
def test_check_flag_reads_and_never_writes_the_environment(monkeypatch, platforms):
    """Every --quantize x dry-run topology (or none) x the user's own flags: the environment
    is unchanged, and the returned settings are the ones the check wrote before."""
    family = FAMILIES["wan"]
    users = [(None, None), ("--xla_dump_to=/tmp/x", "--xla_jf_dump_to=/tmp/y"),
             ("--xla_gpu_enable_triton_gemm=true", f"{quantize.TPU_INPUT_FUSION}=false")]
    topologies = (None, "v6e:2x4", "tpu7x:2x2x1", "v4:2x2x1")
    may_take_tpu = platforms is None or "tpu" in platforms.split(",")
    checked = 0
    for (xla, libtpu), scheme, topology in itertools.product(
            users, quantize.CHOICES, topologies):
        _environment(monkeypatch, platforms, xla, libtpu)
        before = dict(os.environ)
        try:
            settings = quantize.check_flag(scheme, family, topology)
        except UsageError:  # int8 on tpu7x, fp8 on v6e, 8 bits on v4
            assert dict(os.environ) == before
            continue
        assert dict(os.environ) == before, (scheme, topology)
        changes = settings.changes(os.environ)
        want = {}
        if scheme == "fp8" and topology is None and "triton_gemm" not in (xla or ""):
            want["XLA_FLAGS"] = f"{xla or ''} {TRITON_OFF}".strip()
        if scheme != "none" and (topology or may_take_tpu) and (
                quantize.TPU_INPUT_FUSION not in (libtpu or "")):
            want["LIBTPU_INIT_ARGS"] = f"{libtpu or ''} {FUSION}".strip()
        assert changes == want, (scheme, topology, xla, libtpu)
        checked += 1
    # 3 user settings x (none: 4 topologies; int8: no topology and v6e; fp8: no topology
    # and tpu7x)
    assert checked == 3 * (4 + 2 + 2)


def _argvs(checkpoint, out):
    """(argv, error's flag or None) for validate_args: runs, dry runs, a profile, bad ones."""
    base = ["--model_id", checkpoint, *SMALL, "--output_dir", str(out)]
    dry = ["--dry_run", "--topology"]
    return [
        (base, None), ([*base, "--quantize", "int8"], None),
        ([*base, "--quantize", "fp8", "--attention", "xla"], None),
        ([*base, "--quantize", "fp8", "--attention", "splash"], None),
        ([*base, "--profile_dir", str(out / "profile")], None),
        ([*base, *dry, "v6e:2x4", "--quantize", "int8"], None),
        ([*base, *dry, "tpu7x:2x2x1", "--quantize", "fp8", "--estimate"], None),
        ([*base, *dry, "v6e:2x4", "--estimate"], None),
        ([*base, *dry, "v6e:2x4", "--quantize", "fp8"], "--quantize"),
        ([*base, *dry, "v4:2x2x1", "--quantize", "int8"], "--quantize"),
        ([*base, *dry, "v6e:2x4", "--profile_dir", str(out / "p")], "--profile_dir"),
        ([*base, "--quantize", "fp8", "--height", "63"], "--height"),
    ]


@pytest.mark.parametrize("platforms", PLATFORMS)
def test_validate_args_never_writes_the_environment(tiny_checkpoint, tmp_path, monkeypatch,
                                                    platforms):
    """The whole validation, on runs, dry runs and refused flags: ``os.environ`` is the same
    dict after it; a run's ``process_env`` holds what the flags ask for."""
    for argv, bad in _argvs(tiny_checkpoint, tmp_path):
        _environment(monkeypatch, platforms, "--xla_dump_to=/tmp/x")
        before = dict(os.environ)
        if bad:
            with pytest.raises(UsageError, match=f"^{bad}"):
                gf.validate_args(gf.parse_args(argv))
        else:
            config = gf.validate_args(gf.parse_args(argv))
            scheme = config.model.quantize
            tpu = config.dry.dry_run or platforms != "cpu"
            assert config.process_env.libtpu_args == ((FUSION,) if scheme != "none" and tpu
                                                      else ())
            assert config.process_env.xla_flags == ((TRITON_OFF,) if scheme == "fp8"
                                                    and not config.dry.dry_run else ())
        assert dict(os.environ) == before, argv


def test_a_run_applies_its_settings_where_the_runtime_starts(tiny_checkpoint, tmp_path,
                                                              monkeypatch):
    """generate_flax.main with --quantize fp8 on a host that may take a TPU: the environment
    is untouched through validation and the checkpoint check, and when the run starts
    (``runtime.start_distributed``) it holds the flags ``check_flag`` used to write, the
    user's XLA flag first."""
    _environment(monkeypatch, "tpu,cpu", "--xla_dump_to=/tmp/x")
    before = dict(os.environ)
    seen = {}
    check = integrity.check_checkpoint

    def checked(config, family):
        seen["checking"] = dict(os.environ)
        return check(config, family)

    def generate(config, family, report):
        seen["running"] = dict(os.environ)
        return 0

    monkeypatch.setattr(integrity, "check_checkpoint", checked)
    monkeypatch.setattr(gf, "generate", generate)
    assert gf.main(["--model_id", tiny_checkpoint, *SMALL, "--output_dir", str(tmp_path),
                    "--quantize", "fp8"]) == 0
    assert seen["checking"] == before
    assert seen["running"] == {**before, "XLA_FLAGS": f"--xla_dump_to=/tmp/x {TRITON_OFF}",
                               "LIBTPU_INIT_ARGS": FUSION}


class _Started(Exception):
    pass


def test_a_dry_run_applies_its_settings_with_the_deviceless_ones(tiny_checkpoint, tmp_path,
                                                                  monkeypatch):
    """--dry_run --topology v6e:2x4 --quantize int8: nothing is written before the dry run
    starts its runtime; then libtpu's arguments are --quantize's fusion flag and the fast
    convolution search, in that order, beside the deviceless variables (as before)."""
    _environment(monkeypatch, "cpu", "--xla_dump_to=/tmp/x")
    before = dict(os.environ)
    seen = {}

    def topology(name):
        seen["starting"] = dict(os.environ)
        raise _Started

    monkeypatch.setattr(fit, "_topology", topology)
    monkeypatch.setattr(integrity, "check_checkpoint",
                        lambda config, family: seen.setdefault("checking", dict(os.environ)))
    with pytest.raises(_Started):
        gf.main(["--model_id", tiny_checkpoint, *SMALL, "--output_dir", str(tmp_path),
                 "--dry_run", "--topology", "v6e:2x4", "--quantize", "int8"])
    assert seen["checking"] == before
    assert seen["starting"] == {
        **before, "LIBTPU_INIT_ARGS": f"{FUSION} {FAST_CONVS}", "TPU_ACCELERATOR_TYPE": "v6e-8",
        "TPU_WORKER_HOSTNAMES": "localhost", "TPU_SKIP_MDS_QUERY": "1",
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def test_process_env_adds_each_flag_unless_the_variable_names_it():
    """``ProcessEnv.changes`` on a dict: flags appended in order unless named (any value),
    defaults only where unset, overrides always; ``apply_process_env`` writes exactly those."""
    settings = runtime.ProcessEnv(xla_flags=("--a=1", "--b"), libtpu_args=("--c=0",),
                                  defaults=(("D", "d"), ("E", "e")), overrides=(("F", "f"),))
    env = {"XLA_FLAGS": "--x --a=7", "E": "", "F": "mine"}
    assert settings.changes(env) == {"XLA_FLAGS": "--x --a=7 --b", "LIBTPU_INIT_ARGS": "--c=0",
                                     "D": "d", "F": "f"}
    assert env == {"XLA_FLAGS": "--x --a=7", "E": "", "F": "mine"}
    assert runtime.apply_process_env(settings, env) == settings.changes(
        {"XLA_FLAGS": "--x --a=7", "E": "", "F": "mine"})
    assert env == {"XLA_FLAGS": "--x --a=7 --b", "LIBTPU_INIT_ARGS": "--c=0", "D": "d",
                   "E": "", "F": "f"}
    assert (settings + runtime.ProcessEnv(xla_flags=("--g",))).xla_flags == ("--a=1", "--b",
                                                                            "--g")
    assert runtime.apply_process_env(None, env) == {}
