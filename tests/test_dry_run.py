"""--dry_run: the real TPU compiler, no TPU, no weights, on a reduced 1.3B config."""

import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


V5E_USABLE_HBM = int(15.75 * 2**30)  # what libtpu's compiler says a v5e program may use


def dry_run_1p3b(tmp_path, *flags):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"),
         "--model_id", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--dry_run", "--topology", "v5e:2x2",
         "--dry_run_layers", "1", "--dry_run_skip_vae", "--height", "480", "--width", "832",
         "--flow_shift", "3.0", "--output_dir", str(tmp_path), *flags],
        capture_output=True, text=True, timeout=900, env=env)
    paths = glob.glob(str(tmp_path / "*_dry_run.json"))
    return proc, json.loads(open(paths[0]).read()) if len(paths) == 1 else None


def vae_bytes(prefixes=("",)):
    """float32 bytes of the Wan 2.1 VAE's weights whose names start with one of ``prefixes``,
    counted by diffusers itself."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan

    folder = os.path.join(ROOT, "configs", "Wan-AI", "Wan2.1-T2V-1.3B-Diffusers")
    with init_empty_weights():
        vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(folder, subfolder="vae"))
    return sum(t.numel() * 4 for name, t in [*vae.named_parameters(), *vae.named_buffers()]
               if name.startswith(prefixes))


def _lora_with_a_replicated_target(path):
    """A PEFT-format LoRA on block 0 (tp-split weights) and on condition_embedder.time_proj,
    which the sharding rules replicate."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from tiny_lora import write_lora

    folder = os.path.join(ROOT, "configs", "Wan-AI", "Wan2.1-T2V-1.3B-Diffusers")
    with open(os.path.join(folder, "transformer", "config.json")) as f:
        cfg = json.load(f)
    tensors = write_lora(path, cfg, fmt="peft", layers=[0])
    dim = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    pre = "transformer.condition_embedder.time_proj"
    tensors.update({f"{pre}.lora_A.weight": torch.zeros(4, dim),
                    f"{pre}.lora_B.weight": torch.zeros(6 * dim, 4)})
    save_file(tensors, path)


def test_dry_run_prints_per_chip_table_and_exits_by_fit(tmp_path):
    lora = str(tmp_path / "lora.safetensors")
    _lora_with_a_replicated_target(lora)
    proc, report = dry_run_1p3b(tmp_path, "--frames", "21", "--lora", lora)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== Dry run: v5e:2x2 (4 chips)" in proc.stdout and "verdict: fits" in proc.stdout
    step = report["per_chip"][0]
    # One 1.3B block's bf16 weights split over tp=2 plus 1/2 of the replicated rest: well
    # under a v5e chip's HBM; the compiler's own accounting must say so.
    assert step["program"] == "transformer step" and step["fits"]
    assert 0 < step["total_bytes"] < step["capacity_bytes"] == V5E_USABLE_HBM
    # The replicated float32 VAE decoder stays in HBM during the step and is counted; the
    # encoder is never placed.
    decoder = vae_bytes(("decoder.", "post_quant_conv."))
    assert step["resident_bytes"] == decoder < vae_bytes()
    assert step["total_bytes"] >= step["argument_bytes"] + step["temp_bytes"] + decoder
    assert step["flops"] > 0 and report["mesh"] == {"dp": 2, "tp": 2, "sp": 1}
    assert report["tokens"] == 6 * 30 * 52 and report["fits"] is True
    # The configs it read were checked first (engine/files/integrity.py), without weights.
    check = report["checkpoint_check"]
    assert check["ran"] and not check["weights"] and check["seconds"] > 0
    assert sorted(check["components"]) == ["transformer", "vae"]
    # --lora: the dry run names the replicated weights the LoRA touches (whole on each chip):
    # the row-parallel layers' biases (lora_B.bias) and time_proj; not the tp-split ones.
    (entry,) = report["loras"]
    assert entry["replicated_weights"] == [
        "blocks.stacked.attn1.to_out.0.bias", "blocks.stacked.attn2.to_out.0.bias",
        "blocks.stacked.ffn.net.2.bias", "condition_embedder.time_proj.weight"]
    assert entry["matched_weights"] == 2 * 10 + 1  # block 0's projections and biases
    assert "replicated weights it touches: blocks.stacked.attn1.to_out.0.bias" in proc.stdout


