"""The pipeline's pieces without a cluster: prompt order, metrics log, report, SFT samples, wiring."""

import json

import numpy as np
import pytest

from services.config import ConfigError, load_config
from services.common.data import PromptStream, load_prompts
from services.rollout.settings import DEFAULT_SYSTEM_PROMPT
from services.pipeline.apps import app_name, route_prefix, wired
from services.pipeline.plan import actors, totals
from services.pipeline.report import markdown_table, write_report
from services.pipeline.runlog import RunLog, read_rows
from services.pipeline.serve_apps import ROOT, config_from_args
from services.pipeline.sft import cpus_per_rank, load_transcripts, sft_batch, turn_samples
from services.pipeline.ahead import Generated
from services.pipeline.train import engine_busy_share, log_unlogged, stage_times
from services.learner.ledger import Ledger
from services.pipeline.chaos_checks import check_log

TINY = "deploy/configs/tiny.yaml"


def test_prompt_stream_is_a_pure_function_of_the_step(world):
    prompts = load_prompts(world / "train.parquet", DEFAULT_SYSTEM_PROMPT, limit=10)
    a, b = PromptStream(prompts, 4, seed=1), PromptStream(prompts, 4, seed=1)
    seen = [p.uid for s in range(5) for p in a.at(s)]
    assert [p.uid for p in b.at(3)] == seen[12:16]  # a resumed stream continues identically
    assert sorted(seen[:10]) == sorted(p.uid for p in prompts)  # an epoch visits every prompt once
    assert [p.uid for p in PromptStream(prompts, 4, seed=2).at(0)] != seen[:4]
    with pytest.raises(ValueError):
        PromptStream([], 4)


