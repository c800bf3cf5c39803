"""The VAE decode's price per video (ESTIMATE): ``decode_estimate`` (its compiled programs
priced op by op, as the step's block) and ``decode_floor`` (XLA's whole-program cost
analysis against the roofline, a lower bound)."""

from __future__ import annotations

from engine.dry_run.price_ops import (
    device_hbm_bytes_per_s,
    device_ici_bytes_per_s,
    device_peak_flops,
    label,
    program_summary,
)


def decode_floor(program_calls: list, chip: str) -> dict:
    """A lower bound on the VAE decode's seconds per video on ``chip`` (ESTIMATE): per
    compiled program, max(XLA's FLOPs / the bf16 MXU peak, XLA's bytes accessed / HBM
    bandwidth), x its calls per decode (``program_calls``: [(compiled, calls)], the
    decoder's ``program_calls()``), summed. XLA's whole-program ``cost_analysis`` of the
    per-device program. A floor, not a prediction: convolutions with few channels fill the
    MXU partly, float32 ones take several passes, and collectives (the width halos) are not
    counted. Returns dict(seconds, flops, bytes, programs, calls, label, method).

    Raises:
        ValueError: a program without XLA cost figures.
    """
    peak, hbm = device_peak_flops(chip), device_hbm_bytes_per_s(chip)
    out = dict(seconds=0.0, flops=0.0, bytes=0.0, programs=len(program_calls), calls=0)
    for compiled, calls in program_calls:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if not cost or "flops" not in cost:
            raise ValueError("a decode program has no XLA cost analysis")
        flops, nbytes = float(cost["flops"]), float(cost.get("bytes accessed", 0.0))
        out["seconds"] += calls * max(flops / peak, nbytes / hbm)
        out["flops"] += calls * flops
        out["bytes"] += calls * nbytes
        out["calls"] += calls
    out.update(label=label(chip), method="floor: per program max(FLOPs / bf16 peak, bytes / "
               "HBM bandwidth) from XLA's cost analysis, x calls; collectives not counted")
    return out



DECODE_METHOD = ("per compiled decode program, its ops priced as the step's block (linear: "
                 "FLOPs / MXU peak or HBM bytes / bandwidth, whichever is larger; other ops: "
                 "HBM bytes / bandwidth; collectives: ring bytes / ICI egress, serial), x its "
                 "calls per decode")


def decode_estimate(program_calls: list, chip: str) -> dict:
    """Seconds of the VAE decode per video on ``chip`` (ESTIMATE): every compiled program of
    the decode (``program_calls``: [(compiled, calls per decode)], the decoder's
    ``program_calls()``; LTX-2's holds the video decode, the audio decode and the vocoder in
    one program) priced op by op as the step's block is (``price_ops.program_summary``, the
    step's ``combine`` rule), x its calls. Where the compiled HLO cannot be read back
    (jaxlib 0.10.2 on what libtpu 0.0.52 compiled for tpu7x: ``price_ops.block_hlo_env``),
    the whole decode falls back to ``decode_floor`` and ``kind`` says "floor".

    Returns:
        dict(seconds, kind ("compiled estimate", or "floor" where the floor is larger than
        the ops' sum ``op_sum_s`` or the HLO is unreadable), linear_s, elementwise_s,
        collectives_s, floor_s (``decode_floor``'s figure beside), programs, calls, label,
        method).

    Raises:
        ValueError: a program without XLA cost figures (``decode_floor``).
    """
    floor = decode_floor(program_calls, chip)
    out = dict(seconds=0.0, kind="compiled estimate", linear_s=0.0, elementwise_s=0.0,
               collectives_s=0.0, floor_s=floor["seconds"], programs=len(program_calls),
               calls=floor["calls"], label=label(chip), method=DECODE_METHOD)
    ici = device_ici_bytes_per_s(chip)
    for compiled, calls in program_calls:
        try:
            text = compiled.as_text()
        except Exception:  # noqa: BLE001 - jaxlib's proto reader (tpu7x); the floor stands
            return dict(out, seconds=floor["seconds"], kind="floor", linear_s=None,
                        elementwise_s=None, collectives_s=None, method=floor["method"])
        s = program_summary(text, chip, exclude=())
        out["linear_s"] += calls * s["linear_s"]
        out["elementwise_s"] += calls * s["other_hbm_floor_s"]
        out["collectives_s"] += calls * s["collective_sent_bytes"] / ici
    out["op_sum_s"] = out["linear_s"] + out["elementwise_s"] + out["collectives_s"]
    # A sum under the floor (a lower bound) is wrong, not fast: the tiny test decodes price
    # their ops at 0.4 us against a 71 us floor of XLA's bytes accessed (weights the ops'
    # own bytes leave out). The floor then stands, and says so.
    if out["op_sum_s"] < floor["seconds"]:
        return dict(out, seconds=floor["seconds"], kind="floor")
    out["seconds"] = out["op_sum_s"]
    return out
