"""The SFT cold start: teach the policy the MemPO turn grammar from finished trajectories.

    mempo sft deploy/configs/tiny.yaml            # -> <train.run_dir>/sft/model (Hugging Face dir)

Trajectories are JSONL rows with ``messages`` ([system, user, assistant, user(observation), ...])
and ``em``; the embedded world's oracle writes them (``world.oracle_trajectories``). Rows below
``train.sft_min_em`` are dropped (rejection sampling). Every assistant turn becomes one sample
under the context the agent would see at that turn (``rollout.memory_window``: MemPO's
system + question + previous turn, or the full history for the Search-R1-like baseline), built by
the rollout's own EpisodeBuilder, so SFT and RL train on identically shaped contexts. Loss is
cross-entropy on the assistant tokens only, on the same FSDP learner group RL uses
(``learner.world_size`` ranks, lr ``learner.sft_lr``), ``train.sft_epochs`` passes (or ``train.sft_steps``
steps) in batches of ``train.sft_batch_size`` turns.

An interruption loses at most the steps since the last checkpoint: every ``train.sft_checkpoint_every``
steps the group's sharded checkpoint, with the data order's position, goes to
``<run_dir>/sft/checkpoints``; the same command resumes from the latest one when its settings (source
model, samples, steps, batch, learning rate and schedule, seed, context rule, renaming) are the same,
and starts afresh, saying so, when they are not. A resumed run ends with the same weights as an
uninterrupted one. The checkpoints are removed once the policy is exported.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from services.config import MempoConfig
from services.common.messages import ChatMessage, Prompt, TrainingBatch
from services.common.model_checks import check_model, lr_warnings
from services.common.paths import data_path, model_path
from services.learner.checkpoint import latest_complete, saved_extra
from services.learner.samples import Sample, pack
from services.pipeline.apps import connect
from services.pipeline.runlog import RunLog
from services.pipeline.trackers import check_loggers, open_trackers
from services.world.build import prepare_world
from services.world.name_swap import NameSwapper
from services.world.pretrain import lr_at

log = logging.getLogger("mempo.sft")


def sft_dir(cfg: MempoConfig) -> Path:
    return Path(cfg.train.sft_dir) if cfg.train.sft_dir else Path(cfg.train.run_dir) / "sft" / "model"


SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "observation": "user", "tool": "user"}


def transcript_messages(row: dict) -> list[dict] | None:
    """A row's chat messages: OpenAI/TRL ``messages`` ({role, content}) or ShareGPT ``conversations``
    ({from, value}); None when it has neither."""
    if isinstance(row.get("messages"), list):
        return row["messages"]
    if isinstance(row.get("conversations"), list):
        return [{"role": SHAREGPT_ROLES.get(str(m.get("from")), str(m.get("from"))), "content": m.get("value")}
                for m in row["conversations"] if isinstance(m, dict)]
    return None


def load_transcripts(path: Path, min_em: float, system_prompt: str) -> list[list[dict]]:
    """Finished MemPO transcripts from JSONL, each under ``system_prompt`` (the rule of
    services/common/data.py: a transcript's own system message is replaced, one without gets it), so
    SFT teaches the turns under the instructions the agent sees in RL. A row's ``em`` (default 1)
    is its answer's score, for rejection sampling."""
    rows, kept = 0, []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rows += 1
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"train.sft_data: {path} line {n} is not JSON ({e.msg})") from None
            msgs = transcript_messages(row) if isinstance(row, dict) else None
            if msgs and msgs[0].get("role") == "system":
                msgs = msgs[1:]
            ok = (isinstance(msgs, list) and len(msgs) >= 2 and msgs[0].get("role") == "user"
                  and all(isinstance(m.get("content"), str) and m.get("role") in ("user", "assistant") for m in msgs)
                  and any(m["role"] == "assistant" for m in msgs))
            if not ok:
                raise ValueError(f"train.sft_data: {path} line {n}: needs 'messages' (or ShareGPT 'conversations') = "
                                 f"[system (optional), user, assistant, ...] with text contents (docs/data.md)")
            if float(row.get("em", 1.0)) >= min_em:
                kept.append([{"role": "system", "content": system_prompt}] + msgs)
    log.info("SFT data: %d of %d trajectories pass em >= %.2f", len(kept), rows, min_em)
    return kept


