"""``--estimate`` (engine/dry_run/estimate.py): libtpu's static profile read right, checked against
independent references: the matmul roofline, the kernel's linear cost in grid steps, and
collective sizes known from the program that was compiled."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from engine.dry_run import estimate, price_kernel
from engine.run import chips, runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The shape of libtpu 0.0.42.1's files: some entries describe the instruction, some not.
SAMPLE = """\
hlo_op_estimate {
  hlo_op_name: "copy.1"
  estimated_cycles: 303249
  num_equivalent_hlos: 1
  dma_instruction_type: DMA_INSTRUCTION_TYPE_LOCAL
  hlo_instruction {
    name: "copy.1"
    opcode: "copy"
    shape {
      element_type: BF16
      dimensions: 10
      dimensions: 128
      layout {
        minor_to_major: 1
        minor_to_major: 0
        tiles {
          dimensions: 8
          dimensions: 128
        }
      }
    }
    backend_config: "{\\"flag_configs\\":[]}"
  }
}

hlo_op_estimate {
  hlo_op_name: "multiply_convert_fusion"
  estimated_cycles: 30883
  num_equivalent_hlos: 1
  scalar_inputs: 0
}
"""


def test_profile_textproto_is_parsed():
    assert estimate.profile_ops(SAMPLE) == [dict(name="copy.1", cycles=303249),
                                            dict(name="multiply_convert_fusion", cycles=30883)]
    parsed = estimate.parse_textproto(SAMPLE)["hlo_op_estimate"][0]
    shape = parsed["hlo_instruction"][0]["shape"][0]
    assert shape["element_type"] == ["BF16"] and shape["dimensions"] == ["10", "128"]
    assert shape["layout"][0]["tiles"][0]["dimensions"] == ["8", "128"]


def test_clock_is_the_published_peak_over_mxu_flops_per_cycle():
    # 918 TFLOP/s = 4 MXUs x 256^2 x 2 x 1.75 GHz; 197 TFLOP/s = 4 x 128^2 x 2 x 1.5 GHz.
    assert estimate.clock_hz("v6e") == pytest.approx(1.75e9, rel=1e-3)
    assert estimate.clock_hz("v5e") == pytest.approx(1.5e9, rel=3e-3)
    assert "not a measurement" in estimate.label("v6e") and "1.75 GHz" in estimate.label("v6e")
    with pytest.raises(ValueError, match="no clock assumption"):
        estimate.clock_hz("v4")


def _compiled_text(fn, *args):
    import jax

    return jax.jit(fn).lower(*args).compile().as_text()


def test_collective_bytes_of_a_known_all_reduce_and_all_gather():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    x = jnp.zeros((4 * 1024,), jnp.float32)

    def psum(x):
        return jax.shard_map(lambda b: jax.lax.psum(b, "x"), mesh=mesh, in_specs=P("x"),
                             out_specs=P("x"))(x)

    found = [c for c in estimate.collectives(_compiled_text(psum, x))
             if c["kind"] == "all-reduce"]
    # Each device holds 1024 float32 (4 KiB); a ring all-reduce over 4 devices sends
    # 2 x 3/4 of it per device.
    assert len(found) == 1
    assert found[0]["group"] == 4 and found[0]["operand_bytes"] == 4096
    assert found[0]["sent_bytes"] == pytest.approx(2 * 3 / 4 * 4096)

    def gather(x):
        return jax.shard_map(lambda b: jax.lax.all_gather(b, "x", tiled=True), mesh=mesh,
                             in_specs=P("x"), out_specs=P(), check_vma=False)(x)

    found = [c for c in estimate.collectives(_compiled_text(gather, x))
             if c["kind"] == "all-gather"]
    assert len(found) == 1 and found[0]["result_bytes"] == 4 * 4096
    assert found[0]["sent_bytes"] == pytest.approx(3 / 4 * 4 * 4096)


def test_collectives_in_a_scan_count_times_its_trip_count():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

    def body(c, _):
        return jax.lax.psum(jnp.sin(c), "x"), None

    def f(x):
        return jax.shard_map(lambda b: jax.lax.scan(body, b, None, length=7)[0], mesh=mesh,
                             in_specs=P("x"), out_specs=P("x"), check_vma=False)(x)

    found = [c for c in estimate.collectives(_compiled_text(f, jnp.zeros((512,))))
             if c["kind"] == "all-reduce"]
    assert [c["count"] for c in found] == [7]


# A batched dot as libtpu 0.0.42.1 lowers it for v6e (jnp.einsum("bhqd,bhkd->bhqk") at
# b=1, h=10, q=4096, k=512, d=128): a convolution whose "spatial" dimension is the batch of
# 10 heads, lhs-dilated so that each output sees one real tap of its 10-wide window.
_BATCHED_DOT_AS_CONV = """\
HloModule m

