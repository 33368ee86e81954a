"""The rollout deployment on a local Ray with the tiny model and the embedded corpus: record
consistency (tokens, spans, memory rule), versions, in-place weight updates, the CPU engine's threads."""

import os

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from services.common.codec import encode
from services.common.data import load_prompts
from services.common.messages import PromptBatch, TrajectoryBatch, WeightUpdate
from services.common.model_io import chat_ids
from services.common.transport import get_message
from services.rollout.driver import RolloutDriver
from services.rollout.parser import parse_turn

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rollout(rollout_service):
    return rollout_service


@pytest.fixture(scope="module")
def sft_model(grammar_model):
    return grammar_model


@pytest.fixture(scope="module")
def batch(rollout, world):
    handle, cfg = rollout
    version = handle.info.remote().result()["version"]  # other test modules may have published weights
    prompts = load_prompts(world / "test.parquet", cfg.rollout.system_prompt, k=1, limit=4)
    refs = RolloutDriver(handle, cfg).rollout(PromptBatch(prompts=prompts, n=2, policy_version=version, seed=7))
    out = [get_message(r, TrajectoryBatch) for r in refs]
    return prompts, out, version


def test_every_record_is_consistent(batch, sft_model):
    prompts, out, version = batch
    tok = AutoTokenizer.from_pretrained(sft_model)
    groups = [g for b in out for g in b.groups]
    assert [g.prompt.uid for g in groups] == [p.uid for p in prompts]
    assert all(len(g.episodes) == 2 for g in groups)
    mems = searches = 0
    for g in groups:
        prompt_ids = chat_ids(tok, [{"role": m.role, "content": m.content} for m in g.prompt.messages])
        for ep in g.episodes:
            assert ep.prompt_ids.tolist() == list(prompt_ids)
            assert ep.full_ids.tolist() == ep.prompt_ids.tolist() + [
                t for turn in ep.turns for t in turn.response_ids.tolist() + turn.observation_ids.tolist()]
            assert ep.finish_reason in ("answer", "max_turns", "max_context", "invalid_action")
            prev = None
            for turn in ep.turns:
                # the memory rule (window 1): system + question + the previous turn only
                expected = ep.prompt_ids.tolist()
                if prev is not None:
                    expected += ep.full_ids[prev.full_prefix_len : turn.full_prefix_len].tolist()
                assert turn.context_ids.tolist() == expected
                assert turn.full_prefix_len == (len(prompt_ids) if prev is None
                                                else prev.full_prefix_len + len(prev.response_ids) + len(prev.observation_ids))
                # what the parser saw is what the ids decode to
                text = tok.decode(turn.response_ids.tolist())
                parsed = parse_turn(text, turn.turn)
                assert (parsed.action, parsed.problems) == (turn.action, turn.problems)
                assert len(turn.response_logprobs) == len(turn.response_ids) and (turn.response_logprobs <= 0).all()
                assert turn.policy_version == version
                if turn.mem_start >= 0:
                    mems += 1
                    piece = tok.decode(turn.response_ids[turn.mem_start : turn.mem_end].tolist())
                    assert piece.lstrip().startswith("<mem>") and piece.rstrip().endswith("</mem>")
                    assert tok.decode(turn.response_ids[turn.mem_start + 1 : turn.mem_end].tolist()).count("<mem>") == 0
                if turn.action == "search":
                    searches += 1
                    assert tok.decode(turn.observation_ids.tolist()).startswith("<|im_end|>\n<|im_start|>user\n<information>")
                    assert len(turn.observation_ids) > 0
                if turn.action == "answer":
                    assert ep.answer == turn.action_text and len(turn.observation_ids) == 0
                prev = turn
            assert ep.peak_tokens == max(len(t.context_ids) + len(t.response_ids) for t in ep.turns)
            assert ep.total_tokens == sum(len(t.context_ids) + len(t.response_ids) for t in ep.turns)
    assert mems > 0 and searches > 0, "the SFT'd tiny model should write <mem> blocks and search"
    m = out[0].metrics
    for key in ("turns_mean", "generated_tokens", "tool_calls", "tool_failures", "peak_tokens_mean",
                "total_tokens_mean", "engine_s", "tool_s"):
        assert key in m
    assert m["tool_failures"] == 0


def _greedy(handle, ids):
    return handle.generate.remote(ids, 16, 0.0, 0).result()