def test_dry_run_reports_compiler_oom_and_exits_3(tmp_path):
    # 1440 x 2560 x 321 frames: 1,166,400 tokens. --attention xla runs the query-chunked
    # attention (bounded scores; at 480 x 832 x 81 it fits in 1.3 GiB, where plain XLA
    # attention needed 24 GiB), so here the activations alone outgrow a v5e chip (21.5 GiB
    # measured). The compiler refuses; the table says so.
    tokens = 1166400
    proc, report = dry_run_1p3b(tmp_path, "--height", "1440", "--width", "2560", "--frames",
                                "321", "--attention", "xla")
    assert proc.returncode == 3, proc.stderr[-3000:]
    step = report["per_chip"][0]
    assert not step["fits"] and not report["fits"] and report["tokens"] == tokens
    # Far below the whole (6 heads, tokens, tokens) float32 score matrix per chip (32.6 TB):
    # the chunked attention, not the scores, is what the compiler sized.
    assert V5E_USABLE_HBM < step["temp_bytes"] < 64 * 2**30 < 6 * tokens**2 * 4
    assert step["total_bytes"] > step["temp_bytes"] + step["argument_bytes"] > V5E_USABLE_HBM
    need = step["total_bytes"] / 2**30
    assert f"transformer step: does not fit: {need:.1f} GiB needed, 15.75 GiB available" \
        in proc.stdout
    assert "verdict: does not fit" in proc.stdout


def test_dry_run_estimate_adds_a_labelled_step_time(tmp_path):
    # Small blocks keep the kernel's profiled grids quick (25 s against 85 s at v5e's
    # default blocks) and check that the block flags reach the estimate.
    proc, report = dry_run_1p3b(tmp_path, "--frames", "21", "--estimate",
                                "--bq", "1024", "--bkv", "1024", "--bkv_compute", "256")
    assert proc.returncode == 0, proc.stderr[-3000:]
    est = report["estimate"]
    assert "not a measurement" in est["label"] and "1.50 GHz" in est["label"]
    assert "== Estimated step time (estimate from libtpu's static model" in proc.stdout
    assert "not checked on hardware" in proc.stdout
    # The estimate covers all 30 blocks although --dry_run_layers 1 compiled one. Per chip
    # (dp2 x tp2): 1 sample, 12/2 heads; 9,360 tokens in ceil(9360/1024) = 10 q and kv
    # blocks of 1024: 6 x 10 x 10 = 600 grid steps per block.
    assert est["layers"] == 30 and est["attention"]["self"]["grid_steps"] == 30 * 600
    cost = next(k for k in est["kernels"].values() if k["block_sizes"] == [1024, 1024, 256])
    clock = 197e12 / (4 * 128 * 128 * 2)  # v5e's published peak / MXU FLOPs per cycle
    # Per block: 600 grid steps and 1 x 6 x 10 = 60 q blocks (each has an init and a finish).
    cycles = 600 * cost["per_step"] + 60 * cost["per_q_block"]
    assert est["parts"]["self_attention_s"] == pytest.approx(30 * cycles / clock)
    total = sum(est["parts"].values())
    assert est["seconds_per_step"] == pytest.approx(total) and total > 0
    # The report's analytic FLOPs are those of the 1 block compiled; 30 blocks, 4 chips.
    flops = report["analytic_transformer_flops_per_step"] * 30 / 4
    assert est["mxu_use"] == pytest.approx(flops / (197e12 * total), rel=2e-3)
    # Tensor parallelism's all-reduces, read from the compiled block.
    assert est["collectives"]["all-reduce"]["calls"] > 0 and est["collective_gb_per_chip"] > 0


