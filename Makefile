# Quickstart: `make demo` (tiny checkpoint, CPU) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TINY := checkpoints/tiny-wan
TINY_HY := checkpoints/tiny-hunyuan15
TINY_LTX2 := checkpoints/tiny-ltx2
# Tests and the demo stay on the CPU; 8 host devices let the mesh tests shard for real.
CPU_ENV := JAX_PLATFORMS=cpu
TEST_ENV := $(CPU_ENV) XLA_FLAGS=--xla_force_host_platform_device_count=8
# A newer libtpu for deviceless tpu7x compiles and static profiles only, installed apart from
# the pinned one that real runs load (engine/run/runtime.py: PROFILE_LIBTPU_VERSION).
LIBTPU_PROFILE := 0.0.51
PROFILE_STAMP := $(VENV)/libtpu-next/.installed-$(LIBTPU_PROFILE)

.PHONY: demo demo-hunyuan demo-ltx2 demo-i2v serve-demo browser postgres test test-all lint venv checkpoint clean

venv: $(STAMP) $(PROFILE_STAMP)

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

$(PROFILE_STAMP): $(STAMP)
	rm -rf $(VENV)/libtpu-next
	$(PY) -m pip install --quiet --no-deps --target $(VENV)/libtpu-next libtpu==$(LIBTPU_PROFILE)
	touch $(PROFILE_STAMP)

checkpoint: $(TINY)/model_index.json

$(TINY)/model_index.json: $(STAMP) tools/make_tiny_checkpoint.py tools/tiny_checkpoint.py
	$(CPU_ENV) $(PY) tools/make_tiny_checkpoint.py --output $(TINY) --force

demo: $(STAMP) $(TINY)/model_index.json
	$(CPU_ENV) $(PY) generate_flax.py --model_id $(TINY) --height 64 --width 96 --frames 17 \
		--num_inference_steps 8 --num_iterations 2 --output_dir outputs

$(TINY_HY)/model_index.json: $(STAMP) tools/make_tiny_hunyuan_checkpoint.py tools/tiny_checkpoint.py
	$(CPU_ENV) $(PY) tools/make_tiny_hunyuan_checkpoint.py --output $(TINY_HY) --force

# HunyuanVideo-1.5 on its tiny checkpoint: a quoted word takes the ByT5 glyph path too.
demo-hunyuan: $(STAMP) $(TINY_HY)/model_index.json
	$(CPU_ENV) $(PY) generate_flax.py --model_id $(TINY_HY) --height 48 --width 80 --frames 17 \
		--prompt 'A neon sign that says "OPEN" above a rainy street' \
		--num_inference_steps 8 --num_iterations 2 --output_dir outputs

$(TINY_LTX2)/model_index.json: $(STAMP) tools/make_tiny_ltx2_checkpoint.py tools/tiny_checkpoint.py
	$(CPU_ENV) $(PY) tools/make_tiny_ltx2_checkpoint.py --output $(TINY_LTX2) --force

# LTX-2: video with its sound (an AAC track in the mp4), the pipeline's default guidance.
demo-ltx2: $(STAMP) $(TINY_LTX2)/model_index.json
	$(CPU_ENV) $(PY) generate_flax.py --model_id $(TINY_LTX2) --height 64 --width 96 --frames 17 \
		--prompt "Rain falls on a neon street at night; a car horn sounds" \
		--num_inference_steps 8 --num_iterations 1 --output_dir outputs

TINY_I2V := checkpoints/tiny-wan-i2v

$(TINY_I2V)/model_index.json: $(STAMP) tools/make_tiny_checkpoint.py tools/tiny_checkpoint.py
	$(CPU_ENV) $(PY) tools/make_tiny_checkpoint.py --i2v --output $(TINY_I2V) --force

# Wan 2.1 image-to-video on its tiny checkpoint (CLIP image encoder), from the shipped image.
demo-i2v: $(STAMP) $(TINY_I2V)/model_index.json
	$(CPU_ENV) $(PY) generate_flax.py --model_id $(TINY_I2V) --image tests/data/first_frame.png \
		--height 64 --width 96 --frames 17 --num_inference_steps 8 --num_iterations 2 \
		--output_dir outputs

# The OpenAI /v1/videos server and its web page (http://127.0.0.1:8000/) on the tiny checkpoint:
# two sizes compiled at start; Ctrl-C stops it. docs/serving.md.
serve-demo: $(STAMP) $(TINY)/model_index.json
	$(CPU_ENV) $(PY) generate_flax.py --serve --model_id $(TINY) --serve_sizes 96x64,64x64 \
		--serve_frames 17 --num_inference_steps 8 --output_dir outputs/serve

# Debian's Chromium and its driver, for the web page's test (tests/test_serve.py); needs root
# or sudo. CI runs it (.ci/run); elsewhere that test is skipped without them.
browser:
	@command -v chromedriver >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq chromium chromium-driver; }

# A throwaway PostgreSQL cluster on 127.0.0.1:54329 for the shared job store's tests (installs
# Debian's postgresql if missing). Then: export GENERATE_FLAX_TEST_POSTGRES=... as printed, or
# eval "$$(tools/postgres.sh start)"; CI does this (.ci/run). Without it those tests skip.
postgres:
	tools/postgres.sh start

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# CI's tier: everything but the heavy tests (tests/conftest.py SLOW), about 20 min on 2 cores.
test: lint $(PROFILE_STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist loadfile --durations=25 -m "not slow"

# Every test, the heavy tier included (about 50 min on the 2-core host).
test-all: lint $(PROFILE_STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n 2 --dist loadfile --durations=25

clean:
	rm -rf $(VENV) $(TINY) $(TINY_HY) $(TINY_LTX2) $(TINY_I2V) outputs