def test_update_weights_changes_generation_without_restart(rollout, sft_model, batch):
    handle, _ = rollout
    replica, v0 = handle.info.remote().result()["replica"], batch[2]
    ids = [1, 5, 9, 14, 22, 40, 41, 42]
    before = _greedy(handle, ids)
    original = load_file(str(sft_model / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    res = handle.update_weights.remote(encode(WeightUpdate(version=v0 + 1, tensors=perturbed)), v0 + 1).result()
    assert res["version"] == v0 + 1
    after = _greedy(handle, ids)
    assert after["version"] == v0 + 1 and after["token_ids"] != before["token_ids"]
    handle.update_weights.remote(encode(WeightUpdate(version=v0 + 2, tensors=original)), v0 + 2).result()
    again = _greedy(handle, ids)
    assert again["version"] == v0 + 2 and again["token_ids"] == before["token_ids"]
    np.testing.assert_allclose(again["logprobs"], before["logprobs"], atol=1e-5)
    assert handle.info.remote().result()["replica"] == replica  # same replica, no restart


def test_bad_weights_are_rejected_and_the_engine_keeps_serving(rollout, sft_model):
    handle, _ = rollout
    version = handle.info.remote().result()["version"]
    original = load_file(str(sft_model / "model.safetensors"))
    name = next(iter(original))
    bad = dict(original)
    bad[name] = torch.zeros(3, 3)
    with pytest.raises(Exception, match="shape"):
        handle.update_weights.remote(encode(WeightUpdate(version=99, tensors=bad)), 99).result()
    with pytest.raises(Exception, match="missing"):
        handle.update_weights.remote(encode(WeightUpdate(version=99, tensors={name: original[name]})), 99).result()
    assert handle.info.remote().result()["version"] == version
    assert len(_greedy(handle, [1, 2, 3])["token_ids"]) == 16


def test_later_turns_record_the_new_version(rollout, world):
    handle, cfg = rollout
    version = handle.info.remote().result()["version"]
    prompts = load_prompts(world / "test.parquet", cfg.rollout.system_prompt, k=1, limit=1)
    ref = RolloutDriver(handle, cfg).rollout(PromptBatch(prompts=prompts, n=1, policy_version=version))[0]
    out = get_message(ref, TrajectoryBatch)
    assert out.policy_version == version
    assert {t.policy_version for g in out.groups for e in g.episodes for t in e.turns} == {version}


def test_loaded_weights_match_transformers_including_the_tied_head(rollout, sft_model):
    """Regression: on CPU a tied LM head kept its old packed copy after a reload."""
    from transformers import AutoModelForCausalLM

    handle, _ = rollout
    version = handle.info.remote().result()["version"]
    original = load_file(str(sft_model / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    changed = dict(original)
    changed["model.embed_tokens.weight"] = original["model.embed_tokens.weight"] + 0.05 * torch.randn(
        original["model.embed_tokens.weight"].shape, generator=g)
    handle.update_weights.remote(encode(WeightUpdate(version=version + 1, tensors=changed)), version + 1).result()
    try:
        model = AutoModelForCausalLM.from_pretrained(sft_model, dtype=torch.float32).eval()
        model.load_state_dict(changed, strict=False)
        model.tie_weights()
        ids = [1, 5, 9, 14, 22, 40]
        out = _greedy(handle, ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids + out["token_ids"]])).logits[0, len(ids) - 1 : -1]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out["token_ids"])[:, None])[:, 0].numpy()
        np.testing.assert_allclose(out["logprobs"], ref, atol=1e-4)
    finally:
        handle.update_weights.remote(encode(WeightUpdate(version=version + 2, tensors=original)), version + 2).result()


def test_sampled_logprobs_are_those_the_learner_computes(rollout, sft_model):
    """The log-probs a sampled turn records (the behaviour policy of the learner's importance weight and
    mismatch check) are log softmax(logits / T) at T = rollout.temperature with learner.tempered_logprobs
    (vLLM's processed log-probs), of the raw logits without it: the learner's own numbers either way."""
    from transformers import AutoModelForCausalLM

    handle, cfg = rollout
    version = handle.info.remote().result()["version"]  # the grammar model's weights, whatever was published
    handle.update_weights.remote(encode(WeightUpdate(version=version + 1, tensors=load_file(
        str(sft_model / "model.safetensors")))), version + 1).result()
    temperature = 0.7
    ids = [1, 5, 9, 14, 22, 40]
    out = handle.generate.remote(ids, 12, temperature, 11).result()
    model = AutoModelForCausalLM.from_pretrained(sft_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids + out["token_ids"]])).logits[0, len(ids) - 1 : -1]
    scale = temperature if cfg.learner.tempered_logprobs else 1.0
    target = torch.tensor(out["token_ids"])[:, None]
    ref = torch.log_softmax(logits / scale, -1).gather(-1, target)[:, 0].numpy()
    other = torch.log_softmax(logits / (1.0 if scale != 1.0 else temperature), -1).gather(-1, target)[:, 0].numpy()
    np.testing.assert_allclose(out["logprobs"], ref, atol=1e-4)
    assert np.abs(np.asarray(out["logprobs"]) - other).max() > 1e-3  # the test tells the two apart