ENTRY %main (p0: bf16[10,4096,128], p1: bf16[10,512,128]) -> bf16[10,4096,512] {
  %p0 = bf16[10,4096,128]{2,1,0} parameter(0)
  %p1 = bf16[10,512,128]{2,1,0} parameter(1)
  ROOT %convolution-base-dilated.1 = bf16[10,4096,512]{2,1,0} convolution(%p0, %p1), \
window={size=10 stride=9 lhs_dilate=10}, dim_labels=0bf_0oi->0bf
}
"""


def test_batched_dot_lowered_as_a_convolution_counts_its_real_flops():
    # The einsum's FLOPs: 2 x heads x q x k x head_dim. The window's 10 taps once counted
    # as 10 multiply-adds per output (10x this); 9 of every 10 are the dilation's zeros.
    summary = estimate.program_summary(_BATCHED_DOT_AS_CONV, "v6e")
    assert summary["flops"] == 2 * 10 * 4096 * 512 * 128
    # An ordinary convolution (no dilation) still counts every tap: 3x3 over 16 channels.
    conv = _BATCHED_DOT_AS_CONV.replace(
        "window={size=10 stride=9 lhs_dilate=10}", "window={size=3x3 pad=1_1x1_1}").replace(
        "dim_labels=0bf_0oi->0bf", "dim_labels=b01f_01io->b01f").replace(
        "bf16[10,512,128]", "bf16[3,3,16,32]").replace(
        "bf16[10,4096,128]", "bf16[1,64,64,16]").replace("bf16[10,4096,512]", "bf16[1,64,64,32]")
    assert estimate.program_summary(conv, "v6e")["flops"] == 2 * 64 * 64 * 32 * (3 * 3 * 16)


# A weight prefetched into VMEM (memory space S(1)) by XLA's memory-space assignment, as the
# compiled Wan block prints it: an async slice of the weight (viewed as s8) into an S(1)
# buffer, its done, and a fusion that reads the VMEM copy beside an HBM activation.
_VMEM_PREFETCH = """\
HloModule m

%async_computation (param_0: s8[52428800]) -> s8[4194304] {
  %param_0 = s8[52428800]{0} parameter(0)
  ROOT %slice.1 = s8[4194304]{0} slice(%param_0), slice={[0:4194304]}
}

%fused_computation (p0: bf16[18900,128], p1: s8[4194304]) -> bf16[18900,128] {
  %p0 = bf16[18900,128]{1,0} parameter(0)
  %p1 = s8[4194304]{0} parameter(1)
  ROOT %negate.1 = bf16[18900,128]{1,0} negate(%p0)
}

