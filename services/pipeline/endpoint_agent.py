"""``mempo data transcripts --endpoint``: MemPO SFT transcripts played by a model behind any
OpenAI-compatible chat-completions endpoint (vLLM, SGLang, llama.cpp, a hosted API), on your questions
and your retrieval index.

    mempo data transcripts CONFIG --out sft.jsonl --endpoint http://127.0.0.1:8000/v1 --model NAME \\
        [--api-key-env VAR] [--temperature 0.7] [--samples N] [--concurrency 4] [--limit N]

For each task of ``train.data`` (and each of ``--samples`` episodes of it) the endpoint plays the agent:

- the chat starts as ``[system: rollout.system_prompt, user: the question(s) joined by "; "]``;
- each assistant turn is one ``POST {endpoint}/chat/completions`` with ``stop`` = ``rollout.stop``
  (``</search>``, ``</answer>``), ``max_tokens`` = ``rollout.max_response_tokens``, ``top_p`` =
  ``rollout.top_p`` and the given temperature. A server that leaves the matched stop string out of
  the text (OpenAI's rule) gets it put back (:func:`restore_stop`);
- the request carries the context the agent sees in RL: system + question + the last
  ``rollout.memory_window`` turns with their observations (1 = MemPO: the previous turn only, so the
  model must carry what it knows in ``<mem>``; ``full`` = the whole chat);
- the turn is parsed by the rollout's parser (services/rollout/parser.py); a ``<search>`` runs on the
  config's retrieval index and its passages (``search.doc_format``) come back as the next user
  message ``<information>...</information>``; an ``<answer>`` ends the episode, and so does
  ``rollout.max_turns`` (no answer: em 0);
- a reply with no valid action (no complete ``<search>``/``<answer>``, an empty search, a reply cut
  off at ``max_tokens``) ends its episode, which is counted as ``invalid`` and **not written**:
  SFT would otherwise learn a malformed turn whenever ``train.sft_min_em`` is 0.

Each finished episode is one JSONL row ``{"id", "messages", "em", "finish", "format_ok"}``: the full
chat (mempo's SFT derives the memory-mode contexts itself), ``em`` = multi_objective_em of the answer
against the row's gold answers, so ``train.sft_min_em`` keeps only the correct ones (rejection
sampling; ``--samples`` draws several episodes per task). ``format_ok`` is false when a turn broke
the grammar in a way the parser still executes (``<mem>`` missing on a later turn, stray text, ...).

HTTP: connection errors, timeouts, 408/409/425/429 and 5xx are retried ``retries`` times with
exponential backoff; any other status, or retries used up, stops the command with an
:class:`EndpointError` naming the endpoint (rows already finished stay in the file). The API key is
read from the environment variable the user names and sent as ``Authorization: Bearer ...``; without
one no Authorization header is sent.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

import httpx

from services.common.data import QUESTION_JOINER, row_golds, row_questions
from services.common.passage_format import format_passages
from services.common.rewards import multi_objective_em
from services.common.turn_format import render_information
from services.rollout.parser import parse_turn

SearchFn = Callable[[str], list[dict]]  # query -> passages ({"id", "contents"}), best first
RETRY_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_URL = re.compile(r"^https?://[^/\s:]+(:\d+)?(/\S*)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EndpointError(RuntimeError):
    """The endpoint could not give a turn: a non-retryable status, or retries used up."""


def endpoint_url(url: str) -> str:
    """The base URL (``http://host:port/v1``) as given, without a trailing ``/`` or ``/chat/completions``."""
    base = url.strip().rstrip("/")
    if base.endswith("/chat/completions"):
        base = base[: -len("/chat/completions")]
    if not _URL.match(base):
        raise ValueError(f"--endpoint {url!r}: expected http(s)://host[:port][/path], e.g. http://127.0.0.1:8000/v1")
    return base


def api_key_from_env(var: str | None) -> str | None:
    """The key in environment variable ``var`` (never from the command line); None when no variable is named."""
    if not var:
        return None
    if not _ENV_NAME.match(var):  # never echo it: it may be the key itself
        raise ValueError("--api-key-env takes the name of an environment variable (letters, digits, '_'), not the key")
    key = os.environ.get(var, "").strip()
    if not key:
        raise ValueError(f"--api-key-env {var}: the environment variable {var} is not set or is empty")
    return key


@dataclass
class Endpoint:
    url: str  # base URL, e.g. http://127.0.0.1:8000/v1
    model: str
    api_key: str | None = None
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 512
    stop: tuple[str, ...] = ("</search>", "</answer>")
    timeout_s: float = 120.0
    retries: int = 3
    backoff_s: float = 1.0

    @property
    def chat_url(self) -> str:
        return self.url + "/chat/completions"


def restore_stop(text: str, stop: tuple[str, ...], finish_reason: str | None, stop_reason: object = "?") -> str:
    """The turn as the model wrote it. OpenAI-style servers drop the matched stop string from the text
    (vLLM names it in ``stop_reason``; None there means the model ended on its own): when the reply
    stopped and its last opened ``<search>``/``<answer>`` has no close tag, the close tag is appended.
    A reply cut off by ``max_tokens`` (``finish_reason == "length"``) stays as it is."""
    if finish_reason == "length" or any(text.rstrip().endswith(s) for s in stop):
        return text
    if isinstance(stop_reason, str) and stop_reason in stop:
        return text + stop_reason
    if stop_reason is None:
        return text
    best = max(((text.rfind("<" + s[2:]), s) for s in stop if s.startswith("</")), default=(-1, ""))
    pos, close = best
    return text + close if pos >= 0 and close not in text[pos:] else text


def memory_context(messages: list[dict], window: Union[int, str]) -> list[dict]:
    """What the agent sees for its next turn (services/rollout/records.py, ``context``): system +
    question + the last ``window`` turns, each its assistant message and the observation after it."""
    head, steps = messages[:2], messages[2:]
    if window == "full":
        return list(messages)
    return head + steps[max(0, len(steps) - 2 * int(window)):]


async def complete(client: httpx.AsyncClient, ep: Endpoint, messages: list[dict]) -> str:
    """One assistant turn from the endpoint, with its stop string restored."""
    body = {"model": ep.model, "messages": messages, "temperature": ep.temperature, "top_p": ep.top_p,
            "max_tokens": ep.max_tokens, "stop": list(ep.stop)}
    headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else {}
    last, tries = "", 0
    for attempt in range(ep.retries + 1):
        if attempt:
            await asyncio.sleep(ep.backoff_s * 2 ** (attempt - 1))
        tries += 1
        try:
            r = await client.post(ep.chat_url, json=body, headers=headers, timeout=ep.timeout_s)
        except httpx.HTTPError as e:  # refused, reset, timed out
            last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            continue
        if r.status_code == 200:
            try:
                choice = r.json()["choices"][0]
                text = choice["message"]["content"] or ""
                assert isinstance(text, str)
            except (ValueError, KeyError, IndexError, TypeError, AssertionError):
                raise EndpointError(f"{ep.chat_url} answered 200 with a body that is not an OpenAI chat completion: "
                                    f"{r.text[:300]!r}") from None
            return restore_stop(text, ep.stop, choice.get("finish_reason"), choice.get("stop_reason", "?"))
        last = f"HTTP {r.status_code}: {r.text[:300]!r}"
        if r.status_code not in RETRY_STATUS:
            break
    raise EndpointError(f"{ep.chat_url} (model {ep.model!r}) failed after {tries} tries: {last}")


async def episode(client: httpx.AsyncClient, ep: Endpoint, questions: list[str], golds: list[list[str]],
                  system_prompt: str, search: Callable, doc_format: str, max_turns: int,
                  memory_window: Union[int, str]) -> dict:
    """One episode played by the endpoint: ``{"messages", "em", "finish", "format_ok", "answer"}``;
    ``finish`` is "answer", "max_turns" or "invalid" (no valid action)."""
    messages = [{"role": "system", "content": system_prompt},
                {"role": "user", "content": QUESTION_JOINER.join(questions)}]
    answer, finish, format_ok = None, "max_turns", True
    for turn in range(1, max_turns + 1):
        text = await complete(client, ep, memory_context(messages, memory_window))
        parsed = parse_turn(text, turn)
        format_ok = format_ok and parsed.format_ok
        messages.append({"role": "assistant", "content": text.strip()})
        if parsed.action == "answer":
            answer, finish = parsed.argument, "answer"
            break
        if parsed.action != "search":
            finish = "invalid"
            break
        if turn < max_turns:  # nothing would read the last turn's observation
            docs = await search(parsed.argument)
            messages.append({"role": "user", "content": render_information(format_passages(docs, doc_format))})
    return {"messages": messages, "em": multi_objective_em(answer, golds), "finish": finish, "format_ok": format_ok,
            "answer": answer}


def write_endpoint_transcripts(rows: list[dict], ep: Endpoint, system_prompt: str, search: SearchFn, out: str | Path,
                               doc_format: str, max_turns: int, memory_window: Union[int, str] = 1, samples: int = 1,
                               concurrency: int = 4, progress: Callable | None = None) -> dict:
    """Play ``samples`` episodes of every row on the endpoint, ``concurrency`` at a time, and write the
    JSONL as episodes finish; returns counts. ``progress(total)`` makes a tqdm-like bar."""
    if samples < 1 or concurrency < 1 or ep.retries < 0:
        raise ValueError(f"--samples ({samples}) and --concurrency ({concurrency}) must be at least 1, --retries "
                         f"({ep.retries}) at least 0")
    return asyncio.run(_write(rows, ep, system_prompt, search, Path(out), doc_format, max_turns, memory_window,
                              samples, concurrency, progress))


async def _write(rows, ep, system_prompt, search, out: Path, doc_format, max_turns, memory_window, samples,
                 concurrency, progress) -> dict:
    jobs = []
    for n, row in enumerate(rows, 1):
        questions = row_questions(row)
        golds = row_golds(row, len(questions))
        rid = str(row.get("id", n))
        jobs += [(rid if samples == 1 else f"{rid}/{s}", questions, golds) for s in range(samples)]
    counts = {"episodes": len(jobs), "written": 0, "em_1": 0, "invalid": 0, "max_turns": 0, "format_problems": 0}
    bar = progress(len(jobs)) if progress else None
    slots = asyncio.Semaphore(concurrency)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="transcripts-search")  # one search at a time
    loop = asyncio.get_running_loop()

    async def run_search(query: str) -> list[dict]:
        return await loop.run_in_executor(pool, search, query)

    async def one(job, client):
        async with slots:
            rid, questions, golds = job
            t = await episode(client, ep, questions, golds, system_prompt, run_search, doc_format, max_turns,
                              memory_window)
            return rid, t

    out.parent.mkdir(parents=True, exist_ok=True)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    try:
        async with httpx.AsyncClient(limits=limits) as client:
            tasks = [asyncio.ensure_future(one(job, client)) for job in jobs]
            try:
                with open(out, "w", encoding="utf-8") as f:
                    for fut in asyncio.as_completed(tasks):
                        rid, t = await fut
                        if bar is not None:
                            bar.update(1)
                        if t["finish"] == "invalid":
                            counts["invalid"] += 1
                            continue
                        counts["written"] += 1
                        counts["em_1"] += t["em"] == 1.0
                        counts["max_turns"] += t["finish"] == "max_turns"
                        counts["format_problems"] += not t["format_ok"]
                        row = {"id": rid, "messages": t["messages"], "em": t["em"], "finish": t["finish"],
                               "format_ok": t["format_ok"]}
                        f.write(json.dumps(row, ensure_ascii=False) + "\n")
                        f.flush()
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        pool.shutdown(wait=True)
        if bar is not None:
            bar.close()
    return counts
