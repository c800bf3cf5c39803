"""``generate_flax.py --serve`` on the tiny Wan 2.1 I2V checkpoint: each job sends its own
first frame as ``input_reference`` (a multipart file, or a base64 data URL), and its frames
equal the CLI's ``--image`` run with the same seed and settings, bit for bit.

Two jobs with different images run one after the other on encoders placed once (the image
encoder in host RAM, the VAE encoder on the devices): the second one is the case a per-call
placement broke (``DeviceEncode`` freed the host weights as it placed them).
"""

import base64
import hashlib
import os

import httpx2
import numpy as np
import pytest
from openai import OpenAI
from PIL import Image
from serve_util import ROOT, SETTINGS, Server, chromium, cli_frames, server_frames, wait_done

PROMPT = "a red fox jumps"
FRAME_A = os.path.join(ROOT, "tests", "data", "first_frame.png")  # 160x96 PNG
SEEDS_A, SEED_B = (21, 23, 24), 22  # A: the client, the data URLs, the page


def _frame_b(path) -> str:
    """Another picture: a 120x72 RGB JPEG of noise over a gradient (seeded)."""
    rng = np.random.default_rng(5)
    x = np.linspace(0, 255, 120)[None, :, None] * np.ones((72, 1, 3))
    pixels = np.clip(x * [1.0, 0.4, 0.1] + rng.normal(0, 40, (72, 120, 3)), 0, 255)
    Image.fromarray(pixels.astype(np.uint8)).save(path, format="JPEG", quality=90)
    return str(path)


@pytest.fixture(scope="module")
def served(i2v_checkpoint, tmp_path_factory):
    """(server, frame B's path, {(image, seed): CLI frames}); the two CLI runs (one per
    image, ``--image`` and ``--seeds``) run while the server starts."""
    root = tmp_path_factory.mktemp("serve-i2v")
    frame_b = _frame_b(root / "frame_b.jpg")
    runs = {"A": cli_frames(i2v_checkpoint, root / "cli_a", SEEDS_A, "--image", FRAME_A,
                            prompt=PROMPT),
            "B": cli_frames(i2v_checkpoint, root / "cli_b", [SEED_B], "--image", frame_b,
                            prompt=PROMPT)}
    server = Server(["--model_id", i2v_checkpoint, *SETTINGS, "--compilation_cache_dir",
                     "none"], root / "out").start()
    try:
        health = server.wait_ready()
        assert health["time_to_ready"]["buckets"]["64x64x5"]["image_encode_s"] > 0
        want = {(name, seed): frames for name, run in runs.items()
                for seed, frames in run.result().items()}
        yield server, frame_b, want
    finally:
        assert server.stop() == 0, server.tail()


def _done(client: OpenAI, video):
    with httpx2.Client(base_url=str(client.base_url).removesuffix("/v1/")) as c:
        return wait_done(c, [video.id])[video.id]


def test_two_images_through_the_openai_client(served):
    """``client.videos.create(..., input_reference=open(png, "rb"))``, twice, one image
    each: frames equal the CLI's --image runs."""
    server, frame_b, want = served
    client = OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert client.models.list().data[0].model_extra["image_mode"] == "required"
    jobs = {}
    for name, path, seed in (("A", FRAME_A, SEEDS_A[0]), ("B", frame_b, SEED_B)):
        with open(path, "rb") as f:
            video = client.videos.create(prompt=PROMPT, size="64x64", input_reference=f,
                                         extra_body={"seed": seed})
        job = _done(client, video)  # sequential: the second runs after the first is done
        assert job["status"] == "completed", job
        assert job["timings"]["image_encode_s"] > 0
        with open(path, "rb") as f:
            assert job["input_reference"]["sha256"] == hashlib.sha256(f.read()).hexdigest()
        frames = server_frames(server.out, video.id)
        assert frames.shape == (5, 64, 64, 3) and frames.std() > 0.01
        np.testing.assert_array_equal(frames, want[(name, seed)])
        jobs[name] = video.id
    # The images matter: the two CLI videos differ by far more than rounding.
    assert np.abs(want[("A", SEEDS_A[0])] - want[("B", SEED_B)]).max() > 0.05
    # Deleting a job removes its stored image with its outputs.
    assert any(f.startswith(jobs["B"] + ".input.") for f in os.listdir(server.out))
    assert httpx2.delete(f"{server.url}/v1/videos/{jobs['B']}").status_code == 200
    assert not [f for f in os.listdir(server.out) if f.startswith(jobs["B"])]