def rename_share(transcripts: list[list[dict]], world_file: Path, share: float, seed: int, log_fn=print) -> list[list[dict]]:
    """Replace a ``share`` of the transcripts (chosen by ``seed``) by copies with fresh entity names."""
    swapper = NameSwapper.from_world_file(world_file)
    rng = random.Random(seed + 11)
    out = [swapper.rename(t, rng) if rng.random() < share else t for t in transcripts]
    log_fn(f"SFT data: {sum(a is not b for a, b in zip(out, transcripts))} of {len(out)} transcripts renamed "
           f"(train.sft_name_swap={share})")
    return out


def turn_samples(cfg: MempoConfig, tokenizer, transcripts: list[list[dict]]) -> list[tuple[np.ndarray, int]]:
    """(context + response ids, context length) for every assistant turn, in memory-mode contexts."""
    from services.rollout.records import EpisodeBuilder, episode_from_transcript  # transformers at its top

    builder = EpisodeBuilder(cfg, tokenizer)
    out, dropped, longest = [], 0, 0
    for i, msgs in enumerate(transcripts):
        prompt = Prompt(uid=f"sft-{i}", messages=[ChatMessage(m["role"], m["content"]) for m in msgs[:2]], golds=[[""]])
        ep = episode_from_transcript(builder, prompt, msgs)
        for t in ep.turns:
            n = len(t.context_ids) + len(t.response_ids)
            if n <= cfg.engine.max_model_len:
                out.append((np.concatenate([t.context_ids, t.response_ids]).astype(np.int32), len(t.context_ids)))
            else:
                dropped, longest = dropped + 1, max(longest, n)
    if dropped:  # never a silent drop: a model whose tokenizer cuts text finer makes longer turns
        log.warning("SFT data: %d of %d turns are longer than engine.max_model_len=%d tokens and are left out "
                    "(the longest has %d; engine.max_model_len=%d keeps them all)", dropped, len(out) + dropped,
                    cfg.engine.max_model_len, longest, longest)
    return out


def sft_batch(samples: list[tuple[np.ndarray, int]], step: int) -> TrainingBatch:
    """Loss on each sample's response (the ids after its context); no advantages."""
    return pack([Sample(ids[:ctx], ids[ctx:], group=i) for i, (ids, ctx) in enumerate(samples)], step=step)


def cpus_per_rank(free_cpus: float, world_size: int, configured: float) -> float:
    """The CPUs each SFT rank reserves on a local cluster: an equal whole share of the free ones, or,
    when that share is under one core (a busy cluster), ``learner.num_cpus_per_worker`` as configured."""
    share = free_cpus // world_size
    return share if share >= 1 else configured


