"""Shared fixtures: the tiny Wan, HunyuanVideo-1.5 and LTX-2 checkpoints, built once per session
through save_pretrained."""

import importlib.util
import os
import subprocess
import sys
import tempfile

import pytest
from serve_util import FAST_CPU_COMPILE, create_database, drop_database

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# Tests run on CPU; the Makefile also gives JAX 8 host devices for the sharding tests.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# In-process CPU compiles too (serve_util.FAST_CPU_COMPILE says why); read when JAX's CPU
# backend starts, after this import.
if FAST_CPU_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_CPU_COMPILE}".strip()
# The default --compilation_cache_dir lives under XDG_CACHE_HOME: keep the tests' compiled
# programs out of the user's cache (subprocesses inherit this).
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="wan-flax-test-cache-")


def _build(tmp_path_factory, tool: str, name: str, *flags) -> str:
    """Run the builder ``tools/<tool>`` into a fresh folder ``name``; returns its path."""
    path = tmp_path_factory.mktemp(name) / name
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), "--output", str(path),
                    *flags], check=True, capture_output=True, text=True)
    return str(path)


def load_tool(name: str):
    """``tools/<name>.py`` imported as a module in this process (tools/ is a folder of
    scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
def ltx2_checkpoint(tmp_path_factory):
    """Path of a freshly built tiny random LTX-2.0 checkpoint (video + audio, ``LTX2Pipeline``)."""
    return _build(tmp_path_factory, "make_tiny_ltx2_checkpoint.py", "tiny-ltx2")


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


@pytest.fixture(scope="session")
def i2v_two_expert_checkpoint(tmp_path_factory):
    """A tiny random Wan 2.2 I2V-A14B-style checkpoint: two experts, no CLIP."""
    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan22-i2v", "--i2v",
                  "--experts", "2", "--boundary_ratio", "0.9")


@pytest.fixture(scope="session")
def flf2v_checkpoint(tmp_path_factory):
    """A tiny random Wan 2.1 FLF2V-style checkpoint (CLIP, pos_embed_seq_len for two images)."""
    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan-flf2v", "--i2v",
                  "--flf2v")


@pytest.fixture(scope="session")
def vace_checkpoint(tmp_path_factory):
    """A tiny random Wan VACE checkpoint (``WanVACEPipeline``: 4 layers, VACE blocks at 0
    and 2, 96 control channels), tools/make_tiny_vace_checkpoint.py."""
    return _build(tmp_path_factory, "make_tiny_vace_checkpoint.py", "tiny-wan-vace")


@pytest.fixture(scope="session")
def helios_checkpoint(tmp_path_factory):
    """A tiny random Helios-Base-style checkpoint (``HeliosPipeline``, ``HeliosScheduler``)."""
    return _build(tmp_path_factory, "make_tiny_helios_checkpoint.py", "tiny-helios")


@pytest.fixture(scope="session")
def helios_distilled_checkpoint(tmp_path_factory):
    """A tiny random Helios-Distilled-style checkpoint (``HeliosPyramidPipeline``,
    ``is_distilled``, ``HeliosDMDScheduler``)."""
    return _build(tmp_path_factory, "make_tiny_helios_checkpoint.py", "tiny-helios-distilled",
                  "--distilled")


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


# The heavy tier: `make test` (CI) deselects these with -m "not slow"; `make test-all` runs
# them too. Each is a whole run, a real-size compile or a fault drill that takes 30-240 s on
# the 2-core CI host; the feature each checks keeps a smaller test in the CI tier (named after
# the "|"). Node ids, or a test's name for all of its parameters. docs/testing.md lists why.
SLOW = {
    # Deviceless TPU compiles of the VAE and real-size steps (CI: the per-chip table's dry run).
    "test_dry_run.py::test_i2v_dry_run_compiles_the_vae_encode": "dry run | per-chip table",
    "test_dry_run.py::test_hunyuan_i2v_dry_run_has_no_device_encode": "dry run | per-chip",
    "test_dry_run.py::test_dry_run_compiles_the_chunked_vae_decode": "dry run | per-chip",
    "test_dry_run.py::test_dry_run_estimate_adds_a_labelled_step_time": "| test_quantize's",
    "test_hunyuan.py::test_dry_run_compiles_the_480p_step": "| test_dry_run's table",
    "test_dry_run.py::test_sr_dry_run_compiles_both_steps_on_their_own_meshes":
        "two real-size 1-block compiles (100-230 s) | test_hunyuan_sr_stage's run",
    "test_hunyuan_sr_stage.py::test_sr_stage_after_image_to_video_matches_the_reference":
        "45 s: its own I2V checkpoint and first stage | the T2V parity",
    "test_hunyuan_sr_stage.py::test_sr_stage_sharded_matches_the_reference":
        "107 s: two meshes, interpret-mode kernel | the 1-device parity",
    "test_serve_ltx2.py::test_served_mp4_has_the_audio_track_and_the_clis_frames_and_waveform":
        "an LTX-2 server and a CLI run (~130 s) | test_ltx2's mp4 streams, test_serve's CLI parity",
    "test_serve_ltx2.py::test_requests_ltx2_cannot_honour_are_one_line_400s":
        "the same server | test_only_the_family_rules_fix_steps_and_fps",
    "test_serve_ltx2.py::test_timeline_names_the_audio_phases_and_its_legend_overlaps_nothing":
        "the same server's report | test_videos' timeline legend test",
    # Moved 2026-11-27 to keep CI under 25 min (fresh-clone make wall 1,274 s with them).
    "test_ltx2_dry_run.py::test_dry_run_estimate_counts_every_guidance_pass":
        "58 s: an LTX-2 deviceless compile | test_default_layout_serves_the_batch_1_passes",
    "test_ltx2_recipes.py::test_dry_run_estimate_takes_the_recipe":
        "48 s: an LTX-2 deviceless compile | test_recipe_defaults_and_flags (8 steps, 1 pass)",
    "test_dry_run.py::test_dry_run_reports_compiler_oom_and_exits_3":
        "44 s | the per-chip table test's verdict (exit 0 side)",
    "test_parking.py::test_parked_decode_frames_equal_the_unparked_run":
        "31 s | test_decode_sees_one_eighth_of_the_weights_and_they_come_back_equal",
    "test_step_cache.py::test_schedule_without_cached_steps_is_exactly_uncached":
        "23 s | the deepcache and magcache parity tests",
    "test_hunyuan_sr_stage.py::test_served_sr_jobs_match_the_reference_at_each_size":
        "a server compiling two buckets of both stages (~100 s alone) | the 1-device parity",
    "test_estimate.py::test_large_bf16_matmul_estimate_is_near_its_roofline": "| rest of file",
    "test_estimate_reduced_q.py::test_reduced_q_profile_agrees_with_the_full_profile": "",
    "test_tpu_compile.py::test_sharded_kernel_compiles_at_wan_shapes[v6e-14B-self-dp2tp4]": "",
    "test_tpu_compile.py::test_sharded_kernel_compiles_at_wan_shapes[v5e-14B-self-dp2tp4]": "",
    "test_tpu_compile.py::test_sharded_kernel_compiles_at_wan_shapes[tpu7x-14B-self-dp2tp4]": "",
    "test_tpu_compile.py::test_sharded_kernel_compiles_at_wan_shapes[v6e-1.3B-self-tp4sp2-seq]":
        "| [v6e-14B-self-tp4sp2-heads]",
    "test_tpu_compile.py::test_kernel_variants_lower_through_mosaic[segments]":
        "| [segments_real_prefix]",
    "test_tpu_compile.py::test_kernel_variants_lower_through_mosaic[head_dim64]": "| [f32]",
    # Several processes (CI: two processes equal one at dp2 x tp2 x sp2).
    "test_multihost.py::test_two_processes_equal_one_process[dp2-tp4-sp1]": "",
    "test_multihost.py::test_two_processes_equal_one_process[dp2-tp2-sp2-parked]": "",
    "test_multihost.py::test_prompts_file_on_two_processes_equals_one_process": "",
    "test_multihost.py::test_a_killed_process_ends_the_other": "| test_serve_faults' flags",
    "test_serve_faults.py::test_kill_9_then_restart": "",
    "test_serve_faults.py::test_a_dead_process_ends_the_server_in_one_line": "",
    "test_serve_faults.py::test_two_processes_serve_as_one": "",
    "test_serve_webhooks.py::test_a_callback_survives_kill_9_and_the_next_server_delivers_it_"
    "once[postgresql]": "two servers (~100 s) | [sqlite], the outbox's PostgreSQL tests",
    "test_serve_i2v.py": "| test_serve.py's OpenAI client",
    "test_time_to_ready.py::test_a_restarted_server_compiles_nothing": "| warm run",
    "test_executable_cache_reuse.py::test_servers_in_turn_load_what_the_second_stored":
        "three servers (~140 s) | the CLI's three runs",
    "test_time_to_ready.py::test_the_dry_run_exports_the_keys_a_run_computes": "",
    "test_time_to_ready.py::test_step_cache_programs_load_warm_with_the_same_frames": "",
    "test_cli.py::test_second_process_hits_the_persistent_compilation_cache": "| ttr warm run",
    "test_overlap_compile.py": "",
    # LTX-2: each case compiles its own step (11-22 s on the 2-core host); CI keeps guidance
    # off and the defaults (all three passes) on one device.
    "test_ltx2.py::test_frames_and_waveform_match_diffusers[cfg]": "| [off] and [defaults]",
    "test_ltx2.py::test_sharded_cli_run_equals_diffusers_and_one_device":
        "8-device CLI run (~45 s) | test_sharding's layouts",
    "test_ltx2.py::test_mp4_has_one_video_and_one_audio_stream": "| test_audio_mp4.py",
    "test_ltx2.py::test_sequence_parallel_pads_the_video_tokens": "| test_sharding's padding",
    # More meshes, checkpoints and variants of a parity already in the CI tier.
    "test_sharding.py::test_sharded_frames_equal_unsharded[dp2-tp4-sp1]": "| [dp2-tp2-sp2]",
    "test_sharding.py::test_sharded_frames_equal_unsharded[dp1-tp8-sp1]": "",
    "test_sharding.py::test_sharded_frames_equal_unsharded[dp1-tp2-sp4]": "",
    "test_sharding.py::test_sequence_parallel_splash_equals_unsharded[dp1-tp2-sp4]":
        "31 s | [dp2-tp2-sp2]",
    "test_quantize.py::test_tpu_compiles_8_bit_matmuls_and_the_estimate_charges_the_8_bit_"
    "rate[tpu7x:2x2x1-fp8-f8e4m3fn]": "22 s | [v6e:2x4-int8-s8]",
    "test_sharding.py::test_sequence_parallel_pads_a_token_count_sp_does_not_divide"
    "[sp8-stock_splash]": "",
    "test_sharding.py::test_sequence_parallel_pads_a_token_count_sp_does_not_divide"
    "[dp2-tp2-sp2-xla-unrolled]": "",
    "test_step_cache_experts.py::test_i2v_magcache_matches_diffusers_hook[wan21_i2v]": "[ti2v]",
    "test_step_cache_experts.py::test_magcache_two_experts_match_diffusers_hooks": "",
    "test_step_cache_experts.py::test_hunyuan_i2v_deepcache_matches_eager_reference":
        "| test_step_cache's HunyuanVideo DeepCache",
    "test_step_cache.py::test_sharded_cached_runs_equal_the_reference": "",
    "test_pipeline_parity.py::test_window_size_and_k_smoothing_flags": "",
    "test_pipeline_parity.py::test_lora_frames_match_diffusers_fuse_lora[original]": "[peft]",
    "test_wan_i2v.py::test_ti2v_i2v_matches_diffusers": "| test_wan21_i2v_matches_diffusers",
    "test_wan22.py::test_ti2v_matches_diffusers": "| test_two_experts_match_diffusers",
    "test_hunyuan_i2v.py": "| test_step_cache's HunyuanVideo I2V",
    "test_hunyuan_variants.py::test_cfg_distilled_is_one_pass_and_matches_diffusers":
        "| test_meanflow_matches_diffusers",
    "test_quantize.py::test_quantized_run_stays_near_bf16[hunyuan-int8]": "| [wan-fp8-sharded]",
    "test_quantize.py::test_quantized_run_stays_near_bf16[wan22-int8]": "",
    "test_realsize.py::test_cpu_scale_run_matches_diffusers_in_float32": "a benchmark's check",
    # Second cut (CI tier at 20 min 47 s of pytest: too near 25 min with the install).
    "test_tpu_compile.py::test_sharded_kernel_compiles_at_wan_shapes": "| mosaic variants",
    "test_estimate_reduced_q.py": "| test_estimate.py",
    "test_serve_retention.py": "",
    "test_step_cache_experts.py::test_i2v_magcache_matches_diffusers_hook":
        "| test_step_cache's MagCache hook parity",
    "test_integrity.py::test_valid_checkpoints_pass_without_a_warning[hunyuan_checkpoint]":
        "| [tiny_checkpoint]",
    "test_expert_parking.py::test_parked_experts_give_the_unparked_frames": "| rest of file",
    "test_vae_encode.py::test_chunked_encode_equals_diffusers[wan21-8]": "| [wan21-1]",
    "test_wan_i2v.py::test_wan21_i2v_matches_diffusers":
        "| test_wan22_i2v_two_experts_match_diffusers",
    # Issue 67 (FLF2V): the dp2 and two-expert cases of the 1-device Wan 2.1 parity.
    "test_wan_flf2v.py::test_wan21_flf2v_dp2_matches_diffusers":
        "| test_wan21_flf2v_matches_diffusers (dp2: the image-row pairs per dp shard)",
    "test_wan_flf2v.py::test_wan22_i2v_two_experts_flf2v_matches_diffusers":
        "| test_wan21_flf2v_matches_diffusers, test_wan_i2v's two-expert parity",
    "test_wan_v2v.py::test_video_to_video_euler_matches_diffusers":
        "| test_video_to_video_matches_diffusers_at_two_strengths (UniPC's add_noise)",
    # Third cut (the second measured 20 min 1 s of pytest): margin under 25 min with install.
    "test_stages.py::test_denoise_without_embeddings_says_which_stage_to_run":
        "| test_shape_mismatched_latents_fail_with_one_line",
    "test_stages.py::test_latents_from_another_vae_are_refused": "",
    "test_tpu_compile.py::test_kernel_variants_lower_through_mosaic[window]":
        "| interpret-mode window tests",
    "test_serve.py::test_load_24_requests_from_6_clients": "| test_openai_client",
    # 2026-11-27 (CI tier measured 20 min 43 s of pytest with it; 47-118 s, a libtpu guard).
    "test_dry_run.py::test_hunyuan_i2v_step_compiles_with_odd_rows_per_shard":
        "| test_hunyuan's sharded frames (padded shards)",
    # 2026-11-27: the quality harness end to end, three generate_flax.py subprocesses (exact,
    # exact again, int8): 65-82 s on the 2-core host beside other work, over a file's 60 s.
    "test_quality_harness.py::test_exact_rerun_gives_infinite_psnr_and_ssim_one":
        "| test_metrics_against_numpy_on_fixed_frames",
    "test_quality_harness.py::test_int8_differs_and_its_psnr_equals_numpy": "",
    # 2026-11-27: Wan 2.2's two experts under --sparse svg (issue 53), ~60 s (a 33-frame
    # video, three step programs); the one-expert sparse path stays in CI.
    "test_sparse_svg.py::test_sequence_parallel_padding":
        "| test_sparse_svg.py::test_default_density_equals_eager_svg_reference",
    "test_sparse_svg.py::test_two_experts_per_expert_density":
        "| test_sparse_svg.py::test_default_density_equals_eager_svg_reference",
    # ~30 s; CI keeps the eager-reference test, whose routing and masks it would catch
    "test_sparse_svg.py::test_density_one_equals_dense":
        "| test_sparse_svg.py::test_default_density_equals_eager_svg_reference",
    # 2026-11-27: per-head masks through Mosaic, a 43 s deviceless compile (issue 53).
    "test_tpu_compile.py::test_head_masks_lower_through_mosaic":
        "| test_splash_head_masks.py (interpret mode)",
    # 2026-11-27, second session: the SVG code back on main took the fresh-clone suite to
    # 1,407 s (CI would pass 25 min); two tests whose path another CI test takes.
    "test_stages.py::test_truncated_latents_fail_with_one_line":
        "~30 s, a decode subprocess | test_shape_mismatched_latents_fail_with_one_line",
    "test_step_cache.py::test_deepcache_hunyuan_matches_eager_reference":
        "27 s | test_deepcache_wan_matches_eager_reference (DeepCache), test_hunyuan (the block)",
    # Then 1,330 s (995 passed): two LoRA parities whose parts CI keeps.
    "test_hunyuan_lora.py::test_official_and_peft_loras_match_diffusers_fuse_lora":
        "35 s | test_converter_covers_every_linear_and_each_format (the keys), "
        "test_pipeline_parity's LoRA fuse parity (the fusing)",
    "test_wan22.py::test_lora_2_fuses_into_the_second_expert":
        "24 s | test_pipeline_parity's LoRA fuse parity, test_bad_lora_2_is_one_line_*",
    # 2026-11-27, third session: CI took 1,456 s with the install (44 s under its limit).
    "test_pipeline_parity.py::test_splash_kernels_in_pipeline_match_xla_attention":
        "52 s | test_sparse_svg's default-density parity (our kernel in the pipeline against "
        "diffusers), test_run_safety's self-check per kernel (stock splash in the pipeline)",
    "test_expert_parking.py::test_experts_parked_in_host_memory_give_the_unparked_frames":
        "30 s | test_swap_bytes_per_device_with_the_idle_expert_in_host_memory (the same "
        "placement, its bytes per device)",
    "test_pipeline_parity.py::test_seed_changes_video_and_is_reproduced":
        "25 s | test_float32_frames_match_diffusers (the parity), test_videos' seeds test",
    # The fresh-clone suite then took 1,313 s of pytest here (CI adds ~190 s of install).
    "test_pipeline_parity.py::test_no_cfg_path_matches_diffusers":
        "22 s | test_euler_scheduler_without_cfg_matches_diffusers (CFG off against diffusers)",
    "test_videos.py::test_cli_writes_every_video_and_one_report":
        "23 s | test_each_video_equals_its_single_run (the videos), test_cli's mp4 and report",
}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: the heavy tier (make test-all), not in CI's "
                                       "make test; tests/conftest.py SLOW says why")


def pytest_collection_modifyitems(config, items):
    used = set()
    for item in items:
        rel = item.nodeid.split("tests/", 1)[-1]
        keys = {rel, rel.split("[")[0], rel.split("::")[0]} & SLOW.keys()
        if keys:
            item.add_marker(pytest.mark.slow)
            used |= keys
    # A renamed or removed test would leave its key behind, naming nothing: when every test
    # file was collected, each key must still name a test.
    here = os.path.dirname(__file__)
    files = {f for f in os.listdir(here) if f.startswith("test_") and f.endswith(".py")}
    if files <= {item.nodeid.split("tests/", 1)[-1].split("::")[0] for item in items}:
        stale = sorted(SLOW.keys() - used)
        if stale:
            raise pytest.UsageError(f"tests/conftest.py SLOW: {len(stale)} key(s) name no test "
                                    f"({', '.join(stale[:3])})")
