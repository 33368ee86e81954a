"""``mempo chaos``: a training run under random faults and REST load, with its invariants checked.

    mempo chaos deploy/configs/tiny.yaml                        # 30 steps, seed 0, an unfaulted twin, eval
    mempo chaos deploy/configs/tiny.yaml --steps 6 --max-faults 3 --no-baseline
    mempo chaos CONFIG --plan "2:scorer_replica+vllm_engine,4:driver_sigterm"   # a fixed plan
    -> <train.run_dir>/chaos/ chaos.json, report.md, faulted/ (the run), unfaulted/, eval/, *.log

On a multi-node Ray cluster of its own on this machine (services/pipeline/local_cluster.py: a head
with search and the learner, a worker node for the rollout, one for the scorer), ``mempo train``
runs as a user runs it, in its own process, while a seeded schedule (services/pipeline/chaos_faults.py)
kills replicas, engines, learner ranks and nodes, holds the search replicas, or stops the driver
(started again with the same command, as a user would), and a client sends the scorer's REST
endpoint requests at a steady rate (services/pipeline/rest_load.py). A driver that exits before the
last step, for any reason, is started again with the same command. Afterwards the invariants of
services/pipeline/chaos_checks.py are checked, both runs' final policies are evaluated on the same
held-out prompts, and the report gives faults injected / survived, the seconds each kind added to its
step, the REST status codes and latencies, and every violation. Exit status 1 if any.

Each chaos run starts anew in its folder. ``--no-baseline`` skips the unfaulted twin and the eval.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

from services.config import load_config
from services.common.data import load_prompts
from services.pipeline.local_cluster import LocalCluster
from services.common.local_ray import LOOPBACK_ENV, free_ports, join_options
from services.common.paths import data_path
from services.learner import ledger
from services.pipeline import chaos_checks
from services.pipeline.chaos_faults import Fault, Injector
from services.pipeline.start_errors import delete_all
from services.pipeline.rest_load import RestLoad, summary

MEMPO = str(Path(sys.executable).parent / "mempo")
NODES = {"head": (2, {"head_node": 100}), "worker-1": (1, {"rollout_node": 1}), "worker-2": (1, {"scorer_node": 1})}
PLACEMENT = ["search.resources={head_node: 1}", "learner.resources={head_node: 1}",
             "rollout.resources={rollout_node: 1}", "scorer.resources={scorer_node: 1}"]


def cluster_overrides(cluster: LocalCluster, port: int) -> list[str]:
    """What every run of the chaos cluster adds to the user's overrides: the cluster, placement by
    node resources, and the autoscaler's waiting (the chaos run adds a lost node back)."""
    return [f"ray.address={cluster.address}", f"ray.http_port={port}", "ray.proxy_location=HeadOnly",
            "ray.autoscaler=true", *PLACEMENT]


class TrainRuns:
    """``mempo train`` in its own process, started again with the same command until it trains the
    last step (at most ``max_starts`` times)."""

    def __init__(self, args: list[str], env: dict, log_dir: Path, name: str, max_starts: int):
        self.args, self.env, self.log_dir, self.name, self.max_starts = args, env, log_dir, name, max_starts
        self.proc: subprocess.Popen | None = None
        self.exits: list[dict] = []  # each start's exit: code, seconds, its last error line
        self.hangs: list[dict] = []  # a driver killed after stall_s without a step
        self.lock = threading.Lock()

    def run(self, done, progress, total: int, stall_s: float = 900.0) -> bool:
        """Start the command until ``done()`` after an exit; False if the starts ran out, two starts in a
        row ended without ``progress()`` (the step reached) moving (a failure that is not a fault's), or a
        driver went ``stall_s`` seconds without a step (it is killed: a hang, recorded in ``hangs``).
        A progress bar follows ``progress()`` up to ``total`` steps."""
        last = progress()
        with tqdm(total=total, initial=last, desc=f"chaos {self.name}", unit="step", dynamic_ncols=True) as bar:
            return self._run(done, progress, stall_s, bar, last)

    def _run(self, done, progress, stall_s: float, bar: tqdm, last: int) -> bool:
        stalled = 0
        for i in range(self.max_starts):
            bar.set_postfix_str(f"driver start {i + 1}")
            log = self.log_dir / f"{self.name}-{i}.log"
            t0 = time.time()
            with open(log, "w") as out, self.lock:
                self.proc = subprocess.Popen([MEMPO, "train", *self.args], env=self.env, stdout=out,
                                             stderr=subprocess.STDOUT, start_new_session=True)
            seen, since = progress(), time.time()
            while self.proc.poll() is None:
                time.sleep(1.0)
                now = progress()
                if now != seen:
                    seen, since = now, time.time()
                    bar.n = now  # a rollback after a restart moves it back
                    bar.refresh()
                elif time.time() - since > stall_s:
                    self.hangs.append({"start": i, "step": seen, "seconds": time.time() - since})
                    self.kill()
                    return False
            code = self.proc.returncode
            now = progress()
            bar.n = now
            bar.refresh()
            errors = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("error: ")]
            self.exits.append({"start": i, "code": code, "seconds": time.time() - t0,
                               "error": errors[-1] if errors else None})
            if code == 0 and done():
                return True
            stalled, last = (stalled + 1, last) if now == last else (0, now)
            if stalled >= 2:
                return False
        return False

    def kill(self) -> None:
        """Stop a driver still running (the chaos run itself stopped), with its process group."""
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def sigterm(self) -> str:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                raise LookupError("no driver running")
            self.proc.send_signal(signal.SIGTERM)
            return f"driver pid {self.proc.pid}"


