"""`make test`: the whole suite as two pytest sessions side by side, after the assets they share.

    .venv/bin/python scripts/run_tests.py            # what `make test` runs
    .venv/bin/python scripts/run_tests.py --serial   # one pytest session, the tiers in turn

1. The assets every tier reads are built once, first: the tiny config's embedded world and the tests'
   grammar model (each cached on disk; a no-op when both are there). Built by two sessions at once
   they would be built twice.
2. ``tests/scenarios`` (whole runs: faults, chaos, several nodes, the real model) and every other test
   run as two pytest processes at once, each with its own Ray cluster and free ports. The scenario
   runs keep the cores busy while the rest mostly waits (Ray and vLLM start-ups, fault timeouts), so
   on 2 cores the overlap takes about a tenth off the wall time (docs/results.md).
3. Each session's output goes to a log under a temporary folder; a line every minute says how far each
   has come; when both have ended, each log is printed whole (failures, the slowest tests), then one
   line per session. The exit status is non-zero if either session failed. Ctrl-C stops both.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SESSIONS = {"scenarios": ["tests/scenarios"], "rest": ["tests", "--ignore=tests/scenarios"]}
PYTEST = [sys.executable, "-m", "pytest", "-q", "--durations=15"]


def build_assets() -> None:
    """The world of deploy/configs/tiny.yaml and the grammar model on it, as the tests' fixtures build them."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    from services.config import load_config  # the project's modules, once the root is on the path
    from services.world.build import build_world
    from tests.rollout.grammar_model import grammar_model

    with tempfile.TemporaryDirectory() as run_dir:  # the run directory is no part of the world's key
        cfg = load_config(ROOT / "deploy" / "configs" / "tiny.yaml", [f"train.run_dir={run_dir}"])
        t0 = time.time()
        world = build_world(cfg, progress=True)
        model = grammar_model(world, Path(".cache/test-models"))
    print(f"[run_tests] assets ready in {time.time() - t0:.0f}s: {world}, {model}", flush=True)


def progress(log: Path) -> str:
    """How far a pytest -q session has come: its last percentage ("[ 42%]") and the tests reported since,
    or "starting"."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "starting"
    marks = list(re.finditer(r"\[\s*(\d+)%\]", text))
    tail = text[marks[-1].end():] if marks else text
    done = sum(len(m) for m in re.findall(r"^[.FEsxX]+$", tail, flags=re.M))  # a line of results so far
    tests = f"{done} test{'' if done == 1 else 's'}"
    if not marks:
        return tests if done else "starting"
    return f"{marks[-1].group(1)}%" + (f" +{tests}" if done else "")


def run_side_by_side(extra: list[str]) -> int:
    logs = Path(tempfile.mkdtemp(prefix="mempo-tests-"))
    procs: dict[str, tuple[subprocess.Popen, Path, float]] = {}
    for name, args in SESSIONS.items():
        log = logs / f"{name}.log"
        with open(log, "w") as out:  # each its own process group: Ctrl-C stops it with its children
            procs[name] = (subprocess.Popen(PYTEST + args + extra, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True), log, time.time())
    print(f"[run_tests] {', '.join(SESSIONS)} side by side; logs in {logs}", flush=True)
    ended: dict[str, tuple[int, float]] = {}
    try:
        last = time.time()
        while len(ended) < len(procs):
            time.sleep(2)
            for name, (proc, log, t0) in procs.items():
                if name not in ended and proc.poll() is not None:
                    ended[name] = (proc.returncode, time.time() - t0)
                    print(f"[run_tests] {name} ended: exit {proc.returncode} after {ended[name][1]:.0f}s", flush=True)
            if time.time() - last >= 60:
                last = time.time()
                print("[run_tests] " + ", ".join(f"{n} {'done' if n in ended else progress(log)}"
                                                 for n, (_, log, _) in procs.items()), flush=True)
    except KeyboardInterrupt:
        for proc, _, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc, _, _ in procs.values():
            proc.wait()
        raise
    for name, (_, log, _) in procs.items():
        print(f"\n===== {name} ({' '.join(SESSIONS[name])}) =====", flush=True)
        sys.stdout.write(log.read_text(errors="replace"))
    print()
    for name, (code, seconds) in ended.items():
        print(f"[run_tests] {name}: {'passed' if code == 0 else f'FAILED (exit {code})'} in {seconds / 60:.1f} min")
    return int(any(code != 0 for code, _ in ended.values()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serial", action="store_true", help="one pytest session over tests/, the tiers in turn")
    parser.add_argument("--assets", action="store_true", help="only build the assets the tests share (step 1)")
    args, extra = parser.parse_known_args()
    t0 = time.time()
    if args.serial:
        return subprocess.call(PYTEST + ["tests"] + extra, cwd=ROOT)
    if args.assets:
        build_assets()
        return 0
    # in a process of its own: this one only waits, and holds no model while the sessions run
    subprocess.check_call([sys.executable, __file__, "--assets"], cwd=ROOT)
    code = run_side_by_side(extra)
    print(f"[run_tests] all in {(time.time() - t0) / 60:.1f} min", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
