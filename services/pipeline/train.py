"""The MemPO training loop. Read it top to bottom; every stage is a Serve deployment.

    mempo train deploy/configs/tiny.yaml [key=value ...]

One step: prompts -> rollout (ObjectRefs to trajectory batches; each rollout call's result goes to
the scorer as it lands, for refs to memory scores) -> learner (advantages, PPO/GRPO update,
checkpoint, publish the new weights to the rollout and scorer replicas) -> log. Each stage is called
through its driver (``pipe.rollout``, ``pipe.scorer``, ``pipe.learner``); the driver forwards refs
and never decodes a trajectory batch. Rollout and scoring run on a background thread
(``RolloutsAhead``, services/pipeline/ahead.py): with ``train.max_staleness=0`` it waits for each
update (the synchronous loop); with s > 0 it generates up to s steps ahead while the learner trains,
and the learner's loss corrects for the lag. Every ``train.eval_every`` steps (and at the start and the
last step; 0 = never) the current policy is evaluated on held-out prompts.

Baselines run on the same loop, each a set of config overrides registered in
services/pipeline/compare.py (``VARIANTS``: MEM1-like, Search-R1-like, ...).
Running again on the same ``train.run_dir`` resumes from its latest complete checkpoint; Ctrl-C
(or an error) writes a checkpoint before it exits.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import ray
from tqdm import tqdm

from services.config import MempoConfig, to_yaml
from services.common.data import PromptStream, load_prompts
from services.common.model_checks import check_model, lr_warnings
from services.common.paths import corpus_needed, data_path, model_path
from services.pipeline.ahead import Generated, RolloutsAhead
from services.pipeline.apps import Pipeline
from services.learner.group_samples import decoded_group
from services.learner.ledger import unlogged
from services.pipeline.evaluate import decoder, eval_prompts, evaluate, flatten
from services.pipeline.runlog import RunLog, read_rows
from services.pipeline.trackers import check_loggers, open_trackers
from services.pipeline.sft import sft_dir
from services.world.build import prepare_world


def starting_policy(cfg: MempoConfig) -> MempoConfig:
    """RL starts from the SFT cold start (``train.init_from_sft``), else from ``model.path``."""
    if not cfg.train.init_from_sft:
        return cfg
    sft = sft_dir(cfg)
    if not (sft / "config.json").is_file():
        raise FileNotFoundError(f"no SFT policy at {sft}: run `mempo sft` with this config first, "
                                f"or set train.init_from_sft=false to start from model.path")
    cfg = cfg.model_copy(deep=True)
    cfg.model.path = str(sft)
    return cfg


def stage_times(batch: Generated, stats: dict, step_s: float) -> dict:
    """Busy and idle seconds of each stage during one step (``step_s``: wall time between two
    learner results). Rollout is the driver's wall time of the rollout calls, scoring the scorer's
    own compute (it overlaps the rollout), learner its update without publication, weight_sync the
    publication. With max_staleness 0 the stages take turns, so each one's idle is the others' busy."""
    busy = {"rollout": batch.rollout_s, "scoring": stats.get("scorer/seconds", 0.0),
            "learner": stats.get("busy_s", 0.0), "weight_sync": stats.get("publish_s", 0.0)}
    out = {f"time/{k}_s": v for k, v in busy.items()}
    out.update({f"idle/{k}_s": max(0.0, step_s - v) for k, v in busy.items()})
    out.update(step_s=step_s, scoring_tail_s=batch.scoring_tail_s, rollout_waited_s=batch.waited_s,
               rollout_started_at_version=float(batch.started_at_version), **batch.pool)
    return out


def engine_busy_share(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    """{"engine_busy_share": the share of ``seconds`` the rollout engines spent generating}, over the
    replicas alive at the end (``Pipeline.engine_busy`` before and after; a replica started meanwhile
    counts from its start); {} when no replica answered."""
    if not after or seconds <= 0:
        return {}
    busy = sum(min(seconds, max(0.0, b - before.get(r, 0.0))) for r, b in after.items())
    return {"engine_busy_share": busy / (seconds * len(after))}


def log_unlogged(log: RunLog, run_dir: Path, step: int) -> int:
    """Write the train rows of the steps up to ``step`` that the learner trained and this log lacks: a step
    the learner finished after the last run's driver had stopped waiting for it (a stop while the update
    ran) is in the learner's ledger (services/learner/ledger.py), not in metrics.jsonl. Returns how many."""
    rows = unlogged(run_dir, {r["step"] for r in read_rows(log.path, "train")}, step)
    for row in rows:
        log.write("train", row["step"], row | {"recovered_from_ledger": 1.0})
    return len(rows)