ENTRY %main (w: s8[52428800], x: bf16[18900,128]) -> bf16[18900,128] {
  %w = s8[52428800]{0:T(1024)(128)(4,1)} parameter(0)
  %x = bf16[18900,128]{1,0:T(8,128)(2,1)} parameter(1)
  %slice-start.1 = ((s8[52428800]{0:T(1024)(128)(4,1)}), s8[4194304]{0:T(1024)(128)(4,1)S(1)}, \
s32[]{:S(2)}) async-start(%w), calls=%async_computation
  %slice-done.1 = s8[4194304]{0:T(1024)(128)(4,1)S(1)} async-done(%slice-start.1)
  %copy-start.1 = (bf16[18900,128]{1,0:T(8,128)(2,1)S(1)}, bf16[18900,128]{1,0:T(8,128)(2,1)}, \
u32[]{:S(2)}) copy-start(%x)
  %copy-done.1 = bf16[18900,128]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start.1)
  ROOT %fusion.1 = bf16[18900,128]{1,0:T(8,128)(2,1)} fusion(%copy-done.1, %slice-done.1), \
kind=kLoop, calls=%fused_computation
}
"""


def test_vmem_prefetches_and_on_chip_operands_are_not_hbm_traffic():
    ops = estimate.hlo_op_bytes(_VMEM_PREFETCH)
    act = 18900 * 128 * 2
    # The async slice moves its 4 MiB slice once. Its operand and its tuple (which holds the
    # operand again) once counted 52 MB + 52 MB + 4 MiB: 26x the slice, 1.4 GB per weight
    # prefetched in 13 slices (~0.24 s/step of phantom HBM time for Wan 14B at dp2 x sp4 on v6e-8).
    assert ops["slice-start.1"][1] == 4194304 + 4  # + the s32 context scalar
    assert ops["copy-start.1"][1] == act + 4  # one copy of the activation (+ u32)
    # The fusion reads its VMEM operands (S(1)) on chip: only its HBM result counts.
    assert ops["fusion.1"][1] == act
    summary = estimate.program_summary(_VMEM_PREFETCH, "v6e")
    assert summary["bytes"] == (4194304 + 4) + (act + 4) + act


# libtpu 0.0.51's tpu7x HLO for a layout copy moved to the SparseCore (one Wan 14B block,
# trimmed): ENTRY's async-start / async-update / async-done on the "sparsecore" thread, a
# custom-call, a second async pair and a ``call`` that reaches the copy itself.
_SPARSECORE_COPY = """\
HloModule m

%called_computation.42 (param_0.843: bf16[1024,512]) -> bf16[1024,512] {
  %param_0.843 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %copy.160 = bf16[1024,512]{0,1:T(8,128)(2,1)} copy(%param_0.843)
}

%async_computation.32 (param_0.844: bf16[1024,512]) -> bf16[1024,512] {
  %param_0.844 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %copy.145.cloned.2 = bf16[1024,512]{0,1:T(8,128)(2,1)} call(%param_0.844), \
to_apply=%called_computation.42
}, execution_thread="sparsecore"

%called_computation.43 (param_0.845: bf16[1024,512]) -> bf16[1024,512] {
  %param_0.845 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  %copy.145.call-start = ((bf16[1024,512]{1,0:T(8,128)(2,1)}), bf16[1024,512]{0,1:T(8,128)(2,1)}, \
u32[]{:S(8)}) async-start(%param_0.845), async_execution_thread="sparsecore", \
calls=%async_computation.32
  ROOT %copy.145.call-done = bf16[1024,512]{0,1:T(8,128)(2,1)} async-done(%copy.145.call-start)
}, execution_thread="sparsecore"

%async_computation.8 (param_0.792: bf16[1024,512]) -> bf16[1024,512] {
  %param_0.792 = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %custom-call.10 = bf16[1024,512]{0,1:T(8,128)(2,1)} custom-call(%param_0.792), \
custom_call_target="sc", called_computations={%called_computation.43}
}, execution_thread="sparsecore"