def test_runlog_resumes_without_duplicates_and_writes_tensorboard(tmp_path):
    log = RunLog(tmp_path, resume_step=0)
    for step in (1, 2, 3):
        log.write("train", step, {"reward_mean": step / 10, "note": "x", "bad": [1]}, console=False)
    log.close()
    log = RunLog(tmp_path, resume_step=2)  # steps after the checkpoint are re-run, so their rows go
    log.write("train", 3, {"reward_mean": 0.9}, console=False)
    log.close()
    rows = read_rows(tmp_path / "metrics.jsonl", "train")
    assert [(r["step"], r["reward_mean"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.9)]
    assert "bad" not in rows[0] and rows[0]["note"] == "x"
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_a_step_the_learner_finished_after_the_driver_stopped_is_logged_from_its_ledger(tmp_path):
    # found by `mempo chaos`: SIGTERM while the learner ran step 2 -> the driver stopped at step 1, the
    # learner finished step 2 and checkpointed it, and the resumed run started at 3: metrics.jsonl lacked 2
    led = Ledger(tmp_path)
    led.start(0, 1.0, "fresh")
    for step in (1, 2):
        led.trained(step, 1.0 + step, {f"u{step}": [1, 2]}, [step - 1], [step - 1], [], 0, True,
                    {"reward_mean": step / 10})
    log = RunLog(tmp_path, resume_step=0, tensorboard=False)
    log.write("train", 1, {"reward_mean": 0.1}, console=False)
    log = RunLog(tmp_path, resume_step=2, tensorboard=False)  # the resumed run: the learner is at step 2
    assert check_log(tmp_path, 2) != []
    assert log_unlogged(log, tmp_path, 2) == 1
    rows = read_rows(tmp_path / "metrics.jsonl", "train")
    assert [(r["step"], r["reward_mean"], r.get("recovered_from_ledger")) for r in rows] == [
        (1, 0.1, None), (2, 0.2, 1.0)]
    assert check_log(tmp_path, 2) == [] and log_unlogged(log, tmp_path, 2) == 0  # once only


def test_stage_times_busy_and_idle():
    batch = Generated(step=0, traj_refs=[], score_refs=[], rollout_s=5.0, scoring_tail_s=0.5, started_at_version=0)
    out = stage_times(batch, {"scorer/seconds": 1.0, "busy_s": 3.0, "publish_s": 1.0}, step_s=10.0)  # update, publication
    assert out["time/rollout_s"] == 5.0 and out["time/scoring_s"] == 1.0
    assert out["time/learner_s"] == 3.0 and out["time/weight_sync_s"] == 1.0 and out["step_s"] == 10.0
    assert out["idle/rollout_s"] == 5.0 and out["idle/weight_sync_s"] == 9.0 and out["scoring_tail_s"] == 0.5
    overlapped = stage_times(batch, {"busy_s": 5.0, "publish_s": 1.0}, step_s=5.5)  # busier than the step
    assert overlapped["idle/rollout_s"] == 0.5 and overlapped["idle/learner_s"] == 0.5


def test_the_engines_busy_share_over_a_step_counts_each_replica_from_its_own_clock():
    before = {"r1": 100.0, "r2": 40.0}
    after = {"r1": 106.0, "r3": 2.0}  # r2 died; r3 replaced it during the step (its clock starts at 0)
    assert engine_busy_share(before, after, 10.0) == {"engine_busy_share": (6.0 + 2.0) / 20.0}
    assert engine_busy_share(before, {"r1": 150.0}, 10.0) == {"engine_busy_share": 1.0}  # never above the step
    assert engine_busy_share(before, {}, 10.0) == {}  # no replica answered: left out, not 0


def test_report_table_and_curves(tmp_path):
    log = RunLog(tmp_path, tensorboard=False)
    for step in range(1, 4):
        log.write("train", step, {"reward_mean": 0.1 * step, "scorer/r_mem_mean": 0.01, "scorer/p_mem_mean": 0.5,
                                  "scorer/p_full_mean": 0.4, "rollout/peak_tokens_mean": 300, "rollout/turns_mean": 3},
                  console=False)
        log.write("eval", step, {"em": 0.2, "k1/em": 0.3}, console=False)
    row = {"em": 0.5, "f1": 0.6, "turns": 3.0, "tt": 900.0, "pt": 400.0, "r_mem": float("nan"), "p_mem": 0.5,
           "p_full": 0.4, "episodes": 10.0}
    paths = write_report(tmp_path, {"sft": {1: row}, "rl": {1: dict(row, em=0.7)}})
    text = paths["report"].read_text()
    assert "| sft | 1 | 0.500 |" in text and "| rl | 1 | 0.700 |" in text and "n/a" in text
    assert paths["curves"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(paths["eval"].read_text())["rl"]["1"]["em"] == 0.7
    assert markdown_table({}).count("\n") == 1
    assert "noise scale" not in text  # the learner did not measure one


def test_report_gives_the_runs_noise_scale_when_measured(tmp_path):
    log = RunLog(tmp_path, tensorboard=False)
    for step, (trace, signal) in enumerate([(30.0, 1.0), (10.0, 0.0), (20.0, 2.0)], start=1):
        log.write("train", step, {"reward_mean": 0.5, "noise/groups": 8.0, "noise/trace": trace,
                                  "noise/signal_sq": signal}, console=False)
    text = write_report(tmp_path, {"rl": {1: {"em": 0.5, "f1": 0.5}}})["report"].read_text()
    assert "B_simple = 20.0 prompt groups [90% bootstrap over steps: " in text  # mean 20 over mean 1
    assert "], against 8.0 a step" in text


def test_sft_ranks_take_the_free_cores_in_whole_shares_or_keep_the_configured_reservation():
    assert cpus_per_rank(2.0, 1, 0.5) == 2.0  # a fresh local cluster: every core
    assert cpus_per_rank(3.0, 2, 0.5) == 1.0  # whole shares per rank
    assert cpus_per_rank(0.75, 1, 0.5) == 0.5  # a busy cluster: under a core free, keep the config's
    assert cpus_per_rank(1.5, 2, 0.25) == 0.25


def test_sft_samples_train_only_on_assistant_tokens_in_memory_contexts(tiny_cfg, world):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(world / "model"))
    transcripts = load_transcripts(world / "oracle.jsonl", 1.0, DEFAULT_SYSTEM_PROMPT)
    all_rows = [json.loads(line) for line in (world / "oracle.jsonl").read_text().splitlines()]
    assert len(transcripts) == sum(r["em"] >= 1.0 for r in all_rows) < len(all_rows)
    samples = turn_samples(tiny_cfg, tok, transcripts[:3])
    assert len(samples) == sum((len(t) - 1) // 2 for t in transcripts[:3])
    first_ids, first_ctx = samples[0]
    assert tok.decode(first_ids[first_ctx:]) == transcripts[0][2]["content"]  # the response is the assistant turn
    # turn 3 sees system + question + turn 2 only (memory mode): turn 1's text is not in its context
    msgs = next(m for m in transcripts if len(m) >= 7)
    ids, ctx = turn_samples(tiny_cfg, tok, [msgs])[2]
    context = tok.decode(ids[:ctx])
    assert msgs[1]["content"] in context and msgs[4]["content"] in context
    assert msgs[2]["content"] not in context
    batch = sft_batch(samples, step=1)
    cu = batch.cu_seqlens
    for i, (ids, ctx) in enumerate(samples):
        mask = batch.loss_mask[cu[i]:cu[i + 1]]
        assert not mask[:ctx].any() and mask[ctx:].all()
    assert not batch.advantages.any()



def test_sft_turns_over_the_length_cap_are_counted_and_named(tiny_cfg, world, caplog):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(world / "model"))
    transcripts = load_transcripts(world / "oracle.jsonl", 1.0, DEFAULT_SYSTEM_PROMPT)[:3]
    every = turn_samples(tiny_cfg, tok, transcripts)
    lengths = sorted(len(ids) for ids, _ in every)
    cap = lengths[len(lengths) // 2]  # about half the turns are longer
    short = tiny_cfg.model_copy(deep=True)
    short.engine.max_model_len = cap
    with caplog.at_level("WARNING", logger="mempo.sft"):
        kept = turn_samples(short, tok, transcripts)
    dropped = sum(n > cap for n in lengths)
    assert len(kept) == len(every) - dropped and dropped > 0
    assert f"{dropped} of {len(every)} turns are longer than engine.max_model_len={cap}" in caplog.text
    assert f"engine.max_model_len={lengths[-1]} keeps them all" in caplog.text


def test_sft_samples_with_a_sentencepiece_tokenizer(tiny_cfg, tmp_path):
    """A Llama-2-format tokenizer: each assistant turn is a sample under its memory-mode context,
    observations in the model's own [INST] turns."""
    pytest.importorskip("sentencepiece")
    from tests.sp_tokenizer import sentencepiece_tokenizer

    tok = sentencepiece_tokenizer(tmp_path)
    turns = ["<think>\nFind the town.\n</think>\n<search> Kalton country </search>",
             "<mem>\nAda Brenn was born in Kalton.\n</mem>\n<think>\nNow the country.\n</think>\n<search> Kalton </search>",
             "<mem>\nKalton is in Vestria.\n</mem>\n<think>\nDone.\n</think>\n<answer> Vestria </answer>"]
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Where was Ada born?"}]
    for i, t in enumerate(turns):
        msgs.append({"role": "assistant", "content": t})
        if i < 2:
            msgs.append({"role": "user", "content": f"<information>\nDoc {i}\n</information>"})
    samples = turn_samples(tiny_cfg, tok, [msgs])
    assert len(samples) == 3
    for (ids, ctx), text in zip(samples, turns):
        assert tok.decode(ids[ctx:]) == text  # the response is the assistant turn (its dummy-prefix space stripped)
    ids, ctx = samples[2]
    context = tok.decode(ids[:ctx])
    assert "[INST]" in context and "<information>\nDoc 1\n</information> [/INST]" in context
    assert turns[1] in context and turns[0] not in context and "<|im_start|>" not in context
    batch = sft_batch(samples, step=1)
    assert batch.loss_mask.sum() == sum(len(ids) - ctx for ids, ctx in samples)

def test_app_prefix_rewires_names_and_routes():
    cfg = load_config(TINY, ["ray.app_prefix=t1-"])
    w = wired(cfg)
    assert app_name(w, "rollout") == "t1-rollout" and w.rollout.search_app == "t1-search"
    assert w.learner.publish_to == ["t1-rollout:rollout", "t1-scorer:scorer"]
    assert route_prefix(w, "search") == "/t1-search" and route_prefix(w, "rollout") is None
    plain = load_config(TINY)
    assert wired(plain) is plain and route_prefix(plain, "search") == "/" and route_prefix(plain, "scorer") == "/scorer"


def test_tiny_config_fits_two_cores():
    cfg = load_config(TINY)
    assert totals(actors(cfg))["CPU"] <= 2.0


def test_serve_app_args_resolve_paths_against_the_project_root():
    cfg = config_from_args({"config": TINY, "overrides": ["rollout.n=3"]})
    assert cfg.rollout.n == 3 and cfg.world.dir == str(ROOT / ".cache/world") and cfg.model.path == "world"
    with pytest.raises(ValueError):
        config_from_args({"cfg": TINY})
    with pytest.raises(ConfigError):
        config_from_args({"config": TINY, "overrides": ["rollout.m=3"]})


def test_replica_counts_are_not_replica_arguments():
    from services.config import replica_config

    a, b = load_config(TINY), load_config(TINY, ["rollout.replicas=3", "scorer.replicas=2"])
    assert replica_config(a) == replica_config(b)
    assert np.isclose(totals(actors(b, ("rollout",)))["CPU"], 3 * b.rollout.num_cpus)
