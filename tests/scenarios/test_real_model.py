"""A real pretrained LM (SmolLM2-135M-Instruct, `make model`) through the stages at their smallest
sizes: the scorer's REST endpoint tells a memory that kept the answer from one that dropped it, and
one SFT step on the world's transcripts trains it from where it starts (a loss a pretrained model
has, not a random one's). Skips, saying why, where the package that ships the weights is missing."""

import json
import math
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from services.world import gguf_model
from services.config import load_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    try:
        return gguf_model.smollm2("float32")
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"SmolLM2 is not available here: {e}")


def _weights(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_one_sft_step_on_smollm2(ray_cluster, smollm2, tmp_path):
    from services.pipeline.sft import run_sft

    run = tmp_path / "run"
    cfg = load_config("deploy/configs/smollm2.yaml", [
        f"train.run_dir={run}", "train.sft_steps=1", "train.sft_batch_size=2", "learner.micro_token_budget=2048",
        "learner.num_cpus_per_worker=0.5"])
    out = run_sft(cfg, log_fn=lambda *_: None)
    [row] = [json.loads(line) for line in (run / "sft" / "metrics.jsonl").read_text().splitlines()]
    # a pretrained model already half-knows the turns: a random one would start near ln(49,152) = 10.8
    assert math.isfinite(row["sft_loss"]) and 0 < row["sft_loss"] < 4.0, row
    before, after = _weights(smollm2), _weights(out)
    assert set(after) <= set(before)
    changed = sum(int((after[k] != before[k]).sum()) for k in after)
    assert changed > 0.5 * sum(v.numel() for v in after.values())
    assert all(torch.isfinite(v).all() for v in after.values())


# The REST and RL tests share one pipeline (below); the SFT test above runs first, before it is up.
RL_PREFIX = "smol-rl-"


@pytest.fixture(scope="module")
def smol_pipeline(serve_http, smollm2, tmp_path_factory):
    """The RL step's pipeline (every service on SmolLM2), started before any training: the REST test scores on its
    scorer at the base weights (version 0), then the RL test trains on the same replicas (train() on a running
    pipeline of the same config keeps them), so SmolLM2 is loaded into one scorer replica, not two.
    Yields (config, run directory)."""
    from ray import serve

    from services.common.paths import corpus_needed
    from services.pipeline.apps import Pipeline
    from services.world.build import prepare_world

    run = tmp_path_factory.mktemp("smol") / "rl"
    port = int(serve_http.rsplit(":", 1)[1])
    cfg = load_config("deploy/configs/smollm2.yaml", [
        f"ray.app_prefix={RL_PREFIX}", f"ray.http_port={port}", "train.init_from_sft=false", f"train.run_dir={run}",
        "train.steps=1", "train.prompts_per_step=1", "rollout.n=2", "rollout.max_turns=2",
        "rollout.max_response_tokens=48", "rollout.num_cpus=0.25", "search.num_cpus=0.05", "scorer.num_cpus=0.1",
        "learner.num_cpus_per_worker=0.25", "learner.micro_token_budget=2048", "learner.checkpoint_every=100",
        "learner.lora.rank=8", "learner.lr=1e-4"])
    # deployed as train() deploys it (the same prepared config), so train()'s own start keeps every replica
    pipe = Pipeline.start(prepare_world(cfg, needs=("train.data", "eval.data") + corpus_needed(cfg)))
    try:
        yield cfg, run
    finally:
        running = serve.status().applications  # the RL test shuts the pipeline down itself
        pipe.apps = [a for a in pipe.apps if a in running]
        pipe.shutdown()


def test_scorer_rest_on_smollm2(serve_http, smol_pipeline):
    url = f"{serve_http}/{RL_PREFIX}scorer/score"  # the pipeline's scorer at the base weights (nothing trained yet)
    history = [{"role": "assistant", "content": "<think>\nFind who designed it.\n</think>\n<search>\nEiffel Tower "
                                                "designer\n</search>"},
               {"role": "user", "content": "<information>\nDoc 1 (Title: Eiffel Tower) The tower was designed "
                                           "by the engineer Gustave Eiffel's company.\n</information>"}]
    body = {"question": "Whose company designed the Eiffel Tower?", "history": history, "answer": "Gustave Eiffel"}
    kept = httpx.post(url, timeout=120,
                      json={**body, "memory": "The Eiffel Tower was designed by Gustave Eiffel's company."})
    lost = httpx.post(url, timeout=120, json={**body, "memory": "I searched for the designer of the tower."})
    assert kept.status_code == 200 and lost.status_code == 200, (kept.text, lost.text)
    k, lo = kept.json(), lost.json()
    assert k["policy_version"] == lo["policy_version"] == 0  # SmolLM2 itself: no step trained yet
    assert "".join(k["answer_tokens"]).strip() == "Gustave Eiffel"
    assert k["p_full"] == pytest.approx(lo["p_full"])  # the same history either way
    assert k["r_mem"] > lo["r_mem"] and k["p_mem"] > lo["p_mem"], (k, lo)


def test_one_rl_step_on_smollm2(smol_pipeline):
    """`mempo train`'s loop with every service on the real model, its learner training LoRA adapters
    (learner.lora; the full-parameter update is the tiny model's tests' and the SFT step's above): vLLM
    rolls out, the scorer scores, the learner updates the adapters and publishes the merged 0.5 GB of
    weights to the rollout and scorer replicas. The learner's log-probs of the sampled tokens match the
    engine's: the token path (the SmolLM2 tokenizer's text, its chat template around observations) is
    the one the engine generated. The export is the merged folder plus the adapters as a PEFT folder."""
    from services.pipeline.train import train

    cfg, run = smol_pipeline  # up since the REST test, still at the base weights
    out = train(cfg)
    pipe = out["pipeline"]
    try:
        assert out["step"] == 1
        assert [r["version"] for r in pipe.rollout.handle.broadcast("info").results()] == [1]
        assert [r["version"] for r in pipe.scorer.handle.broadcast("info").results()] == [1]
    finally:
        pipe.shutdown()
    [row] = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "train"]
    assert row["episodes"] == 2 and row["published_replicas"] == 2, row
    assert row["rollout/generated_tokens"] > 0 and row["time/weight_sync_s"] > 0, row
    assert math.isfinite(row["pg_loss"]) and math.isfinite(row["grad_norm"]), row
    assert row["logprob_abs_diff_mean"] < 1e-2, row  # fp32 engine vs fp32 learner on the same weights
    assert (run / "policy" / "config.json").is_file()
    adapter = json.loads((run / "policy" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and Path(adapter["base_model_name_or_path"]) == Path(cfg.model.path).resolve()