def test_many_long_seeded_prompts_at_once_keep_the_engine_alive(rollout):
    """Regression: on CPU, vLLM split long prompts of seeded requests by chunked prefill and then
    died rewinding their generators ("CPU Generator does not use offset"). The engine now
    schedules whole prompts; a burst far over one step's token budget must all complete."""
    handle, cfg = rollout
    rng = np.random.default_rng(0)
    calls = [handle.generate.remote([int(t) for t in rng.integers(10, 1000, 1500)], max_tokens=4, temperature=1.0,
                                    seed=i + 1) for i in range(12)]
    outs = [c.result(timeout_s=600) for c in calls]
    assert all(len(o["token_ids"]) == 4 for o in outs)
    assert len(_greedy(handle, [1, 2, 3])["token_ids"]) == 16  # and it keeps serving


def _vllm_workers(engine_pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(engine_pid).children(recursive=True)] or [engine_pid]


def test_the_cpu_engine_runs_the_configured_threads_unpinned(rollout):
    """engine.cpu_threads=0 on a replica reserving 0.5 CPUs: one OpenMP thread, not pinned to a core
    (vLLM's default pins one thread to every core, where they wait on the search replica and the
    other stages sharing them)."""
    from services.rollout.engine import cpu_threads

    if torch.cuda.is_available():
        pytest.skip("CPU engines only")
    handle, cfg = rollout
    assert cpu_threads(cfg) == 1
    pid = handle.info.remote().result()["engine_pid"]
    assert pid is not None
    for worker in _vllm_workers(pid):
        env = dict(kv.split("=", 1) for kv in open(f"/proc/{worker}/environ").read().split("\0") if "=" in kv)
        assert env.get("OMP_NUM_THREADS") == "1", env.get("OMP_NUM_THREADS")
        assert "OMP_PROC_BIND" not in env and "GOMP_CPU_AFFINITY" not in env
        assert os.sched_getaffinity(worker) == os.sched_getaffinity(0)


def test_the_cpu_engine_runs_its_worker_in_the_engine_core_process(rollout):
    """engine.cpu_executor=uni with unpinned threads: the model runs in the engine core's process, no
    ``VLLM::Worker`` process of its own (vLLM's CPU default) to start or to poll its queue while idle."""
    import psutil

    if torch.cuda.is_available():
        pytest.skip("CPU engines only")
    handle, cfg = rollout
    assert cfg.engine.cpu_executor == "uni"
    pid = handle.info.remote().result()["engine_pid"]
    titles = [" ".join(p.cmdline()) for p in psutil.Process(pid).children(recursive=True)]
    assert not [t for t in titles if "Worker" in t], titles
    assert _greedy(handle, [1, 2, 3])["token_ids"]  # and it generates


def test_paused_replicas_start_no_turn_until_resumed_and_count_their_busy_time(rollout):
    """train.pause_rollout: inside ``paused`` a call's turns wait (none generates), after it they run; a
    pause nobody ends lifts itself after max_s. The engine's busy clock grows only while turns generate."""
    import time

    handle, cfg = rollout
    driver = RolloutDriver(handle, cfg)
    busy0 = handle.info.remote().result()["engine_busy_s"]
    with driver.paused(True, max_s=60):
        response = handle.generate.remote([1, 2, 3], max_tokens=8)
        time.sleep(1.5)
        assert handle.info.remote().result()["turns_running"] == 0  # waiting at the pause, not generating
        assert handle.info.remote().result()["engine_busy_s"] == pytest.approx(busy0)
    assert len(response.result(timeout_s=60)["token_ids"]) == 8
    assert handle.info.remote().result()["engine_busy_s"] > busy0
    handle.pause_turns.remote(1.0).result()  # a driver that never resumes
    t0 = time.perf_counter()
    handle.generate.remote([1, 2, 3], max_tokens=4).result(timeout_s=60)
    assert 0.5 < time.perf_counter() - t0 < 30
    with driver.paused(False, max_s=60):  # off: nothing waits
        t0 = time.perf_counter()
        handle.generate.remote([1, 2, 3], max_tokens=4).result(timeout_s=60)
        assert time.perf_counter() - t0 < 30