def rest_bodies(cfg, limit: int = 64) -> list[dict]:
    """Text-form /score requests from the held-out prompts: the question, an empty memory, the gold."""
    prompts = load_prompts(data_path(cfg, "test"), cfg.rollout.system_prompt, setting="eval.data")[:limit]
    return [{"question": p.messages[-1].content, "memory": "", "answer": p.golds[0][0]} for p in prompts]


def lineage_step(run_dir: Path, rows: list[dict] | None = None) -> tuple[int, float]:
    """(the last step of the ledger's lineage, when it was trained or the learner started); ``rows``:
    the ledger already read."""
    rows = ledger.read(run_dir) if rows is None else rows
    kept, _, _ = ledger.lineage(rows)
    if kept:
        last = max(kept)
        return last, kept[last]["time"]
    starts = [r for r in rows if r["event"] == "start"]
    return 0, (starts[-1]["time"] if starts else 0.0)


def step_seconds(rows: list[dict], default: float = 5.0) -> float:
    """The median seconds between consecutive trained lines of the ledger (``default`` before two)."""
    times = [r["time"] for r in rows if r["event"] == "trained"]
    gaps = sorted(b - a for a, b in zip(times, times[1:]) if b > a)
    return gaps[len(gaps) // 2] if gaps else default


def inject_plan(plan: list[Fault], injector: Injector, run_dir: Path, seed: int, stop: threading.Event,
                records: list[dict]) -> None:
    """Each fault when its step has begun (the step before it is in the ledger) and its fraction of a
    step has passed; a fault whose target is gone (e.g. no driver between two starts) is recorded as
    missed."""
    rng = random.Random(f"chaos-targets/{seed}")
    for fault in plan:
        while not stop.is_set():
            rows = ledger.read(run_dir)  # once a look: the step reached and the step's seconds both from it
            step, since = lineage_step(run_dir, rows)
            if step >= fault.step - 1 and since and time.time() >= since + fault.at * step_seconds(rows):
                break
            stop.wait(0.05)
        if stop.is_set():
            return
        landed = lineage_step(run_dir)[0] + 1
        try:
            record = injector.inject(fault, rng)
            record["landed_step"] = landed
        except Exception as e:  # a missed fault is reported, not fatal
            record = {"step": fault.step, "kind": fault.kind, "at": time.time(), "landed_step": landed,
                      "missed": f"{type(e).__name__}: {e}"}
        records.append(record)
        tqdm.write(f"[chaos] step {landed}: {record['kind']} -> {record.get('target', record.get('missed'))}")


def use_cluster_auth(cluster: LocalCluster) -> None:
    """Make this process join ``cluster`` with its token. Ray reads RAY_AUTH_MODE into its config when it
    is imported (the ``mempo`` command imports it before any command runs), so the config is read again,
    as Ray's own token setup does after it sets the variable."""
    os.environ.update({k: cluster.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")} | LOOPBACK_ENV)
    if "ray._raylet" in sys.modules:
        from ray._raylet import Config  # Ray's cached config, read again from the environment

        Config.initialize("")


def delete_apps(prefix: str) -> None:
    from ray import serve  # Ray on use

    delete_all([name for name in serve.status().applications if name.startswith(prefix)])


def em_outcome(episodes: Path) -> dict:
    """The faulted run's held-out EM against the unfaulted one's, paired per prompt (``mempo eval``'s
    episodes.jsonl), with the unfaulted EM's own 95% CI."""
    from services.pipeline.report import episode_em  # matplotlib
    from services.pipeline.stats import bootstrap_ci, paired_bootstrap_diff  # numpy

    em = episode_em(episodes)
    keys = sorted(em["unfaulted"])
    before, after = [em["unfaulted"][k] for k in keys], [em["faulted"][k] for k in keys]
    lo, hi = bootstrap_ci(before)
    d, dlo, dhi = paired_bootstrap_diff(before, after)
    mean_after = sum(after) / len(after)
    return {"prompts": len(keys), "unfaulted_em": sum(before) / len(before), "unfaulted_ci": [lo, hi],
            "faulted_em": mean_after, "within_unfaulted_ci": lo <= mean_after <= hi,
            "faulted_minus_unfaulted": d, "diff_ci": [dlo, dhi]}


def run_chaos(config: str | None, overrides: list[str], plan: list[Fault], steps: int = 30, seed: int = 0,
              baseline: bool = True, rest_rate: float = 1.0, rest_max: int = 5000, out: str | None = None) -> dict:
    """The whole chaos run (module docstring); returns what chaos.json holds."""
    from services.common.paths import corpus_needed  # the world's builder (pandas) on use
    from services.world.build import prepare_world  # the same

    from services.pipeline.sft import sft_dir  # torch, on use

    cfg = load_config(config, [*overrides, f"train.steps={steps}"])
    prepare_world(cfg, needs=("train.data", "eval.data") + corpus_needed(cfg))  # built before any fault
    start = []  # both runs start from the config's SFT policy (they train in folders of their own)
    if cfg.train.init_from_sft:
        if not (sft_dir(cfg) / "config.json").is_file():
            raise FileNotFoundError(f"no SFT policy at {sft_dir(cfg)}: run `mempo sft` with this config first, or "
                                    f"give train.init_from_sft=false to start from model.path")
        start = [f"train.sft_dir={sft_dir(cfg).resolve()}"]
    out_dir = Path(out or Path(cfg.train.run_dir) / "chaos").resolve()
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    cluster = LocalCluster.create("chaos")
    use_cluster_auth(cluster)
    result: dict = {"steps": steps, "seed": seed, "plan": [f.__dict__ for f in plan], "violations": []}
    violations = result["violations"]
    t_start = time.time()
    drivers: list[TrainRuns] = []
    try:
        for name, (cpus, resources) in NODES.items():
            cluster.add(name, cpus, resources, head=name == "head")
        import ray  # Ray on use: `mempo --help` imports this module

        ray.init(**join_options(cluster.address))
        port = free_ports(1)[0]
        common = [*overrides, *start, f"train.steps={steps}", "train.eval_every=0", *cluster_overrides(cluster, port)]
        runs_cfg = {}
        if baseline:
            runs_cfg["unfaulted"] = common + ["ray.app_prefix=base-", f"train.run_dir={out_dir / 'unfaulted'}"]
            base = TrainRuns([*_config_arg(config), *runs_cfg["unfaulted"]], cluster.env, out_dir, "unfaulted", 2)
            drivers.append(base)
            t0 = time.time()
            if not base.run(lambda: lineage_step(out_dir / "unfaulted")[0] >= steps,
                            lambda: lineage_step(out_dir / "unfaulted")[0], steps):
                raise RuntimeError(f"the unfaulted run failed: {base.exits}; see {out_dir}/unfaulted-*.log")
            result["unfaulted_s"] = time.time() - t0
            delete_apps("base-")
        runs_cfg["faulted"] = common + ["ray.app_prefix=chaos-", f"train.run_dir={out_dir / 'faulted'}"]
        runs = TrainRuns([*_config_arg(config), *runs_cfg["faulted"]], cluster.env, out_dir, "faulted", len(plan) + 3)
        drivers.append(runs)
        injector = Injector(cluster, "chaos-", runs.sigterm, {n: NODES[n] for n in NODES if n != "head"})
        records: list[dict] = []
        stop = threading.Event()
        load = RestLoad(f"http://127.0.0.1:{port}/chaos-scorer/score", rest_bodies(cfg), rest_rate, rest_max).start()
        faults = threading.Thread(target=inject_plan, name="chaos-faults", daemon=True,
                                  args=(plan, injector, out_dir / "faulted", seed, stop, records))
        faults.start()
        t0 = time.time()
        finished = runs.run(lambda: lineage_step(out_dir / "faulted")[0] >= steps,
                            lambda: lineage_step(out_dir / "faulted")[0], steps)
        result["faulted_s"] = time.time() - t0
        stop.set()
        faults.join(timeout=300)
        injector.release()
        calls = load.stop()
        delete_apps("chaos-")
        for fault in plan[len(records):]:  # the run ended before their step began
            records.append({"step": fault.step, "kind": fault.kind, "missed": "the run ended first"})
        result.update(faults=records, driver_exits=runs.exits, rest=summary(calls), finished=finished)
        (out_dir / "rest_calls.jsonl").write_text("".join(json.dumps(c) + "\n" for c in calls))
        violations += [f"the driver made no step for {h['seconds']:.0f}s after step {h['step']} (killed)"
                       for h in runs.hangs]
        if not finished:
            violations.append(f"the faulted run did not reach step {steps} ({len(runs.exits)} starts; last error: "
                              f"{runs.exits[-1]['error'] if runs.exits else None})")
        rows = ledger.read(out_dir / "faulted")
        result["overhead"] = chaos_checks.overhead(rows, [{**r, "step": r["landed_step"]} for r in records
                                                          if "missed" not in r])
        violations += chaos_checks.check_training(load_config(config, runs_cfg["faulted"]), out_dir / "faulted", steps)
        violations += chaos_checks.check_rest(calls)
        if baseline:
            violations += [f"unfaulted run: {v}" for v in chaos_checks.check_training(
                load_config(config, runs_cfg["unfaulted"]), out_dir / "unfaulted", steps)]
            result["outcome"] = evaluate_both(config, common, out_dir, cluster.env)
    finally:
        for d in drivers:
            d.kill()
        if "ray" in sys.modules and sys.modules["ray"].is_initialized():
            sys.modules["ray"].shutdown()  # before the cluster goes: Ray ends a process whose GCS is gone
        cluster.shutdown()
    left = cluster.leftovers()
    if left:
        violations.append(f"processes left behind after shutdown: {left}")
    result["wall_s"] = time.time() - t_start
    (out_dir / "chaos.json").write_text(json.dumps(result, indent=1))
    (out_dir / "report.md").write_text(report(result))
    return result


def _config_arg(config: str | None) -> list[str]:
    return [config] if config else []


def evaluate_both(config: str | None, common: list[str], out_dir: Path, env: dict) -> dict:
    """Both final policies on the same held-out prompts (``mempo eval`` on the chaos cluster)."""
    cmd = [MEMPO, "eval", *_config_arg(config), *common, "ray.app_prefix=eval-", f"train.run_dir={out_dir / 'eval'}",
           f"--policy=unfaulted={out_dir / 'unfaulted' / 'policy'}", f"--policy=faulted={out_dir / 'faulted' / 'policy'}",
           "--pair=unfaulted:faulted", "--report"]
    with open(out_dir / "eval.log", "w") as log:
        code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    delete_apps("eval-")
    if code != 0:
        raise RuntimeError(f"mempo eval failed ({code}); see {out_dir / 'eval.log'}")
    return em_outcome(out_dir / "eval" / "episodes.jsonl")


def report(result: dict) -> str:
    """report.md: faults injected / survived per kind with their step overhead, REST, outcome, violations."""
    over = result.get("overhead", {})
    lines = [f"# mempo chaos: {result['steps']} steps, seed {result['seed']}", "",
             f"Faulted run {result.get('faulted_s', 0):.0f} s (unfaulted twin {result.get('unfaulted_s', 0):.0f} s); "
             f"driver starts {len(result.get('driver_exits', []))}; median step without a fault "
             f"{over.get('median_clean_step_s', 0):.1f} s.", "",
             "| fault | injected | missed | survived | mean step overhead (s) |", "|---|---|---|---|---|"]
    records = result.get("faults", [])
    for kind in sorted({r["kind"] for r in records}):
        mine = [r for r in records if r["kind"] == kind]
        hit = [r for r in mine if "missed" not in r]
        survived = len(hit) if result.get("finished") else 0
        lines.append(f"| {kind} | {len(hit)} | {len(mine) - len(hit)} | {survived} | "
                     f"{over.get(kind, {}).get('overhead_s', 0.0):+.1f} |")
    rest = result.get("rest", {})
    lines += ["", f"REST load: {rest.get('calls', 0)} calls, by status {rest.get('by_status', {})}, latency p50 "
              f"{_s(rest.get('p50'))}, p99 {_s(rest.get('p99'))}, max {_s(rest.get('max'))}.", ""]
    if "outcome" in result:
        o = result["outcome"]
        lines += [f"Held-out EM over {o['prompts']} prompts: unfaulted {o['unfaulted_em']:.3f} "
                  f"[{o['unfaulted_ci'][0]:.3f}, {o['unfaulted_ci'][1]:.3f}], faulted {o['faulted_em']:.3f} "
                  f"({'within' if o['within_unfaulted_ci'] else 'outside'} the unfaulted CI); faulted - unfaulted "
                  f"{o['faulted_minus_unfaulted']:+.3f} [{o['diff_ci'][0]:+.3f}, {o['diff_ci'][1]:+.3f}].", ""]
    v = result["violations"]
    lines += [f"Invariant violations: {len(v)}", ""] + [f"- {x}" for x in v]
    return "\n".join(lines) + "\n"


def _s(x) -> str:
    return "n/a" if x is None else f"{x:.2f} s"
