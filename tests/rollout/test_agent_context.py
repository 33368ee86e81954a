"""The memory rule and the observation tokens of the agent loop, without an engine."""

from transformers import AutoTokenizer

from services.common.config import load_config
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
