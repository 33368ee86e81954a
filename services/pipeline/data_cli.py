"""``mempo data``: question sets, k-objective tasks and SFT transcripts for your own data (docs/data.md).

    mempo data fanoutqa data/fanoutqa                    # FanOutQA dev: questions.jsonl + generated corpus.jsonl
    mempo data compose data/fanoutqa/questions.jsonl --out data/fanoutqa --ks 1,2,3
    mempo data transcripts CONFIG [key=value ...] --out data/fanoutqa/sft.jsonl   # gold-known oracle SFT data
    mempo data transcripts CONFIG [key=value ...] --out sft.jsonl --endpoint http://127.0.0.1:8000/v1 --model NAME
                                                         # SFT data played by an OpenAI-compatible model
"""

from __future__ import annotations

import argparse
import sys

from tqdm import tqdm

from services.config import config_args, load_config
from services.common.paths import data_path

def _ks(text: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers, e.g. 1,2,3") from None
    if not ks or ks[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: objective counts are integers >= 1")
    return ks


# Each subcommand imports its work on use: services/cli.py imports this module for every `mempo` command
# (and `mempo --help`), which should not wait for pandas (compose, the question sets), httpx (the endpoint)
# or torch and the world's builder (transcripts: the retrieval index).


def _compose(argv: list[str]) -> int:
    from services.pipeline.compose import compose  # pandas

    p = argparse.ArgumentParser(prog="mempo data compose", description="MEM1-style k-objective tasks from a "
                                "single-question set (any format train.data accepts), split into train and test "
                                "by the entity each question asks about.")
    p.add_argument("source", help="single-question set (.jsonl or .parquet; rows may name an 'entity')")
    p.add_argument("--out", required=True, help="folder for train.<format> and test.<format>")
    p.add_argument("--ks", type=_ks, default=[1, 2, 3], help="objective counts, e.g. 1,2,3 (default)")
    p.add_argument("--train-per-k", type=int, default=400, help="training tasks per k (default 400)")
    p.add_argument("--test-per-k", type=int, default=50, help="held-out tasks per k (default 50)")
    p.add_argument("--test-share", type=float, default=0.25, help="share of entities held out (default 0.25)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    a = p.parse_args(argv)
    paths = compose(a.source, a.out, a.ks, a.train_per_k, a.test_per_k, a.test_share, a.seed, a.format)
    for split, path in paths.items():
        print(f"{split}: {path}")
    return 0


def _fanoutqa(argv: list[str]) -> int:
    from services.pipeline.fanout import write_fanoutqa  # on use, as above

    p = argparse.ArgumentParser(prog="mempo data fanoutqa", description="FanOutQA's dev questions (shipped in the "
                                "fanoutqa package, CC BY-SA 4.0) as single questions, with a generated corpus: "
                                "one passage per evidence page stating its facts (not Wikipedia text).")
    p.add_argument("out", help="folder for questions.jsonl and corpus.jsonl")
    paths = write_fanoutqa(p.parse_args(argv).out)
    for name, path in paths.items():
        print(f"{name}: {path} ({sum(1 for _ in open(path, encoding='utf-8'))} rows)")
    return 0


def _transcripts(argv: list[str]) -> int:
    from services.common.data import read_rows  # pandas
    from services.pipeline import endpoint_agent as ea  # httpx
    from services.pipeline.transcripts import write_transcripts
    from services.search_tool.backends import load_backend  # torch
    from services.world.build import prepare_world  # pandas, the world's generators

    p = argparse.ArgumentParser(prog="mempo data transcripts", description="MemPO SFT transcripts for train.data's "
                                "questions on search.corpus's index, by a gold-known oracle (the corpus must state the "
                                "gold answers) or, with --endpoint, by a model behind an OpenAI-compatible "
                                "chat-completions endpoint (docs/data.md); the output is what train.sft_data reads.",
                                allow_abbrev=False)  # '--api-key' must not pass for --api-key-env
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value")
    p.add_argument("--out", required=True, help="JSONL file to write")
    p.add_argument("--limit", type=int, default=0, help="only the first N rows of train.data (0 = all)")
    e = p.add_argument_group("endpoint (instead of the oracle)")
    e.add_argument("--endpoint", help="base URL of an OpenAI-compatible API, e.g. http://127.0.0.1:8000/v1 "
                   "(turns are POSTed to <endpoint>/chat/completions)")
    e.add_argument("--model", help="the model name the endpoint serves (required with --endpoint)")
    e.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key, sent as "
                   "'Authorization: Bearer'; none is sent without it")
    e.add_argument("--temperature", type=float, help="sampling temperature (default 0.7)")
    e.add_argument("--samples", type=int, help="episodes per task (default 1); train.sft_min_em keeps the correct ones")
    e.add_argument("--concurrency", type=int, help="episodes in flight at once (default 4)")
    e.add_argument("--retries", type=int, help="retries of a failed request: connection errors, timeouts, 429, 5xx "
                   "(default 3, backoff 1, 2, 4 s)")
    e.add_argument("--timeout", type=float, help="seconds per request (default 120)")
    a = p.parse_intermixed_args(argv)
    given = [f"--{k.replace('_', '-')}" for k in ("model", "api_key_env", "temperature", "samples", "concurrency",
                                                   "retries", "timeout") if getattr(a, k) is not None]
    if a.endpoint is None and given:
        p.error(f"{', '.join(given)} only with --endpoint (without it the gold-known oracle writes the transcripts)")
    if a.endpoint is not None and not a.model:
        p.error("--endpoint needs --model (the model name the endpoint serves)")
    ep = None
    if a.endpoint is not None:
        ep = ea.Endpoint(ea.endpoint_url(a.endpoint), a.model, ea.api_key_from_env(a.api_key_env),
                         0.7 if a.temperature is None else a.temperature,
                         timeout_s=120.0 if a.timeout is None else a.timeout,
                         retries=3 if a.retries is None else a.retries)
    cfg = prepare_world(load_config(*config_args(a.args)), needs=("train.data", "search.corpus"))
    rows = read_rows(data_path(cfg, "train"), "train.data")[: a.limit or None]
    backend = load_backend(cfg)
    topk = cfg.search.topk

    def search(query: str) -> list[dict]:
        return [doc for doc, _score in backend.search([query], topk)[0]]

    if ep is None:
        counts = write_transcripts(rows, cfg.rollout.system_prompt, search, a.out, cfg.search.doc_format,
                                   cfg.rollout.max_turns, lambda xs: tqdm(xs, desc="transcripts", unit="task"))
        print(f"wrote {counts['written']} transcripts to {a.out}; {counts['em_1']} answer every question (em = 1)")
        return 0
    r = cfg.rollout
    ep.top_p, ep.max_tokens, ep.stop = r.top_p, r.max_response_tokens, tuple(r.stop)
    try:
        c = ea.write_endpoint_transcripts(rows, ep, r.system_prompt, search, a.out, cfg.search.doc_format, r.max_turns,
                                          r.memory_window, a.samples or 1, a.concurrency or 4,
                                          lambda n: tqdm(total=n, desc="transcripts", unit="episode"))
    except ea.EndpointError as err:
        print(f"error: {err} (transcripts finished before it are in {a.out})", file=sys.stderr)
        return 1
    print(f"wrote {c['written']} of {c['episodes']} episodes to {a.out} ({ep.model} at {ep.url}); {c['em_1']} answer "
          f"every question (em = 1), {c['max_turns']} ran out of turns (em 0), {c['format_problems']} broke the turn "
          f"grammar somewhere (format_ok false); {c['invalid']} ended on a reply with no valid action and are not "
          f"written")
    return 0


COMMANDS = {"compose": _compose, "fanoutqa": _fanoutqa, "transcripts": _transcripts}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
