"""The memory rule and the observation tokens of the agent loop, without an engine."""

from transformers import AutoTokenizer

from services.config import load_config
from services.rollout.records import EpisodeBuilder


def _loop(world, window):
    cfg = load_config("deploy/configs/tiny.yaml", [f"rollout.memory_window={window}"])
    return EpisodeBuilder(cfg, AutoTokenizer.from_pretrained(world / "model"))


def test_memory_window_selects_the_last_turns(world):
    prompt, pieces = [1, 2], [[10, 11], [20], [30, 31, 32]]
    assert _loop(world, 1).context(prompt, pieces) == [1, 2, 30, 31, 32]
    assert _loop(world, 2).context(prompt, pieces) == [1, 2, 20, 30, 31, 32]
    assert _loop(world, 5).context(prompt, pieces) == [1, 2, 10, 11, 20, 30, 31, 32]
    assert _loop(world, "full").context(prompt, pieces) == [1, 2, 10, 11, 20, 30, 31, 32]
    assert _loop(world, 1).context(prompt, []) == [1, 2]


def test_observation_closes_the_turn_once(world):
    loop = _loop(world, 1)
    tok = loop.tokenizer
    obs = loop.observation_ids("<information>\nDoc 1 (Title: X) y\n</information>", [5, 6])
    assert tok.decode(obs) == "<|im_end|>\n<|im_start|>user\n<information>\nDoc 1 (Title: X) y\n</information><|im_end|>\n<|im_start|>assistant\n"
    after_eos = loop.observation_ids("note", [5, tok.eos_token_id])
    assert tok.decode(after_eos) == "\n<|im_start|>user\nnote<|im_end|>\n<|im_start|>assistant\n"


def test_prompt_ids_are_the_chat_template(world):
    from services.common.messages import ChatMessage, Prompt

    loop = _loop(world, 1)
    p = Prompt(uid="x", messages=[ChatMessage("system", "S"), ChatMessage("user", "Q")], golds=[["a"]])
    assert loop.tokenizer.decode(loop.prompt_ids(p)) == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"


def test_a_sentencepiece_model_gets_its_own_turns(tmp_path):
    """A Llama-2-format tokenizer: observation turns from its chat template, turns parsed without "▁"."""
    import pytest

    pytest.importorskip("sentencepiece")
    from services.common.messages import ChatMessage, Prompt
    from services.rollout.records import episode_from_transcript
    from tests.sp_tokenizer import sentencepiece_tokenizer

    tok = sentencepiece_tokenizer(tmp_path)
    loop = EpisodeBuilder(load_config("deploy/configs/tiny.yaml"), tok)
    assert loop.observation_template == " </s><s>[INST] {observation} [/INST]"
    assert tok.decode(loop.observation_ids("<information>\nx\n</information>", [5, 6])) == \
        "</s><s>[INST] <information>\nx\n</information> [/INST]"  # decode drops the first token's space
    assert tok.convert_ids_to_tokens(loop.observation_ids("o", [5, 6]))[0] == "▁"
    assert tok.decode(loop.observation_ids("o", [5, tok.eos_token_id])) == "<s>[INST] o [/INST]"

    turn1 = "<think>\nFind the town.\n</think>\n<search> Kalton country </search>"
    turn2 = "<mem>\nAda Brenn was born in Kalton.\n</mem>\n<think>\nDone.\n</think>\n<answer> Vestria </answer>"
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Where was Ada born?"},
            {"role": "assistant", "content": turn1}, {"role": "user", "content": "<information>\nKalton\n</information>"},
            {"role": "assistant", "content": turn2}]
    prompt = Prompt(uid="q", messages=[ChatMessage(m["role"], m["content"]) for m in msgs[:2]], golds=[["Vestria"]])
    ep = episode_from_transcript(loop, prompt, msgs)
    first, second = ep.turns
    assert first.action == "search" and first.action_text == "Kalton country" and first.format_ok
    assert second.action == "answer" and ep.answer == "Vestria" and second.format_ok
    mem = tok.decode(second.response_ids[second.mem_start:second.mem_end].tolist())
    assert "<mem>\nAda Brenn was born in Kalton.\n</mem>" in mem
    assert tok.decode(second.context_ids.tolist()).endswith("<information>\nKalton\n</information> [/INST]")