def test_dry_run_needs_a_topology(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"), "--dry_run",
         "--output_dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--topology=None" in proc.stderr


def test_dry_run_compiles_the_chunked_vae_decode(tmp_path):
    # 9 frames = 3 latent frames: the frame-chunked decode is three programs (first frame,
    # second frame, every later one); latent width 32 splits over the 4 chips.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"),
         "--model_id", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--dry_run", "--topology", "v5e:2x2",
         "--dry_run_layers", "1", "--height", "64", "--width", "256", "--frames", "9",
         "--output_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "*_dry_run.json"))
    report = json.loads(open(path).read())
    step, vae = report["per_chip"]
    assert vae["program"] == "VAE decode (3 programs, peak)" and vae["fits"]
    assert report["vae_checked"] and report["fits"]
    assert "--xla_jf_convolution_performance_target=0" in report["libtpu_init_args"]
    # The replicated decoder weights are the decode's arguments, with one latent frame and the
    # width-sharded conv cache; jit drops the unused encoder weights.
    decoder = vae_bytes(("decoder.", "post_quant_conv."))
    assert decoder < vae["argument_bytes"] < vae_bytes()
    # While it decodes, the transformer's weights and embeddings stay in HBM (the step's
    # arguments minus latents and timestep) plus the decoded frames twice (chunks + concat),
    # width-sharded over 4 chips: 3 x 9 x 64 x 256 float32 / 4.
    video = 3 * 9 * 64 * 256 * 4 // 4
    assert abs(vae["resident_bytes"] - (step["argument_bytes"] + 2 * video)) < 2**20
    assert vae["total_bytes"] >= vae["argument_bytes"] + vae["temp_bytes"] + vae["resident_bytes"]


def test_i2v_dry_run_compiles_the_vae_encode(tmp_path):
    """Wan 2.1 I2V-14B (one block): the step takes the 20-channel condition and the 257 CLIP
    tokens, and the chunked VAE encode (first frame, first chunk, later chunks) compiles for
    the topology with the encoder's weights as its arguments; no --image is needed."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"),
         "--model_id", "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers", "--dry_run", "--topology",
         "v5e:2x2", "--dry_run_layers", "1", "--height", "64", "--width", "256", "--frames",
         "9", "--output_dir", str(tmp_path), "--no_plots"],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "*_dry_run.json"))
    report = json.loads(open(path).read())
    step, decode, encode = report["per_chip"]
    assert encode["program"] == "VAE encode (3 programs, peak)" and encode["fits"]
    assert encode["resident_bytes"] == 0  # it runs before the transformer is placed
    encoder = vae_bytes(("encoder.", "quant_conv."))
    assert encoder < encode["argument_bytes"] < vae_bytes()
    # The image cross-attention's K/V weights (5120 x 5120 each, one block) matched their
    # tp rule (rule_counts count parameters).
    (n,) = [n for rule, n in report["sharding_rule_matches"].items()
            if "add_k_proj" in rule and "weight" in rule]
    assert n == 2 * 5120 * 5120


def test_hunyuan_i2v_dry_run_has_no_device_encode(tmp_path):
    """HunyuanVideo-1.5 I2V encodes its condition on the host (the encode stage), so the dry
    run sizes the step and the decode only: it once compiled Wan's device encoder for it,
    failed, and reported "does not fit" (exit 3)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"),
         "--model_id", "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v",
         "--dry_run", "--topology", "v5e:2x2", "--dry_run_layers", "1", "--height", "64",
         "--width", "128", "--frames", "5", "--output_dir", str(tmp_path), "--no_plots"],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "*_dry_run.json"))
    programs = [row["program"] for row in json.loads(open(path).read())["per_chip"]]
    assert programs[0] == "transformer step" and programs[1].startswith("VAE decode")
    assert not any("encode" in p for p in programs), programs


def test_hunyuan_i2v_step_compiles_with_odd_rows_per_shard(tmp_path):
    """HunyuanVideo-1.5 image-to-video at dp2 x sp4 on v6e:2x4 (the 480p I2V checkpoints'
    default) with a token count that leaves odd rows per shard: 42 tokens, 11 per shard
    before the 16-row tiles. libtpu's compiler stopped on it ("INTERNAL: ... Bitcast cannot
    have different shape", bf16[1,11,2048]; at 480 x 848 x 121: bf16[1,12323,2048]) until
    sequence parallelism padded HunyuanVideo-1.5's shards to whole 16-row tiles."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"),
         "--model_id", "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v",
         "--dry_run", "--topology", "v6e:2x4", "--dry_run_skip_vae", "--dry_run_layers", "1",
         "--height", "48", "--width", "112", "--frames", "5", "--output_dir", str(tmp_path),
         "--no_plots"], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "mesh dp2 tp1 sp4, 1 blocks, 42 tokens" in proc.stdout


def test_sr_dry_run_compiles_both_steps_on_their_own_meshes(tmp_path):
    """``--sr 720p`` after HunyuanVideo-1.5 480p T2V (CFG 6: dp2 over the batch of 2): the SR
    step (guidance 1, batch 1, 98 input channels: the first stage's config as the SR DiT's,
    no --sr_model_dir) compiles on its own mesh at the SR size, both transformers counted
    resident beside each other's step. 480 x 848 -> 720 x 1280 (the official bucket map)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"),
         "--model_id", "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
         "--dry_run", "--topology", "v5e:2x2", "--dry_run_skip_vae", "--dry_run_layers", "1",
         "--height", "480", "--width", "848", "--frames", "5", "--sr", "720p",
         "--output_dir", str(tmp_path), "--no_plots"],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = glob.glob(str(tmp_path / "*_dry_run.json"))
    report = json.loads(open(path).read())
    rows = {row["program"]: row for row in report["per_chip"]}
    first, second = rows["transformer step"], rows["transformer step (SR)"]
    assert report["mesh"]["dp"] == 2 and report["upscale"]["mesh"]["dp"] == 1
    up = report["upscale"]
    assert (up["height"], up["width"], up["steps"], up["transformer_config_assumed"]) == (
        720, 1280, 6, True)
    # Each step keeps the other transformer's weights resident (the same size: 1 block).
    assert second["resident_bytes"] == first["resident_bytes"] > 0
    assert "SR stage (720p_sr_distilled, 720 x 1280, 6 steps)" in proc.stdout
