"""Unpaired preference data for KTO: each example is one completion with a boolean label (TRL's
unpaired format: `prompt`, `completion`, `label`, standard or conversational). Paired rows
(`prompt`/`chosen`/`rejected`, or an implicit prompt) are unpaired as TRL does: chosen -> true,
rejected -> false; the built-in task's pairs are unpaired the same way.

Held-out data is kept as pairs, for the preference accuracy every preference objective reports
(`eval/dpo_accuracy`): the built-in task's and a paired dataset's pairs as they are; an unpaired
dataset's by matching, per prompt, its i-th desirable with its i-th undesirable completion.
docs/algorithms.md, "KTO".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rltrain.config.schema import DataConfig
from rltrain.data import tasks
from rltrain.data.loading import PAIRED, PAIRED_IMPLICIT, UNPAIRED, eval_limit, train_and_eval_rows
from rltrain.data.preference_data import PreferencePair, SkipCounts, pair_texts, rows_to_pairs
from rltrain.data.tokenize import check_messages, encode_all, fit_length
from rltrain.data.vision_rows import has_image_column
from rltrain.runtime.errors import UserError


@dataclass
class LabelledCompletion:
    prompt: list[int]
    completion: list[int]  # ends with EOS
    desirable: bool  # the `label` column


@dataclass
class UnpairedData:
    train: list[LabelledCompletion]
    eval: list[PreferencePair]  # held-out pairs (module docstring)
    eval_answers: list[str]  # reference answers of the eval prompts (the built-in task's)
    skipped: SkipCounts


def unpaired_texts(tokenizer, row: dict, where: str) -> tuple[str, str, bool]:
    """(prompt text, completion text, label) of one unpaired row, standard or conversational."""
    prompt: Any = row.get("prompt")  # a dataset row's values: checked below
    completion: Any = row.get("completion")
    label: Any = row.get("label")
    if not isinstance(label, bool):
        raise UserError(
            f"{where}: column 'label' must hold booleans (true: the completion is desirable, false: undesirable; TRL's "
            f"unpaired preference format); found {label!r:.120}. Convert it with data.map_fn."
        )
    if isinstance(completion, list):  # conversational: the prompt's messages, then the completion's
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"{where}: conversational rows need a tokenizer with a chat template.")
        check_messages(completion, where, "completion")
        check_messages(prompt, where, "prompt")
        prompt = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        completion = completion[-1]["content"]
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise UserError(f"{where}: column {name!r} must hold strings (or message lists); found {value!r:.120}")
    return prompt, completion, label


def unpair(tokenizer, rows: list[dict], where: str) -> list[tuple[str, str, bool]]:
    """Paired rows as labelled texts: each pair's chosen (true) then its rejected (false)."""
    texts = []
    for row in rows:
        prompt, chosen, rejected = pair_texts(tokenizer, row, where)
        texts += [(prompt, chosen, True), (prompt, rejected, False)]
    return texts


def texts_to_examples(
    tokenizer, texts: list[tuple[str, str, bool]], data_cfg: DataConfig, where: str, skipped: SkipCounts
) -> list[LabelledCompletion]:
    usable = [t for t in texts if t[1]]
    skipped.empty += len(texts) - len(usable)
    prompts_ids = encode_all(tokenizer, [t[0] for t in usable])
    completions_ids = encode_all(tokenizer, [t[1] for t in usable])
    eos = tokenizer.eos_token_id
    examples = []
    for prompt_ids, completion_ids, (_, _, label) in zip(prompts_ids, completions_ids, usable, strict=True):
        if not prompt_ids:
            raise UserError(f"{where}: a row has an empty prompt; KTO needs at least one prompt token.")
        fitted = fit_length(prompt_ids, completion_ids + [eos], data_cfg.max_length, data_cfg.overlong, skipped.overlong, where)
        if fitted is not None:
            examples.append(LabelledCompletion(fitted.prompt, fitted.completion, label))
    return examples


def held_out_pairs(examples: list[LabelledCompletion]) -> list[PreferencePair]:
    """Per prompt, its i-th desirable completion against its i-th undesirable one."""
    by_prompt: dict[tuple[int, ...], tuple[list[list[int]], list[list[int]]]] = {}
    for ex in examples:
        good, bad = by_prompt.setdefault(tuple(ex.prompt), ([], []))
        (good if ex.desirable else bad).append(ex.completion)
    return [
        PreferencePair(list(prompt), c, r)
        for prompt, (good, bad) in by_prompt.items()
        for c, r in zip(good, bad)
        if c != r
    ]


def build_unpaired_data(tokenizer, data_cfg: DataConfig, seed: int) -> UnpairedData:
    skipped = SkipCounts()
    limit = eval_limit(data_cfg)
    if data_cfg.path is None:
        train_p, eval_p = tasks.answer_split(data_cfg, seed)
        where = f"built-in task {data_cfg.task!r}"
        share = data_cfg.same_length_rejected
        train_texts = unpair(tokenizer, tasks.preference_rows(train_p, seed, share), where)
        evals = rows_to_pairs(tokenizer, tasks.preference_rows(eval_p, seed + 7, share), data_cfg, where, SkipCounts())
        answers = [p.answer for p in eval_p]
    else:
        train_rows, eval_rows, where = train_and_eval_rows(data_cfg, seed, [UNPAIRED, PAIRED, PAIRED_IMPLICIT])
        if has_image_column(train_rows):
            raise UserError(
                f"{where} has images (an 'images' or 'image' column), which algo=kto does not take yet. Use algo=dpo, "
                "simpo or orpo on paired rows with images, or drop the image column (docs/vision.md)."
            )
        answers = []
        if train_rows and all(k in train_rows[0] for k in UNPAIRED):
            train_texts = [unpaired_texts(tokenizer, row, where) for row in train_rows]
            eval_texts = [unpaired_texts(tokenizer, row, where) for row in eval_rows[:limit]]
            evals = held_out_pairs(texts_to_examples(tokenizer, eval_texts, data_cfg, where, SkipCounts()))
        else:
            train_texts = unpair(tokenizer, train_rows, where)
            evals = rows_to_pairs(tokenizer, eval_rows[:limit], data_cfg, where, SkipCounts())
    train = texts_to_examples(tokenizer, train_texts, data_cfg, where, skipped)
    if not train:
        raise UserError(f"{where}: no usable examples (empty or overlong rows were all skipped).")
    return UnpairedData(train, evals, answers[:limit], skipped)
