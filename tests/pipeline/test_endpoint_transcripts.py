"""`mempo data transcripts --endpoint`: MemPO transcripts played by an OpenAI-compatible endpoint, here a
stub server started in the test on 127.0.0.1 (port 0) that answers /v1/chat/completions with scripted
MemPO turns: a <search> first, an <answer> (with <mem>) once the context ends on an <information>
message. No remote calls; no Ray, no model."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.pipeline import endpoint_agent as ea
from services.pipeline.data_cli import main
from services.pipeline.sft import load_transcripts
from services.rollout.settings import DEFAULT_SYSTEM_PROMPT as SYSTEM

DOC_FORMAT = "Doc {i} (Title: {title}) {text}"
PASSAGES = [{"id": "1", "contents": '"Acme"\nAcme was founded by Ann Lee. Acme is based in Oslo.'}]
ANSWERS = {"Who founded Acme?": "Ann Lee", "Where is Acme based?": "Paris"}  # the second is wrong (gold: Oslo)
ROWS = [{"id": "right", "question": "Who founded Acme?", "answers": ["Ann Lee"]},
        {"id": "wrong", "question": "Where is Acme based?", "answers": ["Oslo"]},
        {"id": "both", "question": ["Who founded Acme?", "Where is Acme based?"], "answers": [["Ann Lee"], ["Oslo"]]}]


class Stub:
    """The scripted model. ``fail`` = statuses to answer before the next 200s; ``keep_stop`` = leave the
    stop string in the text (vLLM's include_stop_str_in_output) instead of OpenAI's dropping it."""

    def __init__(self):
        self.requests: list[dict] = []
        self.fail: list[int] = []
        self.keep_stop = False
        self.delay = 0.0
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()

    def turn(self, messages: list[dict]) -> str:
        question, last = messages[1]["content"], messages[-1]
        if "malformed" in question:
            return "I think the answer is 42."  # no action at all
        if last["role"] == "user" and last["content"].startswith("<information>"):
            # turn 1 searched once; "twice" questions search again (the stub sees only the latest step)
            if "twice" in question and "<mem>" not in messages[-2]["content"]:
                return "<mem>\nSearched once.\n</mem>\n<think>\nOnce more.\n</think>\n<search> again </search>"
            answer = "; ".join(ANSWERS.get(q, "unknown") for q in question.split("; "))
            return (f"<mem>\nQ: {question}\n- Answer: {answer}\n</mem>\n<think>\nFound it.\n</think>\n"
                    f"<answer> {answer} </answer>")
        return f"<think>\nI will search.\n</think>\n<search> {question} </search>"


@pytest.fixture
def stub():
    s = Stub()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, status: int, body: dict):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with s.lock:
                s.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                status = s.fail.pop(0) if s.fail else 200
                s.in_flight += 1
                s.max_in_flight = max(s.max_in_flight, s.in_flight)
            try:
                time.sleep(s.delay)
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                if status != 200:
                    return self._send(status, {"error": {"message": "scripted failure"}})
                text = s.turn(body["messages"])
                if not s.keep_stop:  # OpenAI's rule: the matched stop string is not in the text
                    for stop in body["stop"]:
                        text = text[: -len(stop)] if text.endswith(stop) else text
                self._send(200, {"id": "x", "object": "chat.completion", "model": body["model"],
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": text}}]})
            finally:
                with s.lock:
                    s.in_flight -= 1

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    s.url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    yield s
    server.shutdown()
    server.server_close()


def _run(stub, tmp_path, rows=ROWS, **kw):
    ep = ea.Endpoint(stub.url, "stub-model", kw.pop("api_key", None), temperature=0.5, backoff_s=0.01,
                     retries=kw.pop("retries", 3))
    out = tmp_path / "sft.jsonl"
    counts = ea.write_endpoint_transcripts(rows, ep, SYSTEM, lambda q: PASSAGES, out, DOC_FORMAT,
                                           max_turns=kw.pop("max_turns", 4), **kw)
    return counts, {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}, out


def test_endpoint_transcripts_score_right_and_wrong_answers_and_sft_reads_them(stub, tmp_path):
    counts, rows, out = _run(stub, tmp_path)
    assert counts == {"episodes": 3, "written": 3, "em_1": 1, "invalid": 0, "max_turns": 0, "format_problems": 0}
    assert (rows["right"]["em"], rows["wrong"]["em"], rows["both"]["em"]) == (1.0, 0.0, 0.5)
    msgs = rows["right"]["messages"]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    assert msgs[0]["content"] == SYSTEM and msgs[1]["content"] == "Who founded Acme?"
    assert msgs[2]["content"].endswith("<search> Who founded Acme? </search>")  # stop string put back
    assert msgs[3]["content"] == ("<information>\nDoc 1 (Title: Acme) Acme was founded by Ann Lee. "
                                  "Acme is based in Oslo.\n</information>")
    assert msgs[4]["content"].startswith("<mem>") and msgs[4]["content"].endswith("<answer> Ann Lee </answer>")
    assert rows["both"]["messages"][1]["content"] == "Who founded Acme?; Where is Acme based?"
    assert all(r["finish"] == "answer" and r["format_ok"] for r in rows.values())
    # what was sent: the model, the sampling settings, stop at both actions, no key
    req = stub.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["body"]["model"] == "stub-model"
    assert req["body"]["stop"] == ["</search>", "</answer>"] and req["body"]["temperature"] == 0.5
    assert all("authorization" not in {k.lower() for k in r["headers"]} for r in stub.requests)
    # SFT reads the file; train.sft_min_em filters it (rejection sampling)
    assert len(load_transcripts(out, 1.0, SYSTEM)) == 1
    assert len(load_transcripts(out, 0.5, SYSTEM)) == 2
    assert len(load_transcripts(out, 0.0, SYSTEM)) == 3


def test_stop_strings_kept_by_the_server_are_not_doubled(stub, tmp_path):
    stub.keep_stop = True
    _, rows, _ = _run(stub, tmp_path, rows=ROWS[:1])
    msgs = rows["right"]["messages"]
    assert msgs[2]["content"].endswith("Acme? </search>") and msgs[-1]["content"].endswith("Ann Lee </answer>")
    assert rows["right"]["em"] == 1.0


def test_restore_stop_cases():
    stop = ("</search>", "</answer>")
    assert ea.restore_stop("<think>\nx\n</think>\n<search> q ", stop, "stop") == ("<think>\nx\n</think>\n"
                                                                                 "<search> q </search>")
    assert ea.restore_stop("<answer> a </answer>", stop, "stop") == "<answer> a </answer>"
    assert ea.restore_stop("<search> q ", stop, "length") == "<search> q "  # cut off: left invalid
    assert ea.restore_stop("<search> q ", stop, "stop", None) == "<search> q "  # vLLM: ended on its own
    assert ea.restore_stop("<search> q ", stop, "stop", "</search>") == "<search> q </search>"  # vLLM names it
    assert (ea.restore_stop("<search> a </search> <answer> b ", stop, "stop")
            == "<search> a </search> <answer> b </answer>")  # the last opened action
    assert ea.restore_stop("no tags", stop, "stop") == "no tags"


def test_memory_mode_requests_carry_only_the_latest_step(stub, tmp_path):
    rows = [{"id": "t", "question": "Who founded Acme? twice", "answers": ["x"]}]
    _, out, _ = _run(stub, tmp_path, rows=rows)
    sent = [r["body"]["messages"] for r in stub.requests]
    assert [len(m) for m in sent] == [2, 4, 4]  # turn 3 sees system + question + turn 2 and its observation
    assert sent[2][2]["content"].startswith("<mem>\nSearched once.")
    assert sent[2][3]["content"].startswith("<information>")
    assert len(out["t"]["messages"]) == 7  # the written transcript is the full chat
    stub.requests.clear()
    counts, out, _ = _run(stub, tmp_path, rows=rows, max_turns=2)  # out of turns: no answer, em 0, written
    assert counts["max_turns"] == 1 and out["t"]["em"] == 0.0 and out["t"]["finish"] == "max_turns"
    assert [m["role"] for m in out["t"]["messages"]][-1] == "assistant" and len(stub.requests) == 2
    stub.requests.clear()
    _run(stub, tmp_path, rows=rows, memory_window="full")
    assert [len(r["body"]["messages"]) for r in stub.requests] == [2, 4, 6]


def test_a_500_is_retried_and_a_dead_endpoint_is_named(stub, tmp_path):
    stub.fail = [500]
    counts, rows, _ = _run(stub, tmp_path, rows=ROWS[:1])
    assert counts["written"] == 1 and rows["right"]["em"] == 1.0 and len(stub.requests) == 3  # 500, then 2 turns
    stub.fail = [503] * 10
    with pytest.raises(ea.EndpointError, match=rf"{stub.url}/chat/completions .*failed after 3 tries: HTTP 503"):
        _run(stub, tmp_path, rows=ROWS[:1], retries=2)
    stub.requests.clear()
    stub.fail = [401]  # not retried
    with pytest.raises(ea.EndpointError, match="failed after 1 tries: HTTP 401"):
        _run(stub, tmp_path, rows=ROWS[:1])
    assert len(stub.requests) == 1
    ep = ea.Endpoint("http://127.0.0.1:9", "m", retries=1, backoff_s=0.01, timeout_s=2)  # nothing listens
    with pytest.raises(ea.EndpointError, match=r"http://127.0.0.1:9/chat/completions .*failed after 2 tries: Connect"):
        ea.write_endpoint_transcripts(ROWS[:1], ep, SYSTEM, lambda q: PASSAGES, tmp_path / "x.jsonl", DOC_FORMAT, 4)


def test_a_reply_with_no_valid_action_ends_its_episode_unwritten(stub, tmp_path):
    rows = ROWS[:1] + [{"id": "bad", "question": "A malformed one?", "answers": ["x"]}]
    counts, out, _ = _run(stub, tmp_path, rows=rows)
    assert counts["invalid"] == 1 and counts["written"] == 1 and list(out) == ["right"]
    assert sum("malformed" in r["body"]["messages"][1]["content"] for r in stub.requests) == 1  # one try, then ended


def test_concurrency_is_bounded_and_samples_repeat_tasks(stub, tmp_path):
    stub.delay = 0.2
    counts, rows, _ = _run(stub, tmp_path, rows=ROWS[:2], samples=3, concurrency=2)
    assert counts["written"] == 6 and sorted(rows) == ["right/0", "right/1", "right/2", "wrong/0", "wrong/1", "wrong/2"]
    assert stub.max_in_flight == 2


def test_the_cli_sends_the_key_from_the_named_variable_only(stub, tmp_path, monkeypatch, capsys):
    data, corpus = tmp_path / "train.jsonl", tmp_path / "corpus.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]))
    other = {"id": "2", "contents": '"Bolt"\nBolt is a dog.'}
    corpus.write_text(json.dumps(PASSAGES[0]) + "\n" + json.dumps(other) + "\n")
    paths = [f"train.data={data}", f"eval.data={data}", f"search.corpus={corpus}", f"train.sft_data={tmp_path / 's'}",
             f"model.path={tmp_path}", "search.backend=bm25", f"search.index_dir={tmp_path / 'index'}"]
    out = tmp_path / "sft.jsonl"
    base = ["transcripts", *paths, "--out", str(out), "--endpoint", stub.url, "--model", "stub-model", "--retries", "0"]
    monkeypatch.setenv("MEMPO_TEST_KEY", "sk-test-123")
    assert main(base + ["--api-key-env", "MEMPO_TEST_KEY", "--limit", "1"]) == 0
    assert "wrote 1 of 1 episodes" in capsys.readouterr().out
    assert {r["headers"].get("Authorization") for r in stub.requests} == {"Bearer sk-test-123"}
    row = json.loads(out.read_text())
    assert row["em"] == 1.0 and "Doc 1 (Title: Acme)" in row["messages"][3]["content"]
    stub.requests.clear()
    assert main(base) == 0 and stub.requests and all("Authorization" not in r["headers"] for r in stub.requests)
    monkeypatch.delenv("MEMPO_TEST_KEY")
    assert main(base + ["--api-key-env", "MEMPO_TEST_KEY"]) == 2
    assert "MEMPO_TEST_KEY is not set" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the key never comes from the command line, not even abbreviated
        main(base + ["--api-key", "sk-test-123"])
    assert "unrecognized arguments: --api-key" in capsys.readouterr().err
    assert main(base + ["--api-key-env", "sk-test-123"]) == 2  # a key where the name goes is refused, not echoed
    assert "not the key" in (err := capsys.readouterr().err) and "sk-test-123" not in err
    with pytest.raises(SystemExit):
        main(["transcripts", *paths, "--out", str(out), "--model", "m"])  # --model without --endpoint
    stub.fail = [500]
    assert main(base) == 1 and f"{stub.url}/chat/completions" in capsys.readouterr().err
