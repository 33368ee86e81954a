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

from services.common import gguf_model
from services.common.config import load_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    try:
        return gguf_model.smollm2("float32")
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"SmolLM2 is not available here: {e}")


def _weights(folder):
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_scorer_rest_on_smollm2(serve_http, smollm2):
    from ray import serve

    from services.scorer.service import scorer_app

    cfg = load_config("deploy/configs/smollm2.yaml", ["scorer.num_cpus=0.25"])
    serve.run(scorer_app(cfg), name="smol-scorer", route_prefix="/smol-scorer")
    try:
        history = [{"role": "assistant", "content": "<think>\nFind who designed it.\n</think>\n<search>\nEiffel Tower "
                                                    "designer\n</search>"},
                   {"role": "user", "content": "<information>\nDoc 1 (Title: Eiffel Tower) The tower was designed "
                                               "by the engineer Gustave Eiffel's company.\n</information>"}]
        body = {"question": "Whose company designed the Eiffel Tower?", "history": history, "answer": "Gustave Eiffel"}
        kept = httpx.post(f"{serve_http}/smol-scorer/score", timeout=120,
                          json={**body, "memory": "The Eiffel Tower was designed by Gustave Eiffel's company."})
        lost = httpx.post(f"{serve_http}/smol-scorer/score", timeout=120,
                          json={**body, "memory": "I searched for the designer of the tower."})
    finally:
        serve.delete("smol-scorer")
    assert kept.status_code == 200 and lost.status_code == 200, (kept.text, lost.text)
    k, lo = kept.json(), lost.json()
    assert "".join(k["answer_tokens"]).strip() == "Gustave Eiffel"
    assert k["p_full"] == pytest.approx(lo["p_full"])  # the same history either way
    assert k["r_mem"] > lo["r_mem"] and k["p_mem"] > lo["p_mem"], (k, lo)


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


def test_one_rl_step_on_smollm2(serve_http, smollm2, tmp_path):
    """`mempo train`'s loop with every service on the real model, its learner training LoRA adapters
    (learner.lora; the full-parameter update is the tiny model's tests' and the SFT step's above): vLLM
    rolls out, the scorer scores, the learner updates the adapters and publishes the merged 0.5 GB of
    weights to the rollout and scorer replicas. The learner's log-probs of the sampled tokens match the
    engine's: the token path (the SmolLM2 tokenizer's text, its chat template around observations) is
    the one the engine generated. The export is the merged folder plus the adapters as a PEFT folder."""
    from services.pipeline.train import train

    run = tmp_path / "rl"
    port = int(serve_http.rsplit(":", 1)[1])
    cfg = load_config("deploy/configs/smollm2.yaml", [
        "ray.app_prefix=smol-rl-", f"ray.http_port={port}", "train.init_from_sft=false", f"train.run_dir={run}",
        "train.steps=1", "train.prompts_per_step=1", "rollout.n=2", "rollout.max_turns=2",
        "rollout.max_response_tokens=48", "rollout.num_cpus=0.25", "search.num_cpus=0.05", "scorer.num_cpus=0.1",
        "learner.num_cpus_per_worker=0.25", "learner.micro_token_budget=2048", "learner.checkpoint_every=100",
        "learner.lora.rank=8", "learner.lr=1e-4"])
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
