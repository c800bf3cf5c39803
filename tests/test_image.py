"""--image: bad files are refused in one line before any model loads, and nothing is written."""

import hashlib
import os

import numpy as np
import pytest
from PIL import Image

import generate_flax
from engine.files.image import check_image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_FRAME = os.path.join(ROOT, "tests", "data", "first_frame.png")


def _truncated(path):
    data = open(FIRST_FRAME, "rb").read()
    path.write_bytes(data[: len(data) // 2])


def _text(path):
    path.write_text("not a picture\n")


def _one_pixel(path):
    Image.new("RGB", (1, 1), (255, 0, 0)).save(path)


def _grey16(path):
    Image.fromarray(np.full((32, 32), 40000, np.uint16)).save(path)


BAD_IMAGE = [
    ("missing file", None, "file not found"),
    ("truncated file", _truncated, "image file is truncated"),
    ("text file named .png", _text, "not an image PIL can read"),
    ("1x1 image", _one_pixel, "expected at least 16x16 pixels, got 1x1"),
    ("16-bit grey PNG", _grey16, "expected an 8-bit image (RGB, RGBA, grey or palette), got "
                                 "PIL mode I;16"),
]


@pytest.mark.parametrize("case,make,rule", BAD_IMAGE, ids=[b[0] for b in BAD_IMAGE])
def test_bad_image_is_one_line_before_loading(tiny_checkpoint, tmp_path, capsys, case, make,
                                              rule):
    image, out = tmp_path / "image.png", tmp_path / "out"
    if make is not None:
        make(image)
    code = generate_flax.cli(["--model_id", tiny_checkpoint, "--image", str(image),
                              "--output_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"--image={str(image)!r}" in err[0] and rule in err[0], err[0]
    assert not out.exists() or not os.listdir(out)


def test_image_for_a_text_to_video_checkpoint_is_refused(tiny_checkpoint, tmp_path, capsys):
    code = generate_flax.cli(["--model_id", tiny_checkpoint, "--image", FIRST_FRAME,
                              "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "is a text-to-video checkpoint" in err[0], err[0]


def test_check_image_records_size_mode_and_hash():
    info = check_image(FIRST_FRAME)
    assert (info.width, info.height, info.format, info.mode) == (160, 96, "PNG", "RGB")
    assert info.sha256 == hashlib.sha256(open(FIRST_FRAME, "rb").read()).hexdigest()
