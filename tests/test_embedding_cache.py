"""The prompt-embedding cache keys each text apart (issue 64 item 2).

References: each family's pair encode (``family.text.encode_prompts``: diffusers'
``encode_prompt`` with the prompt and the negative together for Wan, per side for
HunyuanVideo-1.5, the connectors on the [negative, positive] batch for LTX-2), against which
``encode_text`` must be bitwise equal; separate single-prompt runs with the cache off, against
which a prompts file's videos must be equal; the first served job, against which a second job
from the cache must be equal. Encoder work is counted at the encoder's own forward (the rows
of text it is given), not at our functions.
"""

import json

import jax
import numpy as np
import pytest
import torch
from transformers import UMT5EncoderModel

import generate_flax
from engine.files.embeddings_cache import MemoryLRU
from engine.pipeline import generate, generation, prologue, stages
from engine.run.errors import UsageError
from engine.serve import model as served_model
from engine.serve.requests import VideoJob
from families import FAMILIES

SMALL = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "2",
         "--dtype", "float32", "--attention", "xla", "--warmup_steps", "1"]
NEGATIVE = "blurry, low quality"
PROMPTS = ["a red fox in the snow", "a blue bird", "a green frog on a leaf"]


@pytest.fixture
def encoded_rows(monkeypatch):
    """A list that gets one entry per text UMT5's forward encodes (its batch rows)."""
    rows: list = []
    original = UMT5EncoderModel.forward

    def counting(self, input_ids=None, *args, **kwargs):
        rows.extend(["text"] * int(input_ids.shape[0]))
        return original(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(UMT5EncoderModel, "forward", counting)
    return rows


def _config(checkpoint, *extra):
    return generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, *SMALL, "--compilation_cache_dir", "none", *extra]))


def test_memory_lru_evicts_the_least_recently_used_by_bytes():
    lru = MemoryLRU(100)
    a = {"x": torch.zeros(10, dtype=torch.float32)}  # 40 bytes
    b = {"x": torch.zeros(5, dtype=torch.float64), "m": torch.zeros(4, dtype=torch.int8)}  # 44
    c = {"x": torch.zeros(8, dtype=torch.bfloat16)}  # 16
    lru.put("a", a)
    lru.put("b", b)
    assert lru.bytes == 84
    assert lru.get("a") is a  # "a" is now the most recently used
    lru.put("c", c)  # 100: fits exactly
    assert lru.bytes == 100 and list(lru.entries) == ["b", "a", "c"]
    lru.put("d", {"x": torch.zeros(2, dtype=torch.float32)})  # 108 > 100: "b" goes
    assert list(lru.entries) == ["a", "c", "d"] and lru.bytes == 64
    assert lru.get("b") is None
    lru.put("a", c)  # replacing an entry counts its new size
    assert lru.bytes == 40
    lru.put("big", {"x": torch.zeros(26, dtype=torch.float32)})  # 104 > budget: not kept
    assert "big" not in lru.entries and lru.bytes == 40


@pytest.mark.parametrize("fixture", ["tiny_checkpoint", "hunyuan_checkpoint", "ltx2_checkpoint"])
def test_each_text_alone_equals_the_pair_encode_bitwise(request, fixture):
    """bfloat16, the default dtype. Measured: every tensor of both sides equal (0 off)."""
    config = _config(request.getfixturevalue(fixture), "--dtype", "bfloat16",
                     "--negative_prompt", 'ugly "glyph" text', "--guidance_scale", "5")
    family = FAMILIES[config.model.family]
    start = prologue.start(config, family, jax.devices()[:1])
    pipe, _ = start.load(())
    sides = family.text.prompt_sides(start.config)
    assert [p for p, _ in sides] == ["", "negative_"]
    alone = {p: family.text.encode_text(pipe, start.config, t) for p, t in sides}
    pair = family.text.encode_prompts(pipe, start.config)
    assert sorted(pair) == sorted(p + k for p, d in alone.items() for k in d)
    for prefix, tensors in alone.items():
        for name, t in tensors.items():
            assert t.dtype == pair[prefix + name].dtype
            assert torch.equal(t, pair[prefix + name]), prefix + name
    assert not torch.equal(alone[""]["prompt_embeds"], alone["negative_"]["prompt_embeds"])


