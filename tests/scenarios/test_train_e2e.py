"""End to end: `mempo train`'s loop on a real Ray cluster with every service deployed.

Two RL steps with the tiny model, a W=2 FSDP learner and 2 rollout replicas; then the run continues
for a third step during which a rollout replica is killed, and the step still trains on the full
batch; then a Ctrl-C during the fifth step leaves a checkpoint of step 4. The pipeline runs under
its own application names (ray.app_prefix) beside the session's.
"""

import json
import threading
import time

import httpx
import pytest
import ray
from ray import serve
from safetensors.torch import load_file

from services.config import load_config
from services.pipeline.runlog import read_rows
from services.pipeline.train import train
from tests.pipeline.serve_waits import wait_while_serve_replaces

pytestmark = pytest.mark.slow
PREFIX = "e2e-"
PROMPTS, N = 4, 2


@pytest.fixture(scope="module")
def run(serve_http, grammar_model, world, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    port = int(serve_http.rsplit(":", 1)[1])
    cfg = load_config("deploy/configs/tiny.yaml", [
        f"ray.app_prefix={PREFIX}", f"ray.http_port={port}", f"model.path={grammar_model}", "train.init_from_sft=false",
        "train.data=world", "eval.data=world", "search.corpus=world",
        f"train.run_dir={run_dir}", "train.steps=2", f"train.prompts_per_step={PROMPTS}", "train.eval_every=2",
        f"rollout.n={N}", "rollout.replicas=2", "rollout.num_cpus=0.2", "rollout.max_turns=3",
        "rollout.max_response_tokens=64", "rollout.groups_per_call=1", "rollout.call_retries=3",
        "search.num_cpus=0.05", "scorer.num_cpus=0.1", "learner.world_size=2", "learner.num_cpus_per_worker=0.1",
        "learner.kl_coef=0", "learner.checkpoint_every=100", "eval.during_training_per_k=2", "eval.objectives=[1, 2]",
        "train.loggers=[tensorboard, mlflow, wandb]", "train.wandb_mode=offline"])
    out = train(cfg)
    yield cfg, out, run_dir
    out["pipeline"].shutdown()


def test_two_steps_change_weights_advance_versions_and_report_every_stage(run, grammar_model):
    cfg, out, run_dir = run
    assert out["step"] == 2
    pipe = out["pipeline"]
    assert pipe.learner.info()["version"] == 2
    versions = [r["version"] for r in pipe.rollout.handle.broadcast("info").results()]
    assert versions == [2, 2]  # both rollout replicas run the newest policy
    assert [r["version"] for r in pipe.scorer.handle.broadcast("info").results()] == [2]

    before = load_file(str(grammar_model / "model.safetensors"))
    after = load_file(str(run_dir / "policy" / "model.safetensors"))
    assert any(not (before[k] == after[k]).all() for k in before), "training changed no weight"

    rows = read_rows(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["version"] == r["step"] and r["episodes"] == PROMPTS * N
        for stage in ("rollout", "scoring", "learner", "weight_sync"):
            assert r[f"time/{stage}_s"] > 0 and r[f"idle/{stage}_s"] >= 0, stage
        for key in ("rollout/generated_tokens", "rollout/tool_failures", "scorer/blocks", "version_lag_max",
                    "logprob_abs_diff_mean", "pg_loss", "grad_norm", "published_replicas"):
            assert key in r, key
        assert r["published_replicas"] == 3  # 2 rollout + 1 scorer
        assert r["version_lag_max"] == 0
    evals = read_rows(run_dir / "metrics.jsonl", "eval")
    assert [e["step"] for e in evals] == [0, 2]
    assert {"k1/em", "k2/em", "em", "tt", "pt"} <= set(evals[-1])
    assert (run_dir / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))


def test_a_complete_run_trained_again_trains_nothing_and_leaves_the_replicas_on_its_policy(run, grammar_model):
    cfg, out, run_dir = run
    pipe = out["pipeline"]
    pipe.publish_model(str(grammar_model), version=0)  # as `mempo compare` hands the next variant its start
    tracked = json.loads((run_dir / "trackers.json").read_text())
    again = train(cfg)  # the same run, complete: resumes at step 2 and trains nothing
    assert again["step"] == 2 and [r["step"] for r in read_rows(run_dir / "metrics.jsonl", "train")] == [1, 2]
    assert [r["version"] for r in again["pipeline"].rollout.handle.broadcast("info").results()] == [2, 2]
    assert [r["version"] for r in again["pipeline"].scorer.handle.broadcast("info").results()] == [2]
    assert json.loads((run_dir / "trackers.json").read_text()) == tracked  # the resumed run: the same tracked runs


def test_the_runs_metrics_reach_mlflow_and_wandb(run):
    # train.loggers=[tensorboard, mlflow, wandb]: read back with MLflow's own client and W&B's run records
    from mlflow.tracking import MlflowClient

    from tests.pipeline.test_trackers import history, wandb_records

    cfg, out, run_dir = run
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    tracked = client.get_run(run_id)
    assert tracked.data.params["rollout.n"] == str(N) and tracked.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/reward_mean"))[:2] == [1, 2]
    assert sorted(m.step for m in client.get_metric_history(run_id, "eval/em"))[:2] == [0, 2]
    assert {a.path for a in client.list_artifacts(run_id)} >= {"metrics.jsonl", "pipeline.yaml"}
    rows = history(wandb_records(run_dir))
    assert [h["_step"] for h in rows if "train/reward_mean" in h][:2] == [1, 2]


def test_mempo_view_of_the_run_in_a_real_browser_re_scores_an_edited_memory_through_the_live_scorer(
        run, serve_http, tmp_path):
    from services.pipeline.evaluate import eval_prompts, run_eval
    from services.pipeline.report import write_report
    from services.pipeline.view import make_server
    from tests.pipeline.browser import Browser

    cfg, out, run_dir = run
    groups = [json.loads(line) for line in (run_dir / "groups.jsonl").read_text().splitlines()]
    assert [g["step"] for g in groups] == [1, 1, 2, 2]  # train.sample_groups=2 per step
    assert all(len(g["episodes"]) == N and all("reward" in e and "a_out" in e for e in g["episodes"]) for g in groups)
    from services.world.build import prepare_world

    resolved = prepare_world(cfg)
    evals = {"rl": run_eval(resolved, out["pipeline"], eval_prompts(resolved, 2))}  # as `mempo eval --report`
    write_report(run_dir, {n: r.table() for n, r in evals.items()}, runs=evals)
    samples = json.loads((run_dir / "samples.json").read_text())
    server = make_server(run_dir, 0, f"{serve_http}/{PREFIX}scorer/score")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with Browser.start(tmp_path) as b:
            b.open(f"http://127.0.0.1:{server.server_address[1]}/", ready="document.body.dataset.ready === '1'")
            print(f"\nmempo view page ready in {b.js('document.body.dataset.readyMs')} ms (headless chromium)")
            table = json.loads((run_dir / "eval.json").read_text())
            assert b.js("document.querySelectorAll('#eval-table tbody tr').length") == sum(map(len, table.values()))
            assert b.js("document.querySelectorAll('.episode-item').length") == sum(
                len(v) for per_k in samples.values() for v in per_k.values())
            assert b.js("document.querySelectorAll('.group-item').length") == len(groups)
            b.click("nav button[data-tab=episodes]")
            with_memory = next(i for i, (p, k, s) in enumerate(
                (p, k, s) for p, per_k in samples.items() for k, v in per_k.items() for s in v)
                if any(t["mem"] for t in s["turns"]))
            b.js(f"document.querySelectorAll('.episode-item')[{with_memory}].click()")
            assert b.js("document.querySelectorAll('#episode-detail .turn').length") >= 2
            assert b.js("document.querySelectorAll('#episode-detail .heat .tok').length") > 0
            b.js("document.querySelector('#episode-detail details.try').open = true")
            b.js("document.querySelector('#episode-detail details.try textarea').value = 'I know nothing yet.'")
            b.click("#episode-detail details.try button.rescore")
            deadline = time.time() + 120
            while not b.js("!!document.querySelector('#episode-detail .rescored')") and time.time() < deadline:
                error = b.js("document.querySelector('#episode-detail details.try div').textContent")
                assert "scoring" in error or not error, error
                time.sleep(0.2)
            text = b.js("document.querySelector('#episode-detail .rescored').textContent")
            assert "R_mem" in text and "P_mem" in text, text
            assert b.js("document.querySelectorAll('#episode-detail .rescored .heat .tok').length") > 0
            b.screenshot(run_dir / "view.png")
    finally:
        server.shutdown()
        server.server_close()


def _replica_actors(app: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#")]


def _kill_a_rollout_replica_while_agents_search(app: str, serve_http: str, ready, killed: dict) -> None:
    """Once ``ready()`` holds, wait for the next search an agent makes (rollout calls are in flight then: a
    fixed delay was too early or too late on a loaded CI machine) and kill one rollout replica for good."""
    def searches() -> int:
        return httpx.get(f"{serve_http}/{PREFIX}search/health", timeout=10).json()["requests"]

    deadline = time.time() + 300
    while time.time() < deadline and not ready():
        time.sleep(0.05)
    before = searches()
    while time.time() < deadline and searches() == before:
        time.sleep(0.02)
    victim = _replica_actors(app)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    killed["name"] = victim


def test_resume_and_a_rollout_replica_killed_mid_step_still_trains_on_the_full_batch(run, serve_http):
    cfg, out, run_dir = run
    cfg3 = cfg.model_copy(deep=True)
    cfg3.train.steps = 3
    app = f"{PREFIX}rollout"
    killed = {}

    def step_3_started() -> bool:
        # step 3 starts after the redeploy (a no-op: only driver fields changed)
        rows = read_rows(run_dir / "metrics.jsonl", "train")
        return bool(rows) and rows[-1]["step"] == 2 and (run_dir / "pipeline.yaml").stat().st_mtime > started

    def kill_when_rollout_runs():
        _kill_a_rollout_replica_while_agents_search(app, serve_http, step_3_started, killed)

    replicas_before = set(_replica_actors(app))
    started = time.time()
    killer = threading.Thread(target=kill_when_rollout_runs, daemon=True)
    killer.start()
    out3 = train(cfg3)
    killer.join(timeout=5)
    assert killed, "the replica was never killed"
    assert replicas_before - {killed["name"]} <= set(_replica_actors(app))  # train() on a running pipeline restarts none
    assert out3["step"] == 3
    rows = read_rows(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == [1, 2, 3]  # resumed at 2, nothing duplicated
    last = rows[-1]
    assert last["episodes"] == PROMPTS * N and last["rollout/episodes"] == PROMPTS * N
    assert last["rollout_retries"] >= 1
    assert last["version"] == 3
    # Serve replaces the dead replica: waited for while Serve is starting it, however long that takes
    wait_while_serve_replaces(lambda: len(_replica_actors(app)) == 2, app, "rollout")
    serve.status()  # the controller still answers


def test_ctrl_c_writes_a_checkpoint_and_a_rerun_resumes(run, serve_http):
    import os
    import signal

    cfg, out, run_dir = run
    cfg5 = cfg.model_copy(deep=True)
    cfg5.train.steps = 5
    assert not (run_dir / "checkpoints" / "step_00000004").exists()  # checkpoint_every is 100
    fired = {}

    def interrupt_during_step_5():
        # Ctrl-C in a terminal sends SIGINT to the process; so does this (a real signal, which also wakes
        # a main thread blocked in a wait, unlike _thread.interrupt_main, which only sets a flag and was
        # lost once in a loaded full-suite run). The handler is Python's own, as in a `mempo train` shell.
        deadline = time.time() + 900
        searches = lambda: httpx.get(f"{serve_http}/{PREFIX}search/health", timeout=10).json()["requests"]  # noqa: E731
        while time.time() < deadline:
            evals = read_rows(run_dir / "metrics.jsonl", "eval")
            if evals and evals[-1]["step"] == 4:  # step 4 and its eval are done: what searches next is step 5
                before = searches()
                while time.time() < deadline and searches() == before:
                    time.sleep(0.02)  # until step 5's agents are mid-episode: train() is certainly running
                fired["after_s"] = time.time() - started
                fired["handler"] = signal.getsignal(signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.2)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.time()
    threading.Thread(target=interrupt_during_step_5, daemon=True).start()
    try:
        train(cfg5)
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail(f"train() returned without a KeyboardInterrupt; the interrupt was "
                    + (f"sent {fired['after_s']:.0f} s after the start (SIGINT handler {fired['handler']!r})"
                       if fired else "never sent (no step 4 row in 900 s)"))
    finally:
        signal.signal(signal.SIGINT, previous)
    # the interrupt lands in step 5's rollout (or, if slow, its learner update, which the save waits for)
    from services.learner.checkpoint import latest_complete

    latest = latest_complete(run_dir)
    trainer = json.loads((latest / "trainer.json").read_text())
    assert latest.name in ("step_00000004", "step_00000005")
    assert trainer["step"] == int(latest.name.split("_")[1]) == trainer["extra"]["version"]
    assert [r["step"] for r in read_rows(run_dir / "metrics.jsonl", "train")][:4] == [1, 2, 3, 4]


def test_max_staleness_one_trains_ahead_within_the_bound(run):
    """The same pipeline, switched to max_staleness=1 (a driver-only field: no replica restarts): the
    rollout of step b + 1 runs while the learner trains step b; no token is more than one version old,
    and the loss's importance weights cover the stale ones."""
    cfg, out, run_dir = run
    cfg7 = cfg.model_copy(deep=True)
    cfg7.train.steps, cfg7.train.max_staleness = 7, 1
    out7 = train(cfg7)
    assert out7["step"] == 7
    rows = read_rows(run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in rows] == list(range(1, 8))  # resumed, nothing duplicated
    ahead = [r for r in rows if "rollout_started_at_version" in r and r["step"] >= 6]
    assert ahead, "no step of the staleness-1 run was logged"
    for r in ahead:
        assert r["episodes"] == PROMPTS * N and r["stale_samples_dropped"] == 0
        assert r["version_lag_max"] <= 1 and r["version_lag_token_max"] <= 1
        assert r["rollout_started_at_version"] >= r["step"] - 2  # batch step-1, started at most 1 behind
        assert r["is_weight_max"] <= cfg.learner.is_cap and 0 <= r["is_truncated_share"] <= 1
        print(f"\n[ahead] step {r['step']}: rollout started at version {r['rollout_started_at_version']:.0f}, "
              f"token lag mean {r['version_lag_token_mean']:.2f} max {r['version_lag_token_max']:.0f}, "
              f"IS weight mean {r['is_weight_mean']:.3f} max {r['is_weight_max']:.3f} over "
              f"{r['is_weighted_tokens']:.0f} stale tokens, step {r['step_s']:.1f}s")
    assert [r["version"] for r in out7["pipeline"].rollout.handle.broadcast("info").results()] == [7, 7]


def test_over_sampling_trains_the_first_groups_to_complete_within_the_bound(run, serve_http):
    """The same pipeline, switched to over-sampling (train.over_sampling, a driver-only field): each step
    trains PROMPTS groups of the 6 kept in flight, drawn from the blocks its lag allows; no token more
    than one version old; a rollout replica killed while groups are in flight loses none; every trained
    group once in the learner's ledger."""
    from services.common.data import PromptStream, load_prompts
    from services.common.paths import data_path

    cfg, out, run_dir = run
    cfg10 = cfg.model_copy(deep=True)
    cfg10.train.steps, cfg10.train.max_staleness, cfg10.train.over_sampling = 10, 1, 1.5
    cfg10.train.pause_rollout = True  # the rollout waits while the learner updates; groups in flight continue after
    assert cfg10.train.groups_in_flight == 6
    app, killed = f"{PREFIX}rollout", {}

    def kill_while_groups_run():
        # once step 8 is logged the pool holds the groups of the next steps in flight (6 calls over 2 replicas)
        _kill_a_rollout_replica_while_agents_search(
            app, serve_http, lambda: any(r["step"] == 8 for r in read_rows(run_dir / "metrics.jsonl", "train")), killed)

    killer = threading.Thread(target=kill_while_groups_run, daemon=True)
    killer.start()
    out10 = train(cfg10)
    killer.join(timeout=5)
    assert killed, "the replica was never killed"
    assert out10["step"] == 10
    rows = {r["step"]: r for r in read_rows(run_dir / "metrics.jsonl", "train")}
    assert sorted(rows) == list(range(1, 11))
    for step in (8, 9, 10):
        r = rows[step]
        assert r["episodes"] == PROMPTS * N and r["stale_samples_dropped"] == 0
        assert r["version_lag_token_max"] <= 1 and r["oversample/taken_version_min"] >= step - 2
        assert r["oversample/groups_in_flight"] + r["oversample/groups_buffered"] <= 6 - PROMPTS
        assert 0 < r["engine_busy_share"] <= 1  # the rollout engines' own clock
        print(f"\n[over-sampling] step {step}: launched {r['oversample/groups_launched']:.0f}, in flight "
              f"{r['oversample/groups_in_flight']:.0f}, buffered {r['oversample/groups_buffered']:.0f}, dropped "
              f"{r['oversample/dropped_groups']:.0f}, token lag max {r['version_lag_token_max']:.0f}, "
              f"retries {r['rollout_retries']:.0f}, engines busy {r['engine_busy_share']:.2f}, step {r['step_s']:.1f}s")
    assert rows[10]["rollout_retries"] >= 1  # the killed replica's calls went again, to the other
    stream = PromptStream(load_prompts(data_path(cfg, "train"), cfg.rollout.system_prompt), PROMPTS, cfg.train.seed)
    drawn = {stream.prompt_at(p).uid for p in range(7 * 6, 10 * 6)}  # the blocks of steps 7-9 (trained as 8-10)
    ledger = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    trained = [row["prompts"] for row in ledger if row["event"] == "trained" and row["step"] in (8, 9, 10)]
    assert len(trained) == 3 and all(len(p) == PROMPTS for p in trained)
    uids = [uid for p in trained for uid in p]
    assert len(set(uids)) == 3 * PROMPTS and set(uids) <= drawn  # each group once, from its step's draws
    assert all(groups == 1 and eps == N for p in trained for groups, eps in p.values())
    wait_while_serve_replaces(lambda: len(_replica_actors(app)) == 2, app, "rollout")