ENTRY %main (x: bf16[1024,512]) -> bf16[1024,512] {
  %x = bf16[1024,512]{1,0:T(8,128)(2,1)} parameter(0)
  %sc.call-start = ((), (), (s32[16384]{0:T(1024)})) async-start(), \
async_execution_thread="sparsecore", calls=%async_computation.8
  %sc.call-update = ((bf16[1024,512]{1,0:T(8,128)(2,1)}), bf16[1024,512]{0,1:T(8,128)(2,1)}, \
(s32[16384]{0:T(1024)})) async-update(%sc.call-start, %x)
  ROOT %sc.call-done = bf16[1024,512]{0,1:T(8,128)(2,1)} async-done(%sc.call-update)
}
"""


def test_a_sparsecore_copy_is_charged_once():
    """The copy's HBM traffic (read and write, 2 x 1 MiB) counts once: the SparseCore
    wrappers around it are no work of their own. Charging the async-update's tuple too had
    counted each such copy 2.5 times (11 per Wan 14B 720p layer on tpu7x: 69 ms per step)."""
    summary = estimate.program_summary(_SPARSECORE_COPY, "tpu7x")
    assert summary["bytes"] == 2 * 1024 * 512 * 2
    assert summary["other_hbm_floor_s"] == pytest.approx(
        2 * 1024 * 512 * 2 / estimate.device_hbm_bytes_per_s("tpu7x"))


def test_a_killed_profile_worker_is_one_line_naming_the_blocks():
    calls = [dict(block_sizes=[4736, 2048, 1024]), dict(block_sizes=[4736, 512, 512])]
    msg = estimate.worker_failure(-9, "", calls)
    assert msg == ("--estimate: the kernel-profiling subprocess failed: killed by SIGKILL (most "
                   "likely out of host memory: libtpu's profile of blocks 4736/2048/1024, "
                   "4736/512/512 needs more RAM than is free; smaller --bq/--bkv profile in "
                   "less)")
    # What the worker said wins; a plain nonzero exit with nothing said names its status.
    assert estimate.worker_failure(1, "a\nb\nValueError: bad", calls).endswith(
        "failed: a | b | ValueError: bad")
    assert estimate.worker_failure(3, "", calls).endswith("failed: exit 3")
    assert "\n" not in msg


def _all_gather(groups: str) -> str:
    return f"""\
HloModule m