def run_sft(cfg: MempoConfig, log_fn=print) -> Path:
    """Train and export; returns the Hugging Face directory of the cold-start policy."""
    from transformers import AutoTokenizer  # transformers on use

    from services.learner.group import LearnerGroup  # Ray at its top

    cfg = prepare_world(cfg, needs=("train.sft_data",)).model_copy(deep=True)
    cfg.learner.kl_coef = 0.0  # no reference model in SFT
    source = str(model_path(cfg))
    check_model(source)
    check_loggers(cfg.train.loggers)  # a missing wandb / mlflow package, before anything starts
    for line in lr_warnings(cfg, source, sft=True):
        log_fn(f"warning: {line}")
    tokenizer = AutoTokenizer.from_pretrained(source)
    transcripts = load_transcripts(data_path(cfg, "sft"), cfg.train.sft_min_em, cfg.rollout.system_prompt)
    if cfg.train.sft_name_swap > 0:
        transcripts = rename_share(transcripts, data_path(cfg, "sft").parent / "world.json",
                                   cfg.train.sft_name_swap, cfg.train.seed, log_fn)
    samples = turn_samples(cfg, tokenizer, transcripts)
    if not samples:
        raise ValueError("no SFT samples: check train.sft_data and train.sft_min_em")
    per_step = cfg.train.sft_batch_size
    steps = cfg.train.sft_steps or cfg.train.sft_epochs * max(1, len(samples) // per_step)
    log_fn(f"SFT: {len(samples)} turns, {steps} steps of {per_step} on {cfg.learner.world_size} rank(s), "
           f"lr {cfg.learner.sft_lr}")
    connect(cfg, with_serve=False)
    if not cfg.ray.address:  # a local cluster of ours: give the ranks its free cores (all, when nothing else runs)
        import ray  # Ray on use

        cfg.learner.num_cpus_per_worker = cpus_per_rank(ray.available_resources().get("CPU", 0.0),
                                                        cfg.learner.world_size, cfg.learner.num_cpus_per_worker)
    group = LearnerGroup(cfg, source)
    home = Path(cfg.train.run_dir) / "sft"  # its metrics.jsonl and checkpoints/
    settings = {"source": source, "samples": len(samples), "steps": steps, "batch": per_step, "lr": cfg.learner.sft_lr,
                "schedule": cfg.train.sft_lr_schedule, "seed": cfg.train.seed,
                "context": cfg.rollout.memory_window, "name_swap": cfg.train.sft_name_swap}
    rng = random.Random(cfg.train.seed)
    order: list[int] = []
    done = _resume(group, home, settings, rng, order, log_fn)
    every = cfg.train.sft_checkpoint_every or max(1, steps // 20)
    finished = False
    runlog = RunLog(home, resume_step=done, trackers=open_trackers(cfg, home, "sft", done))
    try:
        group.set_lr(cfg.learner.sft_lr)
        t0 = time.perf_counter()
        for step in tqdm(range(done + 1, steps + 1), desc="sft", unit="step", dynamic_ncols=True, initial=done,
                         total=steps):
            if len(order) < per_step:
                fresh = list(range(len(samples)))
                rng.shuffle(fresh)
                order += fresh
            chosen = order[:per_step]
            if cfg.train.sft_lr_schedule == "cosine":  # 5% warm-up, then cosine down to a tenth
                group.set_lr(lr_at(step - 1, steps, cfg.learner.sft_lr, max(1, steps // 20)))
            metrics = group.sft_step(sft_batch([samples[i] for i in chosen], step))
            del order[:per_step]
            runlog.write("sft", step, metrics, console=step % max(1, steps // 10) == 0 or step == steps)
            if step % every == 0 and step < steps:
                _checkpoint(group, home, step, settings, rng, order)
        out = sft_dir(cfg)
        out.parent.mkdir(parents=True, exist_ok=True)
        group.export_hf(str(out), source)
        shutil.rmtree(home / "checkpoints", ignore_errors=True)  # the exported policy is the result
        log_fn(f"SFT done in {time.perf_counter() - t0:.0f}s; policy in {out}")
        runlog.artifacts([runlog.path])
        finished = True
        return out
    finally:
        runlog.close(ok=finished)
        group.shutdown()


def _checkpoint(group, home: Path, step: int, settings: dict, rng: random.Random, order: list[int]) -> None:
    """The group's state after ``step`` with the data order's position; older SFT checkpoints go."""
    before = latest_complete(home)
    version, state, gauss = rng.getstate()
    path = group.save_checkpoint(str(home), step, {"sft": {"step": step, "settings": settings, "order": order,
                                                           "rng": [version, list(state), gauss]}})
    if before is not None and before != Path(path):
        shutil.rmtree(before, ignore_errors=True)


def _resume(group, home: Path, settings: dict, rng: random.Random, order: list[int], log_fn) -> int:
    """Load the latest SFT checkpoint of ``home`` made with the same settings; returns its step (0: none).
    One made with other settings is removed, not resumed."""
    path = latest_complete(home)
    if path is None:
        return 0
    saved = saved_extra(path).get("sft", {})
    if saved.get("settings") != settings:
        log_fn(f"SFT: the checkpoint in {path} was made with other settings ({saved.get('settings')}, now "
               f"{settings}); starting afresh")
        shutil.rmtree(home / "checkpoints", ignore_errors=True)
        return 0
    got = group.resume(str(home))
    if got is None:  # learner.resume=never
        return 0
    version, state, gauss = saved["rng"]
    rng.setstate((version, tuple(state), gauss))
    order[:] = saved["order"]
    log_fn(f"SFT: resuming after step {saved['step']} of {settings['steps']} ({path})")
    return int(saved["step"])
