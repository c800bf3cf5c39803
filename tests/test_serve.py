"""``generate_flax.py --serve`` on the tiny checkpoint, one served model for the module:
the official ``openai`` client, a load of 24 requests from 6 clients, a NaN job, a table of
bad requests, the API key, deleting, and the web page in headless Chromium.

Every video is checked against the CLI (``generate_flax.py --seeds ... --save_frames``, one
process with the same device count): the frames must be equal.
"""

import os
import shutil
import threading
import time

import httpx2
import numpy as np
import psutil
import pytest
from openai import OpenAI
from serve_util import (
    KEY,
    PROMPT,
    SETTINGS,
    Server,
    chromium,
    cli_frames,
    env,
    server_frames,
    wait_done,
)

NAN_PROMPT = "__force_nan__"
CLIENT_SEED = 7
LOAD_SEEDS = list(range(100, 124))  # 24 requests: 6 clients x 4
PAGE_SEED = 11


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    """(server, {seed: CLI frames}); the CLI runs while the server starts."""
    root = tmp_path_factory.mktemp("serve")
    cli = cli_frames(tiny_checkpoint, root / "cli", [CLIENT_SEED, PAGE_SEED, *LOAD_SEEDS])
    server = Server(["--model_id", tiny_checkpoint, *SETTINGS, "--api_key", KEY,
                     "--compilation_cache_dir", "none"], root / "out",
                    environ=env(1, GENERATE_FLAX_TEST_NAN_PROMPT=NAN_PROMPT)).start()
    try:
        health = server.wait_ready()
        assert health["status"] == "ready" and health["time_to_ready"]["compile_s"] > 0
        yield server, cli.result()
    finally:
        code = server.stop()
        assert code == 0, server.tail()


def test_openai_client(served):
    server, want = served
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    video = client.videos.create(prompt=PROMPT, model="tiny-wan", size="64x64",
                                 extra_body={"num_frames": 5, "num_inference_steps": 2,
                                             "seed": CLIENT_SEED})
    assert video.status == "queued" and video.id.startswith("video_")
    t0 = time.monotonic()
    while video.status not in ("completed", "failed") and time.monotonic() - t0 < 120:
        time.sleep(0.3)
        video = client.videos.retrieve(video.id)
    assert video.status == "completed", video
    assert video.progress == 100 and video.completed_at >= video.created_at
    extra = video.model_extra
    assert extra["seed"] == CLIENT_SEED and extra["num_frames"] == 5
    assert extra["timings"]["denoise_s"] > 0 and len(extra["timings"]["step_seconds"]) == 2
    mp4 = client.videos.download_content(video.id).read()
    assert mp4[4:8] == b"ftyp"
    with open(os.path.join(server.out, f"{video.id}.mp4"), "rb") as f:
        assert f.read() == mp4
    frames = server_frames(server.out, video.id)
    assert frames.shape == (5, 64, 64, 3) and frames.std() > 0.01
    np.testing.assert_array_equal(frames, want[CLIENT_SEED])
    listed = client.videos.list()
    assert video.id in [v.id for v in listed.data]


