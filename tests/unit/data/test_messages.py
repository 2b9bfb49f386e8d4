"""Conversational rows (`messages`, and message lists in DPO's and GRPO's columns) are checked
before rendering: a malformed one is a UserError naming the column and the fault, never a
KeyError or a template error. The CLI side is tests/e2e/test_bad_input_cli.py."""

from __future__ import annotations

import pytest

from rltrain.data.preference_data import pair_texts
from rltrain.data.prompt_data import _to_rows
from rltrain.data.tokenize import check_messages, render_messages
from rltrain.models.tokenizer import build_char_tokenizer
from rltrain.runtime.errors import UserError

USER = {"role": "user", "content": "1+1?"}
ASSISTANT = {"role": "assistant", "content": "2"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.mark.parametrize(
    "messages, fault",
    [
        ("user: 1+1?", "holds str"),
        ({"role": "user"}, "holds dict"),
        ([], "holds an empty list"),
        (["1+1?", ASSISTANT], "is not a dict"),
        ([{"content": "1+1?", "role": None}, ASSISTANT], "lacks 'role'"),
        ([{"role": "user"}, ASSISTANT], "lacks 'content'"),
        ([{"role": "robot", "content": "1+1?"}, ASSISTANT], "unknown role 'robot'"),
        ([{"role": "user", "content": [{"type": "text", "text": "1+1?"}]}, ASSISTANT], "content is list"),
    ],
)
def test_malformed_conversations_are_named(messages, fault):
    with pytest.raises(UserError, match="a row's 'chosen' column") as info:
        check_messages(messages, "data.path='x.jsonl'", "chosen")
    assert fault in str(info.value)


def test_sft_conversation_renders_and_needs_an_assistant_completion(tokenizer):
    assert render_messages(tokenizer, [USER, ASSISTANT], "here") == ("U:1+1?\nA:", "2")
    for bad in ([ASSISTANT], [ASSISTANT, USER]):
        with pytest.raises(UserError, match="must end with the assistant's message"):
            render_messages(tokenizer, bad, "here")


def test_dpo_conversations_are_checked(tokenizer):
    row = {"chosen": [USER, ASSISTANT], "rejected": [USER, {"role": "assistant", "content": "3"}]}
    assert pair_texts(tokenizer, row, "here") == ("U:1+1?\nA:", "2", "3")
    with pytest.raises(UserError, match="'rejected' column has message 1 whose content is int"):
        pair_texts(tokenizer, {**row, "rejected": [USER, {"role": "assistant", "content": 3}]}, "here")
    with pytest.raises(UserError, match="no prompt turns"):
        pair_texts(tokenizer, {"chosen": [ASSISTANT], "rejected": [{"role": "assistant", "content": "3"}]}, "here")


def test_grpo_conversational_prompts_are_checked(tokenizer):
    kept, dropped = _to_rows(tokenizer, [{"prompt": [USER], "answer": "2"}], "here", 64, None)
    assert [row.text for row in kept] == ["U:1+1?\nA:"] and dropped == 0
    with pytest.raises(UserError, match="'prompt' column has message 0 with the unknown role 'human'"):
        _to_rows(tokenizer, [{"prompt": [{"role": "human", "content": "1+1?"}]}], "here", 64, None)
