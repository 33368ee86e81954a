"""The learner's peak-memory estimate and the warning a rank logs when its token budget will not fit
(services/learner/memory.py)."""

import logging
import re

import pytest
import torch
from transformers import LlamaConfig

from services.config import LearnerConfig
from services.learner.memory import GIB, adapter_params, budget_advice, estimate_peak, heap_kept, model_shape

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)


def test_the_estimate_grows_with_the_budget_and_shrinks_with_checkpointing_and_chunks():
    lc = LearnerConfig()
    peak = {b: estimate_peak(SMOLLM2, lc, 1, torch.float32, True, b)["total"] for b in (1024, 2048, 4096, 8192)}
    assert peak[1024] < peak[2048] < peak[4096] < peak[8192]
    ac = estimate_peak(SMOLLM2, lc, 1, torch.float32, True, 8192, activation_checkpointing=True)
    assert ac["activations"] < estimate_peak(SMOLLM2, lc, 1, torch.float32, True, 8192)["activations"] / 4
    small = LearnerConfig(logit_chunk_tokens=256)
    assert estimate_peak(SMOLLM2, small, 1, torch.float32, True)["head"] * 4 == estimate_peak(
        SMOLLM2, lc, 1, torch.float32, True)["head"]
    two = estimate_peak(SMOLLM2, lc, 2, torch.float32, True)
    assert two["states"] < estimate_peak(SMOLLM2, lc, 1, torch.float32, True)["states"]  # sharded over 2 ranks
    assert 134e6 < ac["params"] < 135e6  # SmolLM2-135M: 134.5M


def test_advice_names_the_settings_and_values_that_fit():
    lc = LearnerConfig(micro_token_budget=8192)
    assert budget_advice(SMOLLM2, lc, 1, torch.float32, True, 1000 * GIB) is None
    msg = budget_advice(SMOLLM2, lc, 1, torch.float32, True, 8 * GIB)
    assert msg.startswith("learner.micro_token_budget=8192 needs about") and "8.0 GiB available" in msg
    budget = int(re.search(r"set learner\.micro_token_budget=(\d+)", msg).group(1))
    assert estimate_peak(SMOLLM2, lc, 1, torch.float32, True, budget)["total"] <= 8 * GIB
    assert estimate_peak(SMOLLM2, lc, 1, torch.float32, True, 2 * budget)["total"] > 8 * GIB
    assert "learner.activation_checkpointing=true" in msg
    hopeless = budget_advice(SMOLLM2, lc, 1, torch.float32, True, 0.5 * GIB)
    assert "micro_token_budget=" not in hopeless.split("set ")[1] and "world_size" in hopeless


@pytest.mark.slow
def test_a_rank_warns_at_start_when_its_budget_will_not_fit(setup, world, monkeypatch, caplog):
    from services.learner import worker as worker_mod

    cfg, _ = setup
    monkeypatch.setattr(worker_mod, "available_bytes", lambda device: 0.2 * GIB)
    w = worker_mod.LearnerWorker(0, 1, cfg.model_dump(mode="json"), str(world / "model"))
    with caplog.at_level(logging.INFO, logger="mempo.learner"):
        w.join(*w.store_address())
    w.shutdown()
    assert any("estimated peak" in r.message for r in caplog.records)
    warned = [r.message for r in caplog.records if r.levelno == logging.WARNING]
    assert warned and "learner.micro_token_budget=2048 needs about" in warned[0] and "0.2 GiB available" in warned[0]


def test_lora_counts_the_frozen_base_the_adapters_and_no_reference():
    full, lora = LearnerConfig(kl_coef=0.001), LearnerConfig(kl_coef=0.001, lora={"rank": 16})
    est_full = estimate_peak(SMOLLM2, full, 1, torch.float32, True)
    est_lora = estimate_peak(SMOLLM2, lora, 1, torch.float32, True)
    assert est_lora["activations"] == est_full["activations"]
    adapters = adapter_params(model_shape(SMOLLM2), lora.lora)
    assert adapters == 4_884_480  # peft's rank-16 adapters on every linear layer of SmolLM2-135M, counted
    gathered = est_full["states"] - est_full["params"] * (16 + 4)  # the unsharded copies, as for the full model
    assert est_lora["states"] == pytest.approx(est_full["params"] * 4 + adapters * 16 + gathered / 2)
    assert est_lora["states"] < est_full["states"] / 3
    q_v = LearnerConfig(lora={"rank": 16, "target_modules": ["q_proj", "v_proj"]}).lora
    assert adapter_params(model_shape(SMOLLM2), q_v) == 30 * 16 * ((576 + 576) + (576 + 192))


def test_a_cpu_rank_under_glibcs_default_heap_counts_lora_as_full_fine_tuning():
    # under glibc's default mmap threshold a CPU rank's resident memory keeps freed activations: the measured
    # LoRA high-water is no lower than full fine-tuning's (memory.py's docstring), so the estimate says so
    full, lora = LearnerConfig(kl_coef=0.001), LearnerConfig(kl_coef=0.001, lora={"rank": 16})
    kept = estimate_peak(SMOLLM2, lora, 1, torch.float32, True, heap_kept=True)
    assert kept["total"] == estimate_peak(SMOLLM2, full, 1, torch.float32, True)["total"]
    assert heap_kept(lora, "cpu") and not heap_kept(lora, "cuda")
    assert not heap_kept(LearnerConfig(cpu_mmap_threshold_mib=1), "cpu")
    assert budget_advice(SMOLLM2, lora, 1, torch.float32, True, 16.5 * GIB) is None  # its own states fit
    assert budget_advice(SMOLLM2, lora, 1, torch.float32, True, 16.5 * GIB, kept=True) is not None


def test_fixing_the_mmap_threshold_returns_big_frees_to_the_system():
    import subprocess
    import sys

    # in a child (the threshold is the process's for good): a 16 MiB free first raises glibc's own threshold,
    # so the 4 MiB tensors that follow come from the heap; freed between small ones that stay, they stay
    # resident unless the threshold is fixed
    code = """
import resource, sys, torch
from services.learner.memory import fix_mmap_threshold
assert fix_mmap_threshold(int(sys.argv[1])) == (sys.argv[1] != "0")
def rss(): return int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize()
warm = torch.ones(2**22); del warm
before = rss(); chunks, pins = [], []
for _ in range(16): chunks.append(torch.ones(2**20)); pins.append(torch.ones(2**16))
held = rss(); del chunks
print(held - before, rss() - before)
"""
    def run(mib: int) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", code, str(mib)], capture_output=True, text=True, check=True)
        return tuple(map(int, out.stdout.split()))

    held, after = run(1)
    assert held > 60 * 2**20 and after < 8 * 2**20
    assert run(0)[1] > 48 * 2**20  # the control: under glibc's default the freed tensors stay resident
