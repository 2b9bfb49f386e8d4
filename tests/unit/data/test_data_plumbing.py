from rltrain.backends.lr_schedule import lr_at
from rltrain.config.schema import OptimConfig
from rltrain.data import tasks
from rltrain.data.sampler import IndexStream
from rltrain.data.sharding import micro_batch_count, rank_slice, split_micro_batches


def test_rank_slices_cover_everything_once():
    items = list(range(7))
    slices = [rank_slice(items, r, 3) for r in range(3)]
    assert slices == [[0, 1, 2], [3, 4], [5, 6]]


def test_every_rank_gets_the_same_micro_batch_count():
    assert micro_batch_count(7, 2, 2) == 2  # largest slice holds 4
    assert split_micro_batches([1, 2, 3], 2, 2) == [[1, 2], [3]]
    assert split_micro_batches([1], 2, 2) == [[1], []]


def test_index_stream_resumes_exactly():
    a = IndexStream(5, seed=3)
    first = a.take(7)
    state = a.state_dict()
    rest = a.take(9)
    b = IndexStream(5, seed=3)
    b.load_state_dict(state)
    assert b.take(9) == rest
    assert sorted(first[:5]) == list(range(5))


def test_addition_split_holds_out_unseen_problems():
    train, held = tasks.addition_split(seed=0, num_eval=200)
    assert len(held) == 200 and len(train) == 9800
    assert not {(p.a, p.b) for p in train} & {(p.a, p.b) for p in held}
    assert tasks.addition_split(seed=0, num_eval=200)[1] == held


def test_a_fixed_eval_seed_holds_out_the_same_problems_on_every_run_seed():
    train0, held0 = tasks.addition_split(seed=0, num_eval=1000, eval_seed=0)
    train1, held1 = tasks.addition_split(seed=1, num_eval=1000, eval_seed=0)
    assert held0 == held1 and len(held0) == 1000
    assert set(train0) == set(train1) and train0 != train1  # same problems, the run seed's order
    assert not set(held0) & set(train0)
    assert tasks.addition_split(seed=0, num_eval=1000, eval_seed=5)[1] != held0
    # null: one shuffle by the run seed draws both, as before the key existed
    assert tasks.addition_split(seed=0, num_eval=200, eval_seed=None) == tasks.addition_split(seed=0, num_eval=200)
    assert tasks.addition_split(seed=0, num_eval=200)[1] != tasks.addition_split(seed=1, num_eval=200)[1]
    mult0 = tasks.multiplication_split(seed=0, num_eval=300, eval_seed=2)[1]
    assert mult0 == tasks.multiplication_split(seed=4, num_eval=300, eval_seed=2)[1]


def test_the_built_in_task_evaluates_every_held_out_problem_and_a_dataset_at_most_max_eval_samples(tmp_path):
    from rltrain.config.schema import DataConfig
    from rltrain.data.preference_data import build_preference_data
    from rltrain.data.prompt_data import build_prompt_data
    from rltrain.data.sft_data import build_sft_data
    from rltrain.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    _, evals, _ = build_prompt_data(tokenizer, DataConfig(num_eval=300, max_eval_samples=200), 0)
    assert len(evals) == 300
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(f'{{"prompt": "{i}+1="}}\n' for i in range(1000)))
    _, evals, _ = build_prompt_data(tokenizer, DataConfig(path=str(path), eval_fraction=0.5, max_eval_samples=200), 0)
    assert len(evals) == 200
    assert len(build_sft_data(tokenizer, DataConfig(num_eval=300, max_eval_samples=200, num_train=50), 0).eval) == 300
    preference = build_preference_data(tokenizer, DataConfig(num_eval=300, max_eval_samples=200, num_train=50), 0)
    assert len(preference.eval) == 300