ENTRY %main (p0: bf16[8,1024]) -> bf16[8,4096] {{
  %p0 = bf16[8,1024]{{1,0}} parameter(0)
  ROOT %all-gather = bf16[8,4096]{{1,0}} all-gather(%p0), channel_id=1, \
replica_groups={groups}, dimensions={{1}}, use_global_device_ids=true
}}
"""


@pytest.mark.parametrize("groups", [
    "{{0,1,2,3},{4,5,6,7}}",
    "[2,4]<=[8]",
    "mesh['dp'=2,'tp'=4] {'tp'}",
    # A non-iota device order: XLA prints the mesh's device ids between the axes and the
    # group; these were read as a group of one (0 bytes sent).
    "mesh['dp'=2,'tp'=4], device_ids=([[0,2,4,6],[1,3,5,7]]) {'tp'}",
    "mesh['dp'=2,'tp'=4], device_ids=([2,4]<=[4,2]T(1,0)) {'tp'}",
    # A sub-axis: 4 devices of an 8-wide axis.
    "mesh['x'=8] {'x':(1)4}",
])
def test_collective_group_sizes_in_every_printed_form(groups):
    (found,) = estimate.collectives(_all_gather(groups))
    # Gathering 4 shards of 16 KiB: each chip sends 3/4 of the 64 KiB result.
    assert found["group"] == 4
    assert found["sent_bytes"] == pytest.approx(3 / 4 * 8 * 4096 * 2)


def test_estimate_needs_dry_run():
    from engine.run.errors import UsageError
    from generate_flax import parse_args, validate_args

    model = ["--model_id", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"]
    with pytest.raises(UsageError, match="--estimate=True: needs --dry_run"):
        validate_args(parse_args([*model, "--estimate"]))
    with pytest.raises(UsageError, match="--topology='v5p:2x2x1': --estimate knows"):
        validate_args(parse_args([*model, "--dry_run", "--topology", "v5p:2x2x1",
                                  "--estimate"]))
    # The window's masked kernel path hides its work from libtpu's static profile.
    with pytest.raises(UsageError, match="--estimate='on': cannot cost --window_size 4096"):
        validate_args(parse_args([*model, "--dry_run", "--topology", "v6e:2x4", "--estimate",
                                  "--window_size", "4096"]))


def test_stub_records_the_real_per_chip_kernel_grid():
    # Wan 14B at 720p x 81 with CFG on dp2 x tp4: per chip 1 sample x 40/4 heads, and
    # the default blocks fitted to 75,600 tokens: ceil(75600/3328) = 23 q blocks and
    # ceil(75600/2816) = 27 kv blocks (the shared notes' 6,210 grid steps per layer).
    # Cross-attention: 512 text keys in one kv block.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import custom_splash_attention as csa

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4, 1), ("dp", "tp", "sp"))
    q = jax.ShapeDtypeStruct((2, 40, 75600, 128), jnp.bfloat16)
    text = jax.ShapeDtypeStruct((2, 40, 512, 128), jnp.bfloat16)
    calls = []
    with estimate.stub_attention_kernel(calls):
        for kv in (q, text):
            out = jax.eval_shape(lambda a, b: csa.sharded_splash_attention(
                a, b, b, mesh=mesh, options=csa.AttentionOptions(block_sizes=csa.BlockSizes())),
                q, kv)
            assert out.shape == q.shape
    assert [c["grid"] for c in calls] == [[1, 10, 23, 27], [1, 10, 23, 1]]
    assert [c["block_sizes"] for c in calls] == [[3328, 2816, 256], [3328, 512, 256]]
    assert [c["kv_len"] for c in calls] == [75600, 512]


def test_combine_scales_one_block_to_all_layers():
    self_call = dict(grid=[1, 2, 3, 4], q_len=100, kv_len=100, head_dim=128, dtype="bfloat16",
                     block_sizes=[128, 128, 128], segment_ids=False, window_size=None)
    cross_call = dict(self_call, grid=[1, 2, 3, 1], kv_len=10)
    block = dict(linear_s=0.5, other_s=0.25, other_hbm_floor_s=0.125, hbm_bound_s=0.1,
                 collective_sent_bytes=1e9,
                 collectives={"all-reduce": dict(calls=2, sent_bytes=1e9)}, compile_s=0.0,
                 ops=3, source={}, top_ops=[], flops=0.0, kernel_calls=[self_call, cross_call])
    kernels = {estimate._kernel_key(self_call): dict(per_step=1.75e6, per_q_block=0.0)}
    out = estimate.combine(block, kernels, chip="v6e", layers=40, model_flops_per_chip=1e15)
    parts = out["parts"]
    assert parts["linear_s"] == pytest.approx(20.0)
    assert parts["elementwise_and_other_s"] == pytest.approx(5.0)  # at the HBM floor
    # 24 grid steps x 1.75e6 cycles / 1.75 GHz per block; 6 steps for cross-attention.
    assert parts["self_attention_s"] == pytest.approx(40 * 24e-3, rel=1e-3)
    assert parts["cross_attention_s"] == pytest.approx(40 * 6e-3, rel=1e-3)
    assert out["collective_gb_per_chip"] == pytest.approx(40.0)
    assert parts["collectives_s"] == pytest.approx(40.0 / 400)
    total = sum(parts.values())
    assert out["seconds_per_step"] == pytest.approx(total)
    assert out["seconds_per_step_elementwise_by_xla_cost_model"] == pytest.approx(total + 5.0)
    assert out["mxu_use"] == pytest.approx(1e15 / (918e12 * total))
    assert "not a measurement" in out["label"]


PROFILED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from engine.dry_run import estimate
    estimate.setup_profile_environment()
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    rep = NamedSharding(Mesh(np.array([estimate.topology_device("v6e:2x4")]), ("x",)), P())
    n = {n}
    a = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=rep)
    path = estimate.clear_profile()
    compiled = jax.jit(lambda x, y: x @ y).lower(a, a).compile()
    profile = {{op["name"]: op["cycles"] for op in estimate.read_profile(path)}}
    matmul = estimate.program_summary(compiled.as_text(), "v6e", profile=profile)
    small = estimate.kernel_cycles("v6e:2x4", (1024, 1024, 512), heads=1, q_blocks=1,
                                   kv_blocks=2)
    large = estimate.kernel_cycles("v6e:2x4", (1024, 1024, 512), heads=1, q_blocks=2,
                                   kv_blocks=4)
    more_q = estimate.kernel_cycles("v6e:2x4", (1024, 1024, 512), heads=1, q_blocks=3,
                                    kv_blocks=2)
    cost = estimate.kernel_cost("v6e:2x4", (1024, 1024, 512), kv_steps=4)
    print(json.dumps(dict(matmul=matmul, small=small, large=large, more_q=more_q, cost=cost)))
""")


