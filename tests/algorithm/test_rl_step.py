"""MemPO's algorithm end to end in one process (no Ray, no Serve, no vLLM): rollout on the grammar model,
memory scores, advantages and one learner update (tests/algorithm/inprocess.py), so a change to a
rule is checked end to end in seconds. The services run the same code in tests/scenarios/."""

import asyncio
import time

import numpy as np
import pytest
import torch

from services.algorithm.advantages import compute_advantages
from services.common.codec import encode
from services.common.data import load_prompts
from services.common.messages import PromptBatch
from services.config import load_config
from services.learner.logprobs import token_logprobs
from services.learner.samples import micro_batches, training_batch
from tests.algorithm.inprocess import InProcessStep

N = 4


@pytest.fixture(scope="module")
def step(world, grammar_model, tmp_path_factory):
    cfg = load_config("deploy/configs/tiny.yaml", [
        f"model.path={grammar_model}", "train.data=world", "search.corpus=world", f"rollout.n={N}",
        "rollout.max_turns=3", "rollout.max_response_tokens=64", "rollout.temperature=1.0", "learner.kl_coef=0",
        "learner.lr=1e-3", "learner.threads=1", f"train.run_dir={tmp_path_factory.mktemp('inprocess')}"])
    s = InProcessStep(cfg)
    yield s
    s.close()


def _prompts(world, cfg, k, n):
    return load_prompts(world / "train.parquet", cfg.rollout.system_prompt, k=k, limit=n)


def test_one_step_rolls_out_scores_and_updates_in_process(step, world):
    cfg = step.cfg
    before = {k: v.clone() for k, v in step.learner.full_state_dict().items()}
    t0 = time.perf_counter()
    traj, scores, adv, m = step.run(_prompts(world, cfg, 2, 2))
    print(f"\n[in-process step] {len(traj.groups)} groups x {N}: {time.perf_counter() - t0:.1f}s "
          f"(rollout {traj.metrics['wall_s']:.1f}s, learner {m['seconds']:.1f}s)")
    assert [len(g.episodes) for g in traj.groups] == [N, N]
    turns = [t for g in traj.groups for ep in g.episodes for t in ep.turns]
    assert all(len(t.response_logprobs) == len(t.response_ids) for t in turns)  # tokens in, log-probs with them
    assert any(t.observation_ids.size for t in turns), "no episode searched"
    blocks = [(t.mem_start, t.mem_end) for t in turns if t.turn >= 2 and t.mem_start >= 0]
    assert len(scores.scores) == len(blocks) > 0  # every <mem> block after the first turn scored once
    assert all(np.isfinite(s.r_mem) and s.r_mem == pytest.approx(s.p_mem - s.p_full) for s in scores.scores)
    assert set(adv.token_advantages) == {(g, e, t) for g, grp in enumerate(traj.groups)
                                        for e, ep in enumerate(grp.episodes) for t in range(len(ep.turns))}
    assert np.isfinite(m["pg_loss"]) and m["grad_norm"] > 0 and m["tokens"] == sum(len(t.response_ids) for t in turns)
    after = step.learner.full_state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the update changed no weight"


def test_the_update_raises_the_tokens_with_positive_advantage(step, world):
    """The learner's gradient follows the advantages: after one update the tokens with A > 0 gained
    log-probability against those with A < 0 (measured on the learner's policy, before and after)."""
    step.publish()  # the engine samples with the learner's current weights
    batch = PromptBatch(_prompts(world, step.cfg, 1, 2), n=N, policy_version=step.engine.version, seed=0)
    traj = asyncio.run(step.agent.run(batch))
    adv = compute_advantages(traj, step.scorer.score_trajectories(traj, step.engine.version), step.cfg.algorithm)
    rng = np.random.default_rng(0)  # every token a real advantage, whatever the rewards were
    for k, v in adv.token_advantages.items():
        adv.token_advantages[k] = rng.choice([-1.0, 1.0], size=v.shape).astype(np.float32)
    tb = training_batch(traj, adv)
    micro = micro_batches(tb, token_budget=4096)

    def logps():
        with torch.no_grad():
            return [token_logprobs(step.learner.model, mb)[0] for mb in micro]

    lp0 = logps()
    step.learner.train_step(encode(tb))
    lp1 = logps()
    up, down = [], []
    for mb, a, b in zip(micro, lp0, lp1):
        keep = mb.loss_mask > 0
        delta = (b - a)[keep]
        up.append(delta[mb.advantages[keep] > 0])
        down.append(delta[mb.advantages[keep] < 0])
    up, down = torch.cat(up), torch.cat(down)
    assert up.mean() > down.mean(), (float(up.mean()), float(down.mean()))


def test_an_sft_step_runs_on_the_same_learner(step, world):
    """The cold start's update (cross-entropy on the assistant tokens) on the in-process learner."""
    from services.learner.samples import Sample, pack

    ids = step.tokenizer("<mem>\nQ1: who?\n</mem>\n<think>look it up</think>\n<search>who</search>")["input_ids"]
    m = step.learner.sft_step(encode(pack([Sample(np.array(ids[:4]), np.array(ids[4:]))], step=0)))
    assert np.isfinite(m["sft_loss"]) and m["sft_loss"] > 0 and m["tokens"] == len(ids) - 4