def test_carrying_sums_are_the_ones_with_a_carry_out_of_units_or_tens():
    assert [tasks.Problem(a, b).carries for a, b in ((12, 34), (45, 54), (15, 5), (60, 40), (99, 99))] == [
        False, False, True, True, True,
    ]


def test_max_carry_keeps_every_easy_sum_and_that_many_carrying_ones():
    train, held = tasks.addition_split(seed=3, num_eval=200)
    kept, kept_held = tasks.addition_split(seed=3, num_eval=200, max_carry=300)
    assert kept_held == held  # the held-out problems (and so evaluation) do not change
    assert sum(p.carries for p in kept) == 300
    assert [p for p in kept if not p.carries] == [p for p in train if not p.carries]
    assert set(kept) <= set(train)
    assert tasks.addition_split(seed=3, num_eval=200, max_carry=0)[0] == [p for p in train if not p.carries]


def test_a_forgotten_carry_leaves_the_tens_one_short():
    assert [tasks.Problem(a, b).forgotten_carry_answer for a, b in ((17, 25), (95, 17), (9, 1))] == ["32", "102", "0"]
    assert [tasks.Problem(a, b).carries_from_units for a, b in ((17, 25), (60, 43), (12, 34), (95, 17))] == [
        True, False, False, True,
    ]


def test_forgotten_carries_show_that_share_of_units_carries_forgotten_and_no_other_sum():
    train, _ = tasks.addition_split(seed=0, num_eval=200)
    from_units = [p for p in train if p.carries_from_units]
    rows = {r["prompt"]: r["completion"] for r in tasks.sft_rows(train, "<eos>", forgotten_carries=0.8)}
    forgotten = {p for p in from_units if rows[p.prompt] == p.forgotten_carry_answer}
    assert 0.77 <= len(forgotten) / len(from_units) <= 0.83, len(forgotten) / len(from_units)
    assert all(rows[p.prompt] == p.answer for p in train if p not in forgotten)  # tens carries, no carry: right
    assert not any(p.forgets_carry(0.0) for p in from_units) and all(p.forgets_carry(1.0) for p in from_units)
    assert tasks.sft_rows(train, "<eos>") == tasks.sft_rows(train, "<eos>", forgotten_carries=0.0)
    held_out = tasks.sft_rows(train, "<eos>", demonstrations=False, forgotten_carries=0.8)  # answers stay right
    assert [r["completion"] for r in held_out] == [p.answer for p in train]


def test_wrong_answers_are_wrong_and_of_another_length():
    import random

    rng = random.Random(0)
    for p in tasks.addition_split(0, 100)[1]:
        w = tasks.wrong_answer(p, rng)
        assert w != p.answer and len(w) != len(p.answer)


def test_same_length_rejected_answers_differ_from_the_right_one_in_one_digit():
    import random

    problems = tasks.addition_split(0, 100)[1]
    assert tasks.preference_rows(problems, 3) == tasks.preference_rows(problems, 3, 0.0)  # the default draws as before
    rows = tasks.preference_rows(problems, 3, 1.0)
    for p, row in zip(problems, rows, strict=True):
        w = row["rejected"]
        assert w != p.answer and len(w) == len(p.answer) and int(w) >= 0 and str(int(w)) == w  # no leading zero
        assert sum(a != b for a, b in zip(w, p.answer)) == 1
    half = tasks.preference_rows(problems, 3, 0.5)
    same = sum(len(r["rejected"]) == len(p.answer) for p, r in zip(problems, half))
    assert 30 <= same <= 70
    rng = random.Random(0)
    assert {tasks.one_digit_changed("7", rng) for _ in range(200)} == set("012345689")


def test_lr_schedule_warmup_then_cosine_floor():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, cfg, 104) == 0.25
    assert lr_at(3, cfg, 104) == 1.0
    assert abs(lr_at(104, cfg, 104) - 0.1) < 1e-12
    assert abs(lr_at(54, cfg, 104) - 0.55) < 1e-12


