"""`mempo view`: the page's data from a run's files (written here by the run's own writers), bad run
directories as notes rather than tracebacks, and the page in a real headless Chromium. The page of a
real trained run, and re-scoring through a live scorer, are in tests/scenarios/test_train_e2e.py."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from services.config import AlgorithmConfig
from services.common.messages import TrajectoryBatch
from services.algorithm.advantages import compute_advantages
from services.learner.group_samples import decoded_group, group_records
from services.pipeline.evaluate import EPISODE_METRICS, EvalRun
from services.pipeline.report import write_report
from services.pipeline.runlog import RunLog
from services.pipeline.view import load_run, render, write_view
from tests.algorithm.test_advantages import _group, _scores
from tests.pipeline.browser import Browser

ROOT = Path(__file__).resolve().parents[2]


def _decode(ids):
    return " ".join(f"w{i}" for i in ids)


def _sample(uid, em, mem="<mem> Answer: Kalton </mem>"):
    block = {"p_mem": 0.8, "p_full": 0.6, "r_mem": 0.2, "retained": 1, "tokens": ["Kal", "ton"],
             "mem_logp": [-0.1, -2.5], "full_logp": [-0.2, -0.3], "mem_keep": [True, False], "full_keep": [True, True],
             "question_r_mem": [0.2, None]}
    return {"uid": uid, "question": "Where is Sudryl Dynamics based?", "golds": [["Kalton"]], "answer": "Kalton",
            "em": em, "finish": "answer",
            "turns": [{"response": "<think> x </think> <search> q </search>", "before": "<think> x </think> ",
                       "mem": "", "after": "<search> q </search>", "observation": "<information> doc </information>",
                       "problems": [], "action": "search", "memory_reward": None},
                      {"response": f"{mem} <answer> Kalton </answer>", "before": "", "mem": mem,
                       "after": " <answer> Kalton </answer>", "observation": "", "problems": [], "action": "answer",
                       "memory_reward": block}]}


def make_run(run_dir: Path, steps: int = 3) -> Path:
    """A run directory as `mempo train` + `mempo eval --report` write it (their own writers)."""
    (run_dir / "pipeline.yaml").parent.mkdir(parents=True, exist_ok=True)
    (run_dir / "pipeline.yaml").write_text("rollout:\n  memory_window: 1\ntrain:\n  steps: %d\n" % steps)
    log = RunLog(run_dir, tensorboard=False)
    batch = TrajectoryBatch(groups=[_group(["Kroumia", "Lagav"]), _group(["x", None])], policy_version=0)
    scores = _scores([(0, 1, 0.4), (1, 1, -0.2), (0, 2, 0.1)])
    adv = compute_advantages(batch, scores, AlgorithmConfig())
    for step in range(1, steps + 1):
        log.write_groups(step, [decoded_group(g, _decode) for g in group_records(batch, scores, adv, 2)])
        log.write("train", step, {"reward_mean": 0.1 * step, "scorer/r_mem_mean": 0.01 * step}, console=False)
    log.write("eval", steps, {"em": 0.5, "k1/em": 0.5}, console=False)
    log.close()
    runs = {}
    for name, ems in (("sft", [0.0, 1.0]), ("rl", [1.0, 1.0])):
        r = EvalRun()
        r.episodes[1] = [{"uid": f"test-{i}", "em": em, "f1": em, **{m: 1.0 for m in EPISODE_METRICS[2:]}}
                         for i, em in enumerate(ems)]
        r.samples[1] = [_sample(f"test-{i}", em) for i, em in enumerate(ems)]
        runs[name] = r
    write_report(run_dir, {n: r.table() for n, r in runs.items()}, runs=runs)
    return run_dir


def test_the_page_data_comes_from_the_runs_files(tmp_path):
    data = load_run(make_run(tmp_path / "run"))
    assert data["notes"] == []
    assert [r["step"] for r in data["metrics"]["train"]] == [1, 2, 3]
    assert list(data["eval"]) == ["sft", "rl"] and data["eval"]["rl"]["1"]["em"] == 1.0
    assert len(data["groups"]) == 6 and data["groups"][0]["episodes"][0]["turns"][1]["mem"] == "w0 w1 w2 w3"
    assert len(data["samples"]["sft"]["1"]) == 2
    assert {c["title"] for c in data["curves"]} >= {"outcome reward (train)", "held-out EM"}
    page = write_view(tmp_path / "run")
    assert page == tmp_path / "run" / "view.html"
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.read_text())  # nothing fetched: file:// works


def test_a_string_in_the_data_cannot_close_the_pages_script():
    html = render({"run_dir": "</script><script>alert(1)</script>", "notes": []})
    assert html.count("</script>") == 2  # the data block's and the page script's own
    assert "<\\/script><script>alert(1)<\\/script>" in html


@pytest.mark.parametrize("damage, note", [
    (lambda d: (d / "metrics.jsonl").write_text((d / "metrics.jsonl").read_text()[:-40]), "is not complete JSON"),
    (lambda d: (d / "eval.json").unlink(), "no eval.json"),
    (lambda d: (d / "eval.json").write_text("{\"sft\": "), "eval.json is not valid JSON"),
    (lambda d: (d / "groups.jsonl").unlink(), "no groups.jsonl"),
    (lambda d: (d / "samples.json").write_text("[1, 2]"), "samples.json is not a JSON object"),
    (lambda d: (d / "pipeline.yaml").write_text("rollout: {memory_window: 1}\ntrain: {steps: 9}\n"),
     "training reached step 3 of 9"),
])
def test_a_damaged_or_unfinished_run_gives_a_note_and_still_a_page(tmp_path, damage, note):
    run = make_run(tmp_path / "run")
    damage(run)
    data = load_run(run)
    assert any(note in n for n in data["notes"]), data["notes"]
    assert write_view(run).is_file()


def test_the_command_says_what_is_wrong_without_a_traceback(tmp_path):
    out = subprocess.run([sys.executable, "-m", "services.cli", "view", str(tmp_path / "nope")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "is not a directory" in out.stderr and "Traceback" not in out.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    out = subprocess.run([sys.executable, "-m", "services.cli", "view", str(empty)], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "wrote" in out.stdout
    assert "no metrics.jsonl" in (empty / "view.html").read_text()


def test_the_page_in_a_real_browser_shows_the_table_the_episodes_and_a_heat_map(tmp_path):
    run = make_run(tmp_path / "run")
    page = write_view(run)
    with Browser.start(tmp_path) as b:
        b.open(page.as_uri(), ready="document.body.dataset.ready === '1'")
        assert b.js("document.querySelectorAll('#eval-table tbody tr').length") == 2  # sft and rl at k=1
        assert b.js("document.querySelector('#eval-table tbody tr[data-policy=rl] td:nth-child(3)').textContent"
                    ).startswith("1.000")
        assert b.js("document.querySelectorAll('#curves .panel svg polyline').length") >= 2
        assert b.js("document.querySelectorAll('.episode-item').length") == 4  # 2 policies x 2 samples
        b.click("nav button[data-tab=episodes]")
        b.click(".episode-item[data-policy=rl]")
        assert b.js("document.querySelectorAll('#episode-detail .turn').length") == 2
        assert b.js("document.querySelectorAll('#episode-detail .heat .tok').length") == 4  # 2 tokens x 2 contexts
        assert b.js("document.querySelectorAll('#episode-detail .heat .tok.dropped').length") == 1
        head = b.js("document.querySelector('#episode-detail .turn[data-turn=\"2\"] h4').textContent")
        assert "R_mem +0.200" in head and "per question: Q1 +0.200 · Q2 not scored" in head
        saw = b.js("document.querySelector('#episode-detail .turn[data-turn=\"2\"] .context').textContent")
        assert "Where is Sudryl Dynamics based?" in saw and "<search> q </search>" in saw and "doc" in saw
        b.click("nav button[data-tab=groups]")
        assert b.js("document.querySelectorAll('.group-item').length") == 6
        b.click(".group-item")
        assert b.js("document.querySelectorAll('#groups .episode').length") == 2  # the group's n episodes
        assert "A_mem" in b.js("document.querySelector('#groups .block').textContent")
        assert b.screenshot(tmp_path / "view.png").stat().st_size > 10_000


def test_the_view_server_serves_the_page_and_says_when_no_scorer_answers(tmp_path):
    import http.client
    import threading

    from services.common.local_ray import free_ports
    from services.pipeline.view import make_server

    run = make_run(tmp_path / "run")
    closed = free_ports(1)[0]  # nothing listens there
    server = make_server(run, 0, f"http://127.0.0.1:{closed}/scorer/score")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]

    def request(method, path, body=None, headers=None):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()

    try:
        status, body = request("GET", "/")
        assert status == 200 and b'id="run-data"' in body
        assert request("GET", "/nope")[0] == 404 and request("POST", "/nope", b"{}")[0] == 404
        status, body = request("POST", "/api/score", b'{"question": "q", "memory": "m", "answer": "a"}',
                               {"content-type": "application/json"})
        assert status == 502 and b"no scorer at" in body and b"mempo serve --apps scorer" in body
        assert request("POST", "/api/score", b"", {"content-length": "0"})[0] == 400
        assert request("POST", "/api/score", b"x", {"content-length": "x"})[0] == 411
        assert request("POST", "/api/score", b"x", {"content-length": str(1 << 30)})[0] == 413
    finally:
        server.shutdown()
        server.server_close()