def _prompts_run(checkpoint, tmp_path, cache):
    """A three-prompt file sharing --negative_prompt, in-process; ({label: frames}, report)."""
    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "seed": i + 1}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    config = _config(checkpoint, "--prompts_file", str(path), "--negative_prompt", NEGATIVE,
                     "--embeddings_cache", str(cache), "--output_dir", str(tmp_path / "out"))
    frames = {}

    def keep(video, f):
        frames[video.label] = f
        return []

    generate(config, FAMILIES[config.model.family], devices=jax.devices()[:1], on_video=keep)
    return frames


def _pair_encode(pipe, config, family, videos, cached=None, cache=None):
    """``stages.encode`` as it was: each video's prompt pair by ``encode_prompts``."""
    assert cache is None
    embeds = [family.text.encode_prompts(pipe, stages.for_video(config, v)) for v in videos]
    return embeds, 0.0, [False] * len(videos)


def test_prompts_file_encodes_the_shared_negative_once(tiny_checkpoint, tmp_path,
                                                       encoded_rows, monkeypatch):
    cache = tmp_path / "embeddings"
    frames = _prompts_run(tiny_checkpoint, tmp_path, cache)
    assert len(encoded_rows) == 4  # three prompts + one negative (the pair key encoded 6)
    assert len(list(cache.iterdir())) == 4
    # A second run finds every text: no encoder forward, the same frames.
    encoded_rows.clear()
    again = _prompts_run(tiny_checkpoint, tmp_path / "again", cache)
    assert encoded_rows == []
    for label in frames:
        np.testing.assert_array_equal(again[label], frames[label])
    # Each video equals a separate single run of its prompt, encoded by the pair path (the
    # family's encode_prompts, as before per-text keys) with the cache off (measured 0 off).
    monkeypatch.setattr(generation, "encode", _pair_encode)
    for index in (1, 2):
        config = _config(tiny_checkpoint, "--prompt", PROMPTS[index], "--seed", str(index + 1),
                         "--negative_prompt", NEGATIVE, "--embeddings_cache", "none",
                         "--output_dir", str(tmp_path / f"single{index}"))
        encoded_rows.clear()
        single, _ = generate(config, FAMILIES[config.model.family], devices=jax.devices()[:1])
        assert len(encoded_rows) == 2  # the pair path ran: prompt and negative
        np.testing.assert_array_equal(frames[str(index)], single)
        assert np.abs(frames[str(index)] - frames["0"]).max() > 0.05


def _job(prompt, seed):
    return VideoJob(prompt=prompt, negative_prompt=NEGATIVE, width=96, height=64, num_frames=9,
                    seconds="0.5", num_inference_steps=2, guidance_scale=5.0,
                    guidance_scale_2=None, seed=seed, fps=16, model="tiny-wan")


def test_served_jobs_take_their_texts_from_the_cache(tiny_checkpoint, tmp_path, encoded_rows):
    config = _config(tiny_checkpoint, "--serve", "--negative_prompt", NEGATIVE,
                     "--guidance_scale", "5", "--embeddings_cache", str(tmp_path / "emb"),
                     "--embedding_cache_bytes", str(64 << 20), "--output_dir", str(tmp_path))
    warm = served_model.build(config, FAMILIES[config.model.family], jax.devices()[:1])
    assert warm.cache.memory.max_bytes == 64 << 20
    encoded_rows.clear()  # the build encoded the default prompt and NEGATIVE
    first, _, t1, _ = warm.run("a", _job(PROMPTS[0], 7), None, lambda i, n: None)
    assert len(encoded_rows) == 1 and t1["text_cache_hit"] is False  # the negative was cached
    second, _, t2, _ = warm.run("b", _job(PROMPTS[0], 7), None, lambda i, n: None)
    assert len(encoded_rows) == 1 and t2["text_cache_hit"] is True  # no encoder call
    np.testing.assert_array_equal(second, first)
    assert first.std() > 0.01
    # Both texts in memory: 2 x (1, 512, 32) float32 from the build + the job's prompt.
    assert warm.cache.memory.bytes == 3 * 512 * 32 * 4


@pytest.mark.parametrize("argv,message", [
    (["--embedding_cache_bytes", "-1"], "--embedding_cache_bytes='-1': must be a whole number"),
    (["--embedding_cache_bytes", "1GB"], "--embedding_cache_bytes='1GB': must be a whole"),
])
def test_bad_embedding_cache_bytes_is_one_line(tiny_checkpoint, argv, message):
    with pytest.raises(UsageError) as e:
        _config(tiny_checkpoint, "--serve", *argv)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_embedding_cache_bytes_needs_serve(tiny_checkpoint):
    with pytest.raises(UsageError, match="--embedding_cache_bytes.*needs --serve"):
        _config(tiny_checkpoint, "--embedding_cache_bytes", "0")