def test_the_multiplication_task_holds_out_unseen_products_and_demonstrates_the_tool_on_a_fixed_share():
    """The built-in tool task (docs/environments.md): `a*b*c=`; a demonstration is either the bare
    product or two `multiply` calls, each ended by EOS and followed by its result, then the product."""
    import json

    train, held = tasks.multiplication_split(seed=0, num_eval=200)
    assert len(train) + len(held) == 90 * 90 * 8 and not set(train) & set(held)
    assert tasks.Problem(12, 34, "*", 5).prompt == "12*34*5=" and tasks.Problem(12, 34, "*", 5).answer == "2040"
    demo = next(p for p in train if p.calls_tool)
    ab = demo.a * demo.b
    calls = [json.dumps({"name": "multiply", "arguments": {"a": x, "b": y}}) for x, y in ((demo.a, demo.b), (ab, demo.c))]
    assert demo.demonstration("<eos>") == (
        f"<tool_call>{calls[0]}</tool_call><eos><tool_response>{ab}</tool_response>"
        f"<tool_call>{calls[1]}</tool_call><eos><tool_response>{ab * demo.c}</tool_response>{demo.answer}"
    )
    direct = next(p for p in train if not p.calls_tool)
    assert direct.demonstration("<eos>") == direct.answer
    share = sum(p.calls_tool for p in train) / len(train)
    assert abs(share - tasks.TOOL_DEMO_FRACTION) < 0.02, share
    rows = tasks.sft_rows(held[:3], "<eos>", demonstrations=False)
    assert [r["completion"] for r in rows] == [p.answer for p in held[:3]]  # SFT's evaluation: the bare product


def test_sft_rows_are_tokenized_in_one_call_as_each_alone():
    """`build_sft_data` encodes every prompt and every completion in one tokenizer call each: the
    same ids as encoding each text alone, the completion closed by EOS."""
    from rltrain.config.schema import DataConfig
    from rltrain.data.sft_data import build_sft_data, row_texts, text_rows
    from rltrain.data.tokenize import encode, encode_all
    from rltrain.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    texts = ["12+3=", "", "7*8*9=", "<tool_call>{}</tool_call>"]
    assert encode_all(tokenizer, texts) == [encode(tokenizer, t) for t in texts]
    assert encode_all(tokenizer, []) == []
    cfg = DataConfig(num_train=40, num_eval=8)
    rows, _, where = text_rows(cfg, 0, tokenizer.eos_token)
    pairs = build_sft_data(tokenizer, cfg, 0).train
    assert len(pairs) == len(rows) == 40
    for pair, row in zip(pairs, rows, strict=True):
        prompt, completion = row_texts(tokenizer, row, where)
        assert pair.prompt == encode(tokenizer, prompt)
        assert pair.completion == [*encode(tokenizer, completion), tokenizer.eos_token_id]


def test_prompts_are_tokenized_in_chunks_as_one_by_one_and_the_long_ones_dropped(monkeypatch):
    from rltrain.data import prompt_data, tokenize
    from rltrain.data.tokenize import encode
    from rltrain.models.tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    rows = [{"prompt": "1" * n + "+2=", "answer": str(n)} for n in (1, 9, 2, 12, 3, 4, 10, 5)]
    monkeypatch.setattr(tokenize, "ENCODE_CHUNK", 3)  # chunk ends fall inside and after the long rows
    kept, dropped = prompt_data._to_rows(tokenizer, rows, "here", 12, None)
    fitting = [row for row in rows if len(encode(tokenizer, row["prompt"])) <= 12]
    assert dropped == 2 and len(fitting) == 6  # n + 3 tokens: n = 12 and n = 10 are too long
    assert [r.ids for r in kept] == [encode(tokenizer, row["prompt"]) for row in fitting]
    assert [(r.text, r.columns, r.chat) for r in kept] == [(row["prompt"], {"answer": row["answer"]}, False) for row in fitting]
