#!/usr/bin/env bash
# Download into ./.whl (the current directory's repo root) the cp312 manylinux x86_64 wheels
# that the lent NVIDIA GPU machine lacks for generate_flax.py and benchmarks/realsize.py, so
# benchmarks/gpu_check.sh can install them there without a package index (the machine
# reaches nothing outside it).
#
# What the machine has (Python 3.12, torch 2.11 + CUDA 13, jax 0.11.2 with the CUDA 13 plugin,
# transformers, accelerate, safetensors, numpy, imageio, matplotlib, tqdm, prometheus-client,
# anyio, click, h11, httpx, huggingface-hub, pillow, regex, requests, setuptools) and what it
# lacks: ../shared/notes/gpu-device.md and the device tool's KINDS.md package list
# (2026-11-17). Missing, and imported when generate_flax.py starts: diffusers, torchax, the
# server's fastapi / starlette / pydantic (+ pydantic-core, annotated-types,
# typing-inspection, annotated-doc), uvicorn, python-multipart, opentelemetry-api (fastapi's
# telemetry), SQLAlchemy (the job store) and imageio-ffmpeg (engine/files/videos.py; a run
# that writes an mp4 checks for ffmpeg before loading). typing-extensions and sniffio travel
# too: pydantic 2.14 needs typing-extensions >= 4.14.1, and both are a few kB.
#
# Versions: requirements.txt's pins where it pins the name; otherwise what pip resolved for
# requirements.txt on the CPU host (2026-11-27), listed below. One exception:
# imageio-ffmpeg 0.5.1 instead of requirements.txt's 0.8.1, whose wheel carries a 172 MB
# ffmpeg 7 binary (68 MB zipped, over the device call's 64 MiB); 0.5.1 is the same API with a
# static ffmpeg 4.2.2 (27 MB zipped), enough to write the mp4.
#
# Usage (from the root of the checkout the device tool sends; writes ./.whl and adds /.whl/ to
# the repository's .git/info/exclude, shared by all its worktrees):
#     bash tools/gpu_wheels.sh
# Then checks every wheel's Requires-Dist: each (non-extra) requirement is another wheel here
# or a package the machine has (MACHINE_HAS below); exit 1 and a list otherwise.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
requirements="$here/requirements.txt"
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi

# NAME==VERSION for names requirements.txt does not pin (pip's resolution of it, 2026-11-27).
unpinned=(starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
          typing-inspection==0.4.5 annotated-doc==0.0.7 opentelemetry-api==1.45.2
          typing-extensions==4.16.0 sniffio==1.3.1)
# Names requirements.txt pins (the version is read from it).
pinned=(diffusers torchax fastapi uvicorn python-multipart sqlalchemy)
# Requirements the machine already satisfies (KINDS.md's list; not carried).
MACHINE_HAS="anyio click filelock h11 httpx huggingface-hub importlib-metadata numpy pillow
regex requests safetensors setuptools torch jax jaxlib transformers accelerate tqdm"

specs=("${unpinned[@]}" imageio-ffmpeg==0.5.1)
for name in "${pinned[@]}"; do
  line="$(grep -i -E "^${name}(\[[^]]*\])?==" "$requirements" | head -n 1 || true)"
  [[ -n "$line" ]] || { echo "gpu_wheels.sh: $name is not pinned in $requirements" >&2; exit 1; }
  specs+=("${name}==${line#*==}")
done

exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl

"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux2010_x86_64 --platform manylinux1_x86_64 -d .whl "${specs[@]}"

# One version of each name (two stop the whole install there), then the Requires-Dist check.
"$python" - "$MACHINE_HAS" <<'EOF'
import glob, re, sys, zipfile

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

wheels = {}
for path in sorted(glob.glob(".whl/*.whl")):
    name, version = path.split("/")[-1].split("-")[:2]
    wheels.setdefault(norm(name), []).append((version, path))
dupes = {n: [p for _, p in v] for n, v in wheels.items() if len(v) > 1}
if dupes:
    sys.exit(f"gpu_wheels.sh: more than one version in .whl: {dupes} (delete the old ones)")
have = set(norm(n) for n in sys.argv[1].split())
missing = []
for name, [(version, path)] in sorted(wheels.items()):
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:") or "extra ==" in line:
            continue
        req = line.split(":", 1)[1].strip()
        dep = norm(re.match(r"[A-Za-z0-9_.-]+", req).group(0))
        pin = re.search(r"==\s*([^,;\s]+)", req)
        if dep in wheels:
            if pin and wheels[dep][0][0] != pin.group(1):
                missing.append(f"{name} needs {req}, .whl has {wheels[dep][0][0]}")
        elif dep not in have:
            missing.append(f"{name} needs {req}")
if missing:
    sys.exit("gpu_wheels.sh: not carried and not on the machine:\n  " + "\n  ".join(missing))
print(f"{len(wheels)} wheels in .whl, every Requires-Dist carried or on the machine")
EOF
du -ch .whl/*.whl | tail -n 1