def train(cfg: MempoConfig) -> dict:
    # builds the embedded world if the config uses it; with the user's own data, every path it reads must be given
    cfg = starting_policy(prepare_world(cfg, needs=("train.data", "eval.data") + corpus_needed(cfg)))
    check_model(model_path(cfg), "model.path" if not cfg.train.init_from_sft else "the SFT policy")
    for line in lr_warnings(cfg, model_path(cfg), sft=False):
        logging.getLogger("mempo.train").warning("%s", line)
    check_loggers(cfg.train.loggers)  # a missing wandb / mlflow package, before anything starts
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    pipe = Pipeline.start(cfg)  # search, rollout, scorer, learner: each its own Serve application
    (run_dir / "pipeline.yaml").write_text(to_yaml(pipe.cfg))  # what is deployed (`mempo scale` reads it)
    prompts = PromptStream(load_prompts(data_path(cfg, "train"), cfg.rollout.system_prompt, setting="train.data"),
                           cfg.train.prompts_per_step, cfg.train.seed)
    held_out = eval_prompts(cfg, cfg.eval.during_training_per_k)
    step = pipe.learner.info()["step"]  # > 0 when the learner resumed a checkpoint
    log = RunLog(run_dir, resume_step=step, trackers=open_trackers(cfg, run_dir, "train", step))
    log_unlogged(log, run_dir, step)
    decode = decoder(cfg)  # for the sampled training groups (groups.jsonl, read by `mempo view`)
    periodic = cfg.train.eval_every > 0
    if step == 0 and periodic:
        log.write("eval", 0, flatten(evaluate(cfg, pipe, held_out, step=0)))  # the starting policy
    bar = tqdm(total=cfg.train.steps, initial=step, desc="mempo train", unit="step", dynamic_ncols=True)
    ahead = RolloutsAhead(cfg, pipe, prompts, first_step=step)  # rollout + scoring, up to max_staleness steps ahead
    try:
        last, busy = time.perf_counter(), pipe.engine_busy()
        while step < cfg.train.steps:
            batch = ahead.next()  # refs to this step's trajectories and memory scores
            with pipe.rollout.paused(cfg.train.pause_rollout, cfg.ray.call_timeout_s or 600.0):  # turns wait, if set
                update = pipe.learner.step(batch.traj_refs, batch.score_refs, cfg.train.max_staleness)  # the update
                stats = update.metrics | pipe.learner.publish()  # the new policy to every rollout and scorer replica
            step = stats["step"]
            now, busy_before, busy = time.perf_counter(), busy, pipe.engine_busy()
            stats.update(stage_times(batch, stats, now - last), rollout_retries=pipe.rollout.stats["retries"],
                         **engine_busy_share(busy_before, busy, now - last),
                         scorer_retries=pipe.scorer.stats["retries"], weights_resynced=float(batch.resynced),
                         rollout_failed_s=pipe.rollout.stats["failed_s"],
                         scorer_failed_s=pipe.scorer.stats["failed_s"],
                         weights_republished=float(pipe.republished),
                         **{f"{s}_replica_wait_s": w.waited_s for s, w in pipe.watches.items()},
                         nodes_alive=float(sum(n["Alive"] for n in ray.nodes())))
            log.write_groups(step, [decoded_group(g, decode) for g in update.groups])
            log.write("train", step, stats)
            bar.update(1)
            if periodic and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                log.write("eval", step, flatten(evaluate(cfg, pipe, held_out, step=step)))
                busy = pipe.engine_busy()  # the engines' clock, like the step's, leaves the eval out
            last = time.perf_counter()  # a step's wall time leaves the eval out
            ahead.learner_at(step)  # after the eval, so a synchronous run never samples during one
    finally:  # done, Ctrl-C or an error: close the log, checkpoint the current step
        dropped = ahead.close()  # over-sampling: the groups in flight and buffered, dropped (docs/architecture.md)
        if dropped:
            log.write("stop", step, dropped, console=False)
        bar.close()
        log.artifacts([log.path, run_dir / "pipeline.yaml"])
        log.close(ok=step >= cfg.train.steps)
        checkpoint = pipe.learner.save()
        if step < cfg.train.steps:
            print(f"\nstopped at step {step}: checkpoint in {checkpoint}; run the same command to resume", flush=True)
    policy = pipe.learner.export(str(run_dir / "policy"))
    # the pipeline handed back serves the final policy: a run resumed complete trained (and published)
    # nothing, so replicas that were handed other weights meanwhile (mempo compare's next start) get it now
    pipe.sync_weights(version=step)
    print(f"trained {step} steps; final policy in {policy}, metrics in {log.path}", flush=True)
    return {"step": step, "policy": policy, "metrics": str(log.path), "pipeline": pipe}
