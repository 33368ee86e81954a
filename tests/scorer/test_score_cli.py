"""`mempo score` against the real scorer over Serve's HTTP proxy: a file graded with requests in
flight, killed mid-run and run again: every line once, in order, each answer the one a single
request gets."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytestmark = pytest.mark.slow
LINES = 400


def test_a_killed_run_goes_on_and_every_line_is_graded_once(scorer_service, tmp_path):
    _, url, _ = scorer_service
    inp, out = tmp_path / "memories.jsonl", tmp_path / "graded.jsonl"
    with inp.open("w") as f:
        for i in range(LINES):
            f.write(json.dumps({"id": i, "question": f"Where was Person {i % 17} born?", "history": [],
                                "memory": f"Person {i % 17} was born in City {i % 5}.", "answer": f"City {i % 5}"}) + "\n")
    cmd = [sys.executable, "-m", "services.cli", "score", str(inp), str(out), "--url", url, "--concurrency", "4",
           "--quiet"]
    env = dict(os.environ, MEMPO_API_TOKEN="")
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and first.poll() is None:
        if out.exists() and out.read_bytes().count(b"\n") >= 20:
            first.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    first.wait(30)
    at_kill = out.read_bytes().count(b"\n")
    assert first.returncode == -signal.SIGKILL and 20 <= at_kill < LINES, (first.returncode, at_kill)
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr
    assert f"{LINES - at_kill} lines" in second.stdout and f"{at_kill} already done" in second.stdout
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == list(range(LINES)) == [r["id"] for r in rows]
    assert all(r["status"] == 200 for r in rows)
    for i in (0, at_kill - 1, at_kill, LINES - 1):  # each answer is what one request alone gets
        body = {k: v for k, v in json.loads(inp.read_text().splitlines()[i]).items() if k != "id"}
        alone = httpx.post(f"{url}/score", json=body, timeout=60).json()
        assert {k: rows[i][k] for k in alone} == alone