@pytest.fixture(scope="module")
def profiled():
    """One subprocess (the profile flag must precede libtpu's start) compiling, deviceless
    for v6e: a bf16 n^3 matmul, and our kernel on 1x2, 2x4 and 3x2 grids and through
    ``kernel_cost`` (2x2 and 2x3)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("LIBTPU_INIT_ARGS", None)
    n = 4096
    proc = subprocess.run([sys.executable, "-c", PROFILED.format(root=ROOT, n=n)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]), n=n)


def test_large_bf16_matmul_estimate_is_near_its_roofline(profiled):
    n, matmul = profiled["n"], profiled["matmul"]
    roofline = 2 * n**3 / (chips.CHIPS["v6e"].peak_bf16_tflops * 1e12)
    # The dot's cycles are libtpu's static profile's (not the roofline fallback). The
    # program's other ops (layout copies of the operands) are HBM-bound and apart.
    assert matmul["source"]["profile"] >= 1 and matmul["source"]["roofline"] == 0
    assert matmul["flops"] == 2 * n**3
    assert 0.8 <= matmul["linear_s"] / roofline <= 1.3, (matmul["linear_s"], roofline)


def test_kernel_estimate_grows_linearly_with_grid_steps(profiled):
    # Two q blocks, 2, 3 and 4 kv steps: each added kv step costs the same (within 2%).
    # (A 1 x 2 grid is cheaper per step than a 2 x 4 one: _init and _finish weigh more
    # there, and one q block costs less per step; hence the cost model below.)
    profiles, (large, large_steps) = profiled["cost"]["profiles"], profiled["large"]
    assert large_steps == 8
    step_2_to_3, step_3_to_4 = profiles["2x3"] - profiles["2x2"], large - profiles["2x3"]
    assert step_3_to_4 == pytest.approx(step_2_to_3, rel=0.02)
    small, small_steps = profiled["small"]
    assert small_steps == 2 and small / small_steps < large / large_steps * 1.3


def test_kernel_cost_model_predicts_grids_it_was_not_fitted_on(profiled):
    # Fitted on 2 x 2 and 2 x 3 grids; predicts the 2 x 4 grid (more kv steps) and the 3 x 2
    # grid (more q blocks), each profiled on its own.
    cost = profiled["cost"]
    assert set(cost["profiles"]) == {"2x2", "2x3"}
    assert cost["per_step"] > 0 and cost["per_q_block"] > 0
    large, more_q = profiled["large"][0], profiled["more_q"][0]
    assert estimate.call_cycles(dict(grid=[1, 1, 2, 4]), cost) == pytest.approx(large, rel=0.02)
    assert estimate.call_cycles(dict(grid=[1, 1, 3, 2]), cost) == pytest.approx(more_q, rel=0.06)


def test_call_cycles_charges_all_real_kv_blocks_at_their_own_rate():
    """Issue #26: a call's first ``real_kv_blocks`` kv steps of every q block cost the
    all-real profile's per-step figure, the rest the masked one's."""
    cost = dict(per_step=100.0, per_q_block=10.0, all_real=dict(per_step=80.0, per_q_block=9.0))
    q_blocks = 1 * 2 * 3  # batch x heads x q blocks
    assert estimate.call_cycles(dict(grid=[1, 2, 3, 5], real_kv_blocks=4), cost) == (
        q_blocks * (4 * 80 + 1 * 100) + q_blocks * 10)
    assert estimate.call_cycles(dict(grid=[1, 2, 3, 5]), cost) == q_blocks * (5 * 100 + 10)
    assert estimate.call_cycles(dict(grid=[1, 2, 3, 5], real_kv_blocks=9), cost) == (
        q_blocks * (5 * 80 + 10))


TPU7X_PROFILED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from engine.run import runtime
    runtime.use_deviceless_tpu("tpu7x:2x2x1", profile_libtpu=True)
    from engine.dry_run import estimate
    estimate.setup_profile_environment()
    out = {{}}
    for chip, topology in (("tpu7x", "tpu7x:2x2x1"),):
        out[chip] = estimate.kernel_cycles(topology, (1024, 1024, 512), q_blocks=1,
                                           kv_blocks=2)
    import os
    print(json.dumps(dict(out, library=os.environ.get("TPU_LIBRARY_PATH"))))
""")


