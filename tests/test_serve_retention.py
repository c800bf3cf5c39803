"""``--retention_hours`` on a real ``generate_flax.py --serve`` (tiny checkpoint, CPU): an
ended job's ``expires_at`` is its ``completed_at`` plus the retention; past it the sweeper
removes its files and its status becomes ``expired`` (its content is then a 409)."""

import os
import time

import pytest
from serve_util import KEY, PROMPT, SETTINGS, Server, env, wait_done

RETENTION_H = 0.0005  # 1.8 s


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("retention")
    server = Server(["--model_id", tiny_checkpoint, *SETTINGS, "--api_key", KEY,
                     "--compilation_cache_dir", "none", "--retention_hours", str(RETENTION_H)],
                    root / "out", environ=env(1)).start()
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.tail()


def test_a_finished_video_expires_and_its_files_go(served):
    with served.client() as c:
        job = c.post("/v1/videos", json=dict(prompt=PROMPT, size="64x64", seed=4)).json()
        assert job["expires_at"] is None  # not ended yet
        done = wait_done(c, [job["id"]])[job["id"]]
        assert done["status"] == "completed"
        assert done["expires_at"] == int(done["completed_at"] + RETENTION_H * 3600)
        files = [os.path.join(served.out, name) for name in done["files"]]
        assert files and all(os.path.exists(p) for p in files)
        t0 = time.monotonic()
        while (end := c.get(f"/v1/videos/{job['id']}").json())["status"] != "expired":
            assert time.monotonic() - t0 < 30, end
            time.sleep(0.2)
        assert not any(os.path.exists(p) for p in files)
        r = c.get(f"/v1/videos/{job['id']}/content")
        assert r.status_code == 409 and "expired" in r.json()["error"]["message"]
