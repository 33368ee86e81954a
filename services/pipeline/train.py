"""The MemPO training loop. Read it top to bottom; every stage is a Serve deployment.

    mempo train deploy/configs/tiny.yaml [key=value ...]

One step: prompts -> rollout (ObjectRefs to trajectory batches) -> scorer (refs to memory scores)
-> learner (advantages, PPO/GRPO update, checkpoint, publish the new weights to the rollout and
scorer replicas) -> log. Each stage is called the same way, through its driver (``pipe.rollout``,
``pipe.scorer``, ``pipe.learner``); the driver forwards refs and never decodes a trajectory batch.
Every ``train.eval_every`` steps the current policy is evaluated on held-out prompts.

Baselines run on the same loop: ``algorithm.use_memory_reward=false`` (memory context without the
memory reward, MEM1-like) and ``rollout.memory_window=full`` (full history, Search-R1-like).
Running again on the same ``train.run_dir`` resumes from its latest complete checkpoint; Ctrl-C
(or an error) writes a checkpoint before it exits.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from services.common.config import MempoConfig, to_yaml
from services.common.data import PromptStream, load_prompts
from services.common.messages import PromptBatch
from services.common.paths import data_path
from services.pipeline.apps import Pipeline
from services.pipeline.evaluate import eval_prompts, evaluate, flatten
from services.pipeline.runlog import RunLog
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


@contextmanager
def timed(times: dict[str, float], stage: str):
    """Records the wall time of the ``with`` body as ``times[stage]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times[stage] = time.perf_counter() - t0


def stage_times(took: dict[str, float], publish_s: float) -> dict:
    """Wall time of each stage in this step, and how long each stage sat idle meanwhile. The
    learner's call includes publishing the new weights, reported apart as weight_sync."""
    busy = dict(took, learner=took["learner"] - publish_s, weight_sync=publish_s)
    step_s = sum(took.values())
    out = {f"time/{k}_s": v for k, v in busy.items()}
    out.update({f"idle/{k}_s": step_s - v for k, v in busy.items()})
    out["step_s"] = step_s
    return out


def train(cfg: MempoConfig) -> dict:
    cfg = starting_policy(prepare_world(cfg))  # builds the embedded world if the config uses it
    run_dir = Path(cfg.train.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    pipe = Pipeline.start(cfg)  # search, rollout, scorer, learner: each its own Serve application
    (run_dir / "pipeline.yaml").write_text(to_yaml(pipe.cfg))  # what is deployed (`mempo scale` reads it)
    prompts = PromptStream(load_prompts(data_path(cfg, "train")), cfg.train.prompts_per_step, cfg.train.seed)
    held_out = eval_prompts(cfg, cfg.eval.during_training_per_k)
    step = pipe.learner.info()["step"]  # > 0 when the learner resumed a checkpoint
    log = RunLog(run_dir, resume_step=step)
    if step == 0:
        log.write("eval", 0, flatten(evaluate(cfg, pipe, held_out, step=0)))  # the starting policy
    bar = tqdm(total=cfg.train.steps, initial=step, desc="mempo train", unit="step", dynamic_ncols=True)
    try:
        while step < cfg.train.steps:
            resynced = pipe.sync_weights(version=step)  # resumed, or a replica was replaced: same policy everywhere
            batch = PromptBatch(prompts.at(step), n=cfg.rollout.n, policy_version=step, step=step,
                                seed=cfg.train.seed)
            took: dict[str, float] = {}
            with timed(took, "rollout"):
                traj_refs = pipe.rollout.rollout(batch)  # ObjectRefs; the bytes go replica -> store -> learner
            with timed(took, "scoring"):
                score_refs = pipe.scorer.score(traj_refs) if cfg.algorithm.use_memory_reward else []
            with timed(took, "learner"):
                stats = pipe.learner.step(traj_refs, score_refs)  # update, checkpoint, publish
            step = stats["step"]
            stats.update(stage_times(took, stats["publish_s"]), rollout_retries=pipe.rollout.stats["retries"],
                         scorer_retries=pipe.scorer.stats["retries"], weights_resynced=float(resynced))
            log.write("train", step, stats)
            bar.update(1)
            if step % cfg.train.eval_every == 0 or step == cfg.train.steps:
                log.write("eval", step, flatten(evaluate(cfg, pipe, held_out, step=step)))
    finally:  # done, Ctrl-C or an error: close the log, checkpoint the current step
        bar.close()
        log.close()
        checkpoint = pipe.learner.save()
        if step < cfg.train.steps:
            print(f"\nstopped at step {step}: checkpoint in {checkpoint}; run the same command to resume", flush=True)
    policy = pipe.learner.export(str(run_dir / "policy"))
    print(f"trained {step} steps; final policy in {policy}, metrics in {log.path}", flush=True)
    return {"step": step, "policy": policy, "metrics": str(log.path), "pipeline": pipe}
