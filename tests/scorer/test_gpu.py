"""The GPU smoke check (bench/gpu.py) and prefix-shared packing on CUDA.

Tests marked ``gpu`` skip without CUDA; the CPU run of bench/gpu.py (gloo, tiny shapes) keeps the
same code path exercised on machines without one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from services.scorer.packing import Branch, naive_logprobs, tree_logprobs

ROOT = Path(__file__).resolve().parents[2]
GPU_CHECK = [sys.executable, str(ROOT / "bench" / "gpu.py")]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(GPU_CHECK + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _tiny_model(dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=2048, attn_implementation="sdpa")
    with torch.device("cuda"):
        return Qwen2ForCausalLM(cfg).to(dtype).eval()


@pytest.mark.gpu
def test_packed_matches_naive_on_cuda():
    rng = np.random.default_rng(0)
    trunk = rng.integers(0, 512, 600).tolist()
    branches = [Branch(a, rng.integers(0, 512, 20).tolist()) for a in (1, 100, 300, 301, 600)]
    model = _tiny_model(torch.float32)
    naive = [naive_logprobs(model, trunk[:b.attach], b.ids) for b in branches]
    for budget in (8192, 256):  # one forward, and trees split across several
        packed = tree_logprobs(model, trunk, branches, token_budget=budget)
        for p, q in zip(packed, naive):
            np.testing.assert_allclose(p, q, atol=1e-4)
    packed16 = tree_logprobs(model.to(torch.bfloat16), trunk, branches)
    assert max(float(np.abs(p - q).max()) for p, q in zip(packed16, naive)) < 0.1


@pytest.mark.gpu
def test_gpu_check_runs_on_cuda():
    out = _run(["--small", "--n", "2", "--repeats", "1", "--steps", "1"], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "learner FSDP2 nccl W=1" in out.stdout and "imported ray/vllm: neither" in out.stdout


def test_gpu_check_runs_on_cpu():
    """The whole path on CPU: synthetic groups, packed vs naive scoring, one FSDP2 step over gloo."""
    out = _run(["--device", "cpu", "--small", "--n", "1", "--repeats", "1", "--steps", "1"], timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "learner FSDP2 gloo W=1" in out.stdout and "imported ray/vllm: neither" in out.stdout
    exact = [line for line in out.stdout.splitlines() if "fp32 max abs diff packed vs naive" in line]
    assert len(exact) == 2 and all(float(line.split("|")[2]) < 1e-4 for line in exact), exact


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_gpu_check_without_cuda_says_so():
    out = _run([], timeout=120)
    assert out.returncode == 0 and "no CUDA device" in out.stdout
