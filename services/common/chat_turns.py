"""The chat tokens the agent loop writes itself, derived from the model's own chat template.

After a search turn the loop appends tokens that close the assistant message, add the observation
as a user message and open the next assistant message (``rollout.observation_template``). With
``"auto"`` (the default) that template comes from the tokenizer's chat template: it is rendered once
for ``[system, user, assistant X]`` + ``[user O]`` with the generation prompt, and the text between
the assistant content X and the end, with O as ``{observation}``, is the template. For ChatML
(Qwen2.5, the embedded world) that is ``CHATML_OBSERVATION_TEMPLATE``; for Llama-2's
``[INST]`` format it is ``" </s><s>[INST] {observation} [/INST]"``.

    observation_template(tokenizer)                 # derived from tokenizer.chat_template
    resolve_observation_template(tokenizer, cfg.rollout.observation_template)   # "auto" or a string

X and O are private-use characters, so a template that strips or trims contents still leaves them
findable; a template that rejects a system message is rendered without one (the text after X does
not depend on it).
"""

from __future__ import annotations

import logging

log = logging.getLogger("mempo.chat_turns")

AUTO = "auto"
CHATML_OBSERVATION_TEMPLATE = "<|im_end|>\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"

_X, _O = "\ue000X\ue001", "\ue000O\ue001"


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def _render(tokenizer, with_system: bool) -> str:
    msgs = ([{"role": "system", "content": "\ue000S\ue001"}] if with_system else []) + [
        {"role": "user", "content": "\ue000Q\ue001"}, {"role": "assistant", "content": _X},
        {"role": "user", "content": _O}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)


def observation_template(tokenizer) -> str:
    """``rollout.observation_template`` for this tokenizer's chat template (``{observation}`` marks
    the observation; other braces are escaped for ``str.format``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: set rollout.observation_template explicitly")
    try:
        rendered = _render(tokenizer, True)
    except Exception:  # e.g. Gemma's "System role not supported"
        rendered = _render(tokenizer, False)
    if rendered.count(_X) != 1 or rendered.count(_O) != 1 or rendered.index(_X) > rendered.index(_O):
        raise ValueError("the chat template does not render the assistant message and the next user message "
                         "in order; set rollout.observation_template explicitly")
    head, tail = rendered.split(_X, 1)[1].split(_O)
    return _escape(head) + "{observation}" + _escape(tail)


def resolve_observation_template(tokenizer, configured: str) -> str:
    """The template to use: derived for ``"auto"``, else ``configured``. A configured ChatML template
    on a tokenizer whose chat template is not ChatML is almost surely a mistake: it is logged."""
    if configured == AUTO:
        return observation_template(tokenizer)
    if configured == CHATML_OBSERVATION_TEMPLATE:
        try:
            derived = observation_template(tokenizer)
        except Exception:  # noqa: BLE001 - a template that cannot be derived: nothing to compare
            derived = configured
        if derived != configured:
            log.warning("rollout.observation_template is ChatML but the model's chat template is not; the "
                        "observation turns will be out of format. Use 'auto' (derived: %r)", derived)
    return configured


def after_eos(template_text: str, eos_text: str) -> str:
    """``template_text`` without its closing EOS, for a response that already ended with EOS: the
    text up to and including the first EOS is dropped when only whitespace precedes that EOS."""
    if eos_text:
        at = template_text.find(eos_text)
        if at >= 0 and not template_text[:at].strip():
            return template_text[at + len(eos_text):]
    return template_text
