"""Time to first video, process start to the first mp4 written, on the tiny checkpoint (CPU):
a cold process (every cache empty), a warm one with JAX's persistent compilation cache only
(the executable and embedding caches off), and a warm one with every cache. Each is a fresh
``generate_flax.py`` process; the split comes from its JSON report
(``timings.time_to_first_video``, ``engine.files.report.time_to_first_video``), and the wall
time around the process is printed beside it.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/time_to_ready.py --repeats 1
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/time_to_ready.py --overlap_compile on

``--overlap_compile`` is passed to every process (compile while loading; default ``auto``,
as the CLI's); with it on, the rows ``load chain``, ``compile chain`` and ``overlap wall``
(the report's ``overlap_*_s``) show the two chains and the wall they took together.

Figures: benchmarks/time_to_ready_results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = ["--height", "64", "--width", "96", "--frames", "17", "--num_inference_steps", "8",
         "--warmup_steps", "1", "--no_plots"]
PHASES = ("imports_s", "checkpoint_check_s", "prologue_s", "read_s", "text_encode_s", "place_s",
          "compile_wait_s", "trace_lower_s", "compile_s", "executable_load_s", "warmup_s",
          "denoise_s", "decode_s", "write_s", "other_s", "total_s")


OVERLAP = ("overlap_load_chain_s", "overlap_compile_chain_s", "overlap_wall_s")


def run_once(checkpoint: str, cache: str, out: str, *, only_jax_cache: bool,
             overlap: str = "auto") -> dict:
    """One ``generate_flax.py`` process; returns its split plus ``wall_s``, the
    overlap's chains and wall (``OVERLAP``, when it overlapped), the programs compiled /
    loaded and the embedding hits."""
    flags = ["--model_id", checkpoint, *SHAPE, "--output_dir", out,
             "--compilation_cache_dir", os.path.join(cache, "jax"), "--overlap_compile", overlap]
    if only_jax_cache:
        flags += ["--executable_cache_dir", "none", "--embeddings_cache", "none"]
    before = set(os.listdir(out)) if os.path.isdir(out) else set()
    t0 = time.time()
    subprocess.run([sys.executable, os.path.join(ROOT, "generate_flax.py"), *flags],
                   check=True, capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    wall = time.time() - t0
    (name,) = [n for n in set(os.listdir(out)) - before if n.endswith(".json")]
    with open(os.path.join(out, name)) as f:
        report = json.load(f)
    split = dict(report["timings"]["time_to_first_video"], wall_s=wall,
                 **{k: v for k, v in report["timings"].items() if k in OVERLAP})
    ex = report.get("executable_cache") or {}
    split["programs"] = f"{ex.get('programs_compiled')} / {ex.get('programs_loaded')}"
    hits = (report.get("embeddings_cache") or {}).get("videos")
    split["embeddings"] = "off" if hits is None else ("hit" if hits[0]["hit"] else "miss")
    return split


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_id", default=os.path.join(ROOT, "checkpoints", "tiny-wan"))
    p.add_argument("--repeats", type=int, default=1, help="cold/warm rounds, fresh caches each")
    p.add_argument("--overlap_compile", choices=("auto", "on", "off"), default="auto",
                   help="generate_flax.py's --overlap_compile for every process")
    args = p.parse_args(argv)
    rows = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="ttr-") as tmp:
            out = os.path.join(tmp, "out")
            os.makedirs(out)
            for label, only_jax in (("cold", False), ("warm, JAX cache only", True),
                                    ("warm, every cache", False)):
                rows.append((label, run_once(args.model_id, tmp, out, only_jax_cache=only_jax,
                                             overlap=args.overlap_compile)))
    header = ["phase (s)", *[label for label, _ in rows]]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key in (*PHASES, "wall_s", *OVERLAP):
        cells = [f"{r.get(key, 0.0):.2f}" for _, r in rows]
        print(f"| {key.removesuffix('_s').replace('_', ' ')} | " + " | ".join(cells) + " |")
    for key in ("programs", "embeddings"):
        print(f"| {key} | " + " | ".join(str(r[key]) for _, r in rows) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