def test_load_24_requests_from_6_clients(served):
    server, want = served
    rss = psutil.Process(server.proc.pid)
    before = rss.memory_info().rss
    ids, errors = {}, []

    def client_thread(seeds):
        try:
            with server.client() as c:
                for seed in seeds:
                    r = c.post("/v1/videos", json={"prompt": PROMPT, "seed": seed})
                    assert r.status_code == 200, r.text
                    ids[r.json()["id"]] = seed
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=client_thread, args=(LOAD_SEEDS[i::6],))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(ids) == 24 and sorted(ids.values()) == LOAD_SEEDS  # none lost or duplicated
    with server.client() as c:
        done = wait_done(c, ids)
        assert all(j["status"] == "completed" for j in done.values()), done
        # Paged listing sees each exactly once.
        seen, after = [], None
        while True:
            page = c.get("/v1/videos", params={"limit": 10, "order": "asc",
                                               **({"after": after} if after else {})}).json()
            seen += [v["id"] for v in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert len(seen) == len(set(seen)) and set(ids) <= set(seen)
    for video_id, seed in ids.items():
        np.testing.assert_array_equal(server_frames(server.out, video_id), want[seed])
    after_rss = rss.memory_info().rss
    # 24 jobs must not grow the server: a leak of one video's arrays per job would show.
    assert after_rss < before + 150 * 2**20, (before, after_rss)


def test_nan_job_fails_and_the_next_succeeds(served):
    server, want = served
    with server.client() as c:
        bad = c.post("/v1/videos", json={"prompt": NAN_PROMPT, "seed": 1}).json()["id"]
        good = c.post("/v1/videos", json={"prompt": PROMPT, "seed": CLIENT_SEED}).json()["id"]
        done = wait_done(c, [bad, good])
    assert done[bad]["status"] == "failed"
    assert "NaN" in done[bad]["error"]["message"] and "\n" not in done[bad]["error"]["message"]
    assert done[good]["status"] == "completed"
    np.testing.assert_array_equal(server_frames(server.out, good), want[CLIENT_SEED])
    assert not os.path.exists(os.path.join(server.out, f"{bad}.mp4"))


BAD = [  # (request, status, words the message must hold)
    (dict(json={"prompt": "x", "colour": "red"}), 400, ["colour", "unknown field"]),
    (dict(json={"prompt": "x", "num_inference_steps": "many"}), 400,
     ["num_inference_steps", "'many'", "integer"]),
    (dict(json={"prompt": "x", "size": "1280x720"}), 400, ["size", "1280x720", "64x64"]),
    (dict(json={"prompt": "x", "size": "big"}), 400, ["size", "WIDTHxHEIGHT"]),
    (dict(json={"prompt": "x", "num_frames": 81}), 400, ["num_frames", "81", "served frames: 5"]),
    (dict(json={"prompt": "x", "seconds": "8"}), 400, ["seconds", "'8'", "served frames"]),
    (dict(json={"prompt": "x", "num_inference_steps": 0}), 400,
     ["num_inference_steps", "0", "1..1000"]),
    (dict(json={"prompt": "x", "seed": -1}), 400, ["seed", "-1"]),
    (dict(json={"prompt": "x", "guidance_scale": 1.0}), 400, ["guidance_scale", "> 1"]),
    (dict(json={"prompt": "x", "guidance_scale_2": 3.0}), 400, ["guidance_scale_2", "two-expert"]),
    (dict(json={"prompt": "x", "model": "sora-2"}), 400, ["model", "sora-2", "tiny-wan"]),
    (dict(json={"prompt": "   "}), 400, ["prompt", "empty"]),
    (dict(json={"prompt": "x" * 4001}), 400, ["prompt", "at most 4000"]),
    (dict(json={}), 400, ["prompt", "required"]),
    (dict(json=["a list"]), 400, ["body", "JSON object"]),
    (dict(content=b"{not json", headers={"Content-Type": "application/json"}), 400,
     ["body", "not valid JSON"]),
    (dict(content=b"prompt=x", headers={"Content-Type": "text/plain"}), 400,
     ["Content-Type", "text/plain"]),
    (dict(data={"prompt": "x"}, files={"input_reference": ("a.png", b"not an image")}), 400,
     ["input_reference", "a.png", "not an image"]),
    (dict(data={"prompt": "x"}, files={"input_reference": ("a.png", b"0" * (21 * 2**20))}),
     413, ["input_reference", "at most"]),
]


def test_bad_requests_get_one_line_errors(served, tmp_path):
    server, _ = served
    png = tmp_path / "frame.png"
    shutil.copy(os.path.join(os.path.dirname(__file__), "data", "first_frame.png"), png)
    table = [*BAD, (dict(data={"prompt": "x"}, files={"input_reference": ("f.png",
                                                                          png.read_bytes())}),
                    400, ["input_reference", "text-to-video"])]
    with server.client() as c:
        for request, status, words in table:
            r = c.post("/v1/videos", **request)
            assert r.status_code == status, (request, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
            for word in words:
                assert word in error["message"], (word, error)
        assert c.get("/v1/videos", params={"limit": 0}).status_code == 400
        assert "limit" in c.get("/v1/videos", params={"limit": "x"}).json()["error"]["message"]
        assert c.get("/v1/videos/video_123/content").status_code == 404
    assert httpx2.get(server.url + "/health").json()["status"] == "ready"


def test_api_key_and_ids(served):
    server, _ = served
    with server.client(key=None) as anonymous:
        assert anonymous.get("/health").status_code == 200
        assert anonymous.get("/").status_code == 200
        r = anonymous.post("/v1/videos", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert anonymous.get("/v1/videos").status_code == 401
    with server.client(key="wrong") as wrong:
        assert wrong.get("/v1/models").status_code == 401
    with server.client() as c:
        models = c.get("/v1/models").json()["data"]
        assert models[0]["id"] == "tiny-wan" and models[0]["sizes"] == ["64x64"]
        assert models[0]["frames"] == [5]
        for bad_id in ("..%2Fjobs.sqlite3", "..%2F..%2Fetc%2Fpasswd", "video_..",
                       "video_" + "0" * 31 + "%2F", "jobs.sqlite3"):
            for path in (f"/v1/videos/{bad_id}", f"/v1/videos/{bad_id}/content"):
                assert c.get(path).status_code == 404, path
            assert c.delete(f"/v1/videos/{bad_id}").status_code == 404
        assert c.get("/v1/videos/../jobs.sqlite3").status_code == 404


def test_delete(served):
    server, _ = served
    with server.client() as c:
        video_id = c.post("/v1/videos", json={"prompt": PROMPT, "seed": 3}).json()["id"]
        wait_done(c, [video_id])
        files = [f for f in os.listdir(server.out) if f.startswith(video_id)]
        assert len(files) == 2  # mp4 and frames
        r = c.delete(f"/v1/videos/{video_id}")
        assert r.status_code == 200 and r.json()["deleted"] is True
        assert not [f for f in os.listdir(server.out) if f.startswith(video_id)]
        assert c.get(f"/v1/videos/{video_id}").status_code == 404


def test_web_page_in_headless_chromium(served, tmp_path):
    driver = chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    server, want = served
    try:
        driver.get(server.url + "/")
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.execute_script("document.getElementById('key').dispatchEvent(new Event('change'))")
        wait = WebDriverWait(driver, 120, poll_frequency=0.2)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#size option"))
        assert Select(driver.find_element(By.ID, "size")).first_selected_option.text == "64x64"
        driver.find_element(By.ID, "prompt").send_keys(PROMPT)
        driver.find_element(By.ID, "seed").send_keys(str(PAGE_SEED))
        with server.client() as c:  # every job so far (the page may not list them yet)
            known = {v["id"] for v in c.get("/v1/videos", params={"limit": 100}).json()["data"]}
        driver.find_element(By.ID, "submit").click()
        bar = wait.until(lambda d: [e for e in d.find_elements(By.CSS_SELECTOR, "progress")
                                    if e.get_attribute("data-id") not in known])[0]
        video_id = bar.get_attribute("data-id")
        seen = set()

        def finished(_) -> bool:  # one read per poll: the bar may move between two reads
            value = int(float(bar.get_attribute("value")))
            seen.add(value)
            return value == 100

        wait.until(finished)
        video = wait.until(lambda d: d.find_element(By.CSS_SELECTOR,
                                                    f"video[data-id='{video_id}']"))
        # Playable: the browser decoded the mp4's metadata and its first frame.
        wait.until(lambda d: d.execute_script("return arguments[0].readyState", video) >= 2)
        assert driver.execute_script("return arguments[0].duration", video) > 0
        assert driver.execute_script("return arguments[0].videoWidth", video) == 64
        head = driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(arguments[0]).then(r => r.arrayBuffer()).then(b => done("
            "Array.from(new Uint8Array(b.slice(4, 8)))))", video.get_attribute("src"))
        assert bytes(head) == b"ftyp"
        driver.save_screenshot(str(tmp_path / "page.png"))
        assert (tmp_path / "page.png").stat().st_size > 0
    finally:
        driver.quit()
    with server.client() as c:
        job = c.get(f"/v1/videos/{video_id}").json()
    assert (job["prompt"], job["seed"], job["status"]) == (PROMPT, PAGE_SEED, "completed")
    np.testing.assert_array_equal(server_frames(server.out, video_id), want[PAGE_SEED])
    assert 100 in seen
