"""Reasoning models: `data.chat_template_kwargs` reach every rendering of the run's tokenizer (the
data's prompts, SFT examples, the agents' endpoint), the answer rewards read after the thinking
block (the marker from the template where it has one), and the thinking tokens counted exactly."""

from __future__ import annotations

from rltrain.data.prompt_data import _prompt_text
from rltrain.data.tokenize import render_messages
from rltrain.envs.agent.reply import render
from rltrain.models.tokenizer import build_char_tokenizer, with_chat_template_kwargs
from rltrain.rewards.math import accuracy
from rltrain.rewards.thinking import (
    THINKING_END_ENV,
    answer_after_thinking,
    thinking_end_marker,
    thinking_tokens,
)

# A reasoning model's template in miniature: an empty thinking block when thinking is off.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)
USER = [{"role": "user", "content": "1+1?"}]


def thinking_tokenizer(**kwargs):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = THINKING_TEMPLATE
    return with_chat_template_kwargs(tokenizer, kwargs)


def test_chat_template_kwargs_reach_every_rendering():
    off, default = thinking_tokenizer(enable_thinking=False), thinking_tokenizer()
    assert _prompt_text(off, {"prompt": USER}, "here", None)[0].endswith("assistant: <think></think>")
    assert _prompt_text(default, {"prompt": USER}, "here", None)[0].endswith("assistant: ")
    assert render(off, USER, None, None).endswith("<think></think>")  # the agents' endpoint
    assert off.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, enable_thinking=True).endswith(": ")  # a call's own wins
    prompt, _ = render_messages(off, [*USER, {"role": "assistant", "content": "2"}], "here")
    assert prompt.endswith("<think></think>")  # SFT's and DPO's prompt part


def test_the_marker_comes_from_the_template_unless_set():
    qwen3_like = build_char_tokenizer()
    qwen3_like.chat_template = "{{ content.split('</think>')[-1] }}"
    assert thinking_end_marker(qwen3_like, None) == "</think>"
    other = build_char_tokenizer()
    other.chat_template = "{{ m.split('</longthink>')[-1] }}"
    assert thinking_end_marker(other, None) == "</longthink>"
    assert thinking_end_marker(other, "END") == "END" and thinking_end_marker(build_char_tokenizer(), None) == "</think>"


def test_thinking_tokens_are_counted_exactly():
    tokenizer = build_char_tokenizer()
    decode = tokenizer.decode
    ids = tokenizer.encode("<think>a+b</think>42", add_special_tokens=False)
    assert thinking_tokens(ids, decode, "</think>") == len("<think>a+b</think>")  # one character a token
    twice = tokenizer.encode("<think>x</think>y</think>z", add_special_tokens=False)
    assert thinking_tokens(twice, decode, "</think>") == len("<think>x</think>y</think>")
    unclosed = tokenizer.encode("<think>still going", add_special_tokens=False)
    assert thinking_tokens(unclosed, decode, "</think>") == len(unclosed)
    assert thinking_tokens(tokenizer.encode("42", add_special_tokens=False), decode, "</think>") == 0
    assert answer_after_thinking("<think>1</think> 7", "</think>") == " 7"


def test_math_accuracy_reads_the_answer_after_the_thinking_block(monkeypatch):
    completions = ["<think>maybe 6? no</think> The answer is 7", "<think>7 is the answer", "<think>7</think> 6"]
    assert accuracy(["p"] * 3, completions, solution=["7"] * 3) == [1.0, 0.0, 0.0]
    monkeypatch.setenv(THINKING_END_ENV, "")  # reward.thinking_end="": the whole completion
    assert accuracy(["p"], ["<think>7</think> 6"], solution=["6"]) == [1.0]