def test_data_url_reference(served):
    """OpenAI's reference object ``{"image_url": "data:image/png;base64,..."}`` in a JSON
    body: the same frames as the file (the pinned client sends only files)."""
    server, _, want = served
    with open(FRAME_A, "rb") as f:
        url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    with httpx2.Client(base_url=server.url) as c:
        r = c.post("/v1/videos", json={"prompt": PROMPT, "seed": SEEDS_A[1],
                                       "input_reference": {"image_url": url}})
        assert r.status_code == 200, r.text
        job = wait_done(c, [r.json()["id"]])[r.json()["id"]]
    assert job["status"] == "completed", job
    np.testing.assert_array_equal(server_frames(server.out, job["id"]), want[("A", SEEDS_A[1])])


def test_bad_image_requests(served, tmp_path):
    server, _, _ = served
    small = tmp_path / "small.png"
    Image.new("RGB", (8, 8)).save(small)
    png = "data:image/png;base64," + base64.b64encode(small.read_bytes()).decode()
    table = [  # (request, status, words the message must hold)
        (dict(json={"prompt": "x"}), 400, ["input_reference", "required", "image-to-video"]),
        (dict(data={"prompt": "x"}), 400, ["input_reference", "required"]),
        (dict(data={"prompt": "x"}, files={"input_reference": ("a.png", b"not an image")}),
         400, ["input_reference", "a.png", "not an image"]),
        (dict(data={"prompt": "x"}, files={"input_reference": ("s.png", small.read_bytes())}),
         400, ["input_reference", "s.png", "at least 16x16"]),
        (dict(json={"prompt": "x", "input_reference": "frame.png"}), 400,
         ["input_reference", "frame.png", "reference object"]),
        (dict(data={"prompt": "x", "input_reference": "frame.png"}), 400,
         ["input_reference", "a string is not an image"]),
        (dict(json={"prompt": "x", "input_reference": {"image_url": png, "detail": "hi"}}),
         400, ["input_reference.detail", "unknown field"]),
        (dict(json={"prompt": "x", "input_reference": {"image_url": "https://a.b/c.png"}}),
         400, ["input_reference.image_url", "fetches nothing"]),
        (dict(json={"prompt": "x", "input_reference": {"file_id": "file-1"}}), 400,
         ["input_reference.file_id", "no Files API"]),
        (dict(json={"prompt": "x", "input_reference": {"image_url": "data:image/png;base64,"
                                                                   "@@@"}}), 400,
         ["input_reference.image_url", "base64"]),
        (dict(json={"prompt": "x", "input_reference": {"image_url": png}}), 400,
         ["input_reference", "at least 16x16"]),
    ]
    with httpx2.Client(base_url=server.url, timeout=60) as c:
        before = len(c.get("/v1/videos", params={"limit": 100}).json()["data"])
        for request, status, words in table:
            r = c.post("/v1/videos", **request)
            assert r.status_code == status, (request, r.text)
            error = r.json()["error"]
            assert "\n" not in error["message"] and error["param"].startswith(
                "input_reference"), error
            for word in words:
                assert word in error["message"], (word, error)
        assert c.get("/health").json()["status"] == "ready"
        # No refused request left a job (or an image file) behind.
        assert len(c.get("/v1/videos", params={"limit": 100}).json()["data"]) == before


def test_web_page_sends_the_image(served, tmp_path):
    """The page shows its image input for an image-to-video model and sends the file as
    ``input_reference``: the job's frames equal the CLI's."""
    driver = chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    server, _, want = served
    try:
        driver.get(server.url + "/")
        wait = WebDriverWait(driver, 120, poll_frequency=0.2)
        wait.until(lambda d: d.find_element(By.ID, "image").is_displayed())
        driver.find_element(By.ID, "prompt").send_keys(PROMPT)
        driver.find_element(By.ID, "seed").send_keys(str(SEEDS_A[2]))
        driver.find_element(By.ID, "image").send_keys(FRAME_A)
        with httpx2.Client(base_url=server.url) as c:
            known = {v["id"] for v in c.get("/v1/videos", params={"limit": 100}).json()["data"]}
        driver.find_element(By.ID, "submit").click()
        bar = wait.until(lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, "progress")
                                    if e.get_attribute("data-id") not in known])[0]
        video_id = bar.get_attribute("data-id")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f"video[data-id='{video_id}']"))
        driver.save_screenshot(str(tmp_path / "page.png"))
    finally:
        driver.quit()
    np.testing.assert_array_equal(server_frames(server.out, video_id), want[("A", SEEDS_A[2])])