def test_profile_libtpu_is_the_version_make_venv_installs():
    with open(os.path.join(ROOT, "Makefile")) as f:
        pinned = re.search(r"^LIBTPU_PROFILE := (\S+)$", f.read(), re.M).group(1)
    assert pinned == runtime.PROFILE_LIBTPU_VERSION
    assert runtime.profile_libtpu_path().startswith(sys.prefix)


@pytest.mark.skipif(not os.path.exists(runtime.profile_libtpu_path()),
                    reason="`make venv` installs the profile libtpu; not in this environment")
def test_tpu7x_kernel_profile_with_the_libtpu_installed_apart():
    # libtpu 0.0.42.1 aborts this process; the one installed apart profiles it. A 1 x 2 grid
    # of 1024 x 1024 blocks: each grid step's MXU work, 4 x 1024^2 x 128 FLOPs, needs at
    # least that / 524,288 FLOPs per cycle (one TensorCore) = 1,024 cycles.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("LIBTPU_INIT_ARGS", None)
    env.pop("TPU_LIBRARY_PATH", None)
    proc = subprocess.run([sys.executable, "-c", TPU7X_PROFILED.format(root=ROOT)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["library"] == runtime.profile_libtpu_path()
    cycles, steps = out["tpu7x"]
    floor = 4 * 1024 * 1024 * 128 / estimate.MXU_FLOPS_PER_CYCLE["tpu7x"]
    assert steps == 2
    assert floor < cycles / steps < 4 * floor, (cycles, steps, floor)


def test_a_masked_profile_that_overflows_vmem_is_extrapolated_from_lower_block_q(monkeypatch):
    """tpu7x's masked kernel at its default 3328/2048/1024 overflows VMEM under libtpu's
    profile flag (65.6 of 63.9 MiB), though the step compiles: ``kernel_cost`` then profiles
    block_q 1280 and 2304 and extrapolates linearly. Other failures still raise. The profiles
    here are a stand-in, linear in block_q, so the extrapolation must give it back exactly."""
    profiled = []

    def fake_grid_cost(topology, blocks, *, kv_steps, **kw):
        bq = blocks[0] if isinstance(blocks, tuple) else blocks.block_q
        profiled.append(bq)
        if bq >= 3328:
            raise RuntimeError("Ran out of memory in memory space vmem. Used 65.64M of 63.94M")
        return dict(per_step=1000 + 3 * bq, per_q_block=50 + bq, profiles={"2x2": 1.0},
                    note=None)

    # kernel_cost looks grid_cost up in its own module (engine/dry_run/price_kernel.py)
    monkeypatch.setattr(price_kernel, "grid_cost", fake_grid_cost)
    cost = estimate.kernel_cost("tpu7x:2x2x1", (3328, 2048, 1024), kv_steps=120,
                                segment_ids=True)
    assert profiled == [3328, 1280, 2304]
    assert cost["reduced_block_q"] == [1280, 2304]
    assert cost["per_step"] == pytest.approx(1000 + 3 * 3328)
    assert cost["per_q_block"] == pytest.approx(50 + 3328)
    assert "more VMEM under the profile flag" in cost["note"]
    profiled.clear()  # every block declared real: the same fallback
    real = estimate.kernel_cost("tpu7x:2x2x1", (3328, 2048, 1024), kv_steps=120,
                                segment_ids=True, real_keys_before=1 << 30)
    assert profiled == [3328, 1280, 2304] and real["per_step"] == pytest.approx(1000 + 3 * 3328)
    with pytest.raises(RuntimeError, match="vmem"):  # no segment ids: not this case
        estimate.kernel_cost("tpu7x:2x2x1", (3328, 2048, 1024), kv_steps=120)


def test_decode_floor_is_the_larger_of_flops_and_bytes_per_program_times_its_calls():
    """``decode_floor`` on two compiled programs of known cost: a matmul (compute-bound on
    v6e) and a copy-like add (bytes-bound), with 3 and 5 calls."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    matmul = jax.jit(lambda a, b: a @ b).lower(jax.ShapeDtypeStruct((4096, 4096), f32),
                                               jax.ShapeDtypeStruct((4096, 4096), f32)).compile()
    add = jax.jit(lambda a: a + 1).lower(jax.ShapeDtypeStruct((1 << 20,), f32)).compile()
    peak, hbm = estimate.device_peak_flops("v6e"), estimate.device_hbm_bytes_per_s("v6e")
    mm_flops, mm_bytes = 2 * 4096**3, 4 * 3 * 4096**2
    add_bytes = 4 * 2 * (1 << 20)  # read once, written once
    out = estimate.decode_floor([(matmul, 3), (add, 5)], "v6e")
    assert mm_flops / peak > mm_bytes / hbm and add_bytes / hbm > (1 << 20) / peak
    assert out["seconds"] == pytest.approx(3 * mm_flops / peak + 5 * add_bytes / hbm, rel=1e-6)
    assert (out["calls"], out["programs"]) == (8, 2)
    assert out["flops"] == pytest.approx(3 * mm_flops + 5 * (1 << 20))


def test_dry_run_reads_the_decode_floor_from_its_vae_row():
    """``fit._decode_estimate`` finds the decode's row by its printed name ("VAE decode (N
    programs, peak)") and skips a decode that did not compile."""
    import jax
    import jax.numpy as jnp

    from engine.dry_run import fit

    add = jax.jit(lambda a: a + 1).lower(jax.ShapeDtypeStruct((1 << 20,), jnp.float32)).compile()

    class Decoder:
        def program_calls(self):
            return [(add, 4)]

    rows = [dict(program="transformer step"), dict(program="VAE decode (3 programs, peak)")]
    got = fit._decode_estimate(rows, Decoder(), "v6e")
    assert got == estimate.decode_floor([(add, 4)], "v6e") and got["calls"] == 4
    rows[1]["error"] = "RESOURCE_EXHAUSTED"
    assert fit._decode_estimate(rows, Decoder(), "v6e") is None
