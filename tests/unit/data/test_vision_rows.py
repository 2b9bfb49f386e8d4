"""TRL's vision formats through the real loading path (build_sft_data on files and saved
datasets): images as paths relative to the dataset file, bytes, the datasets Image feature,
several per prompt, conversational image parts and `<image>` placeholders, `data.columns.images`;
and each bad input as one paragraph naming the row."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from rltrain.config.schema import DataColumns, DataConfig
from rltrain.data.prompt_data import build_prompt_data
from rltrain.data.sft_data import build_sft_data
from rltrain.models.tokenizer import load_tokenizer
from rltrain.models.vision import load_processor
from rltrain.runtime.errors import UserError


@pytest.fixture(scope="module")
def processor(tiny_vl_dir):
    return load_processor(tiny_vl_dir, load_tokenizer(tiny_vl_dir))


def png(size=(56, 56), colour=(200, 0, 0)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return out.getvalue()


def jsonl(tmp_path, rows, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def sft(processor, path, **data):
    return build_sft_data(processor.tokenizer, DataConfig(path=path, eval_fraction=0.0, **data), 0, processor)


def image_tokens(processor, ids):
    return sum(t == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") for t in ids)


def test_paths_relative_to_the_file_and_several_images_per_prompt(processor, tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.png").write_bytes(png((56, 56)))
    (tmp_path / "imgs" / "b.png").write_bytes(png((28, 28)))
    rows = [{"images": ["imgs/a.png", "imgs/b.png"], "prompt": "<image> and <image>: same? ", "completion": "no"},
            {"image": "imgs/b.png", "prompt": "<image>colour? ", "completion": "red"}]
    data = sft(processor, jsonl(tmp_path, [rows[0]]))
    (pair,) = data.train
    assert pair.vision.num_images == 2 and pair.vision.tensors["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2]]
    assert image_tokens(processor, pair.prompt) == 4 + 1  # 4x4 patches merged 2x2, then 2x2 merged
    (one,) = sft(processor, jsonl(tmp_path, [rows[1]], "one.jsonl")).train
    assert one.vision.num_images == 1 and image_tokens(processor, one.prompt) == 1
    assert processor.tokenizer.decode(one.completion) == "red<eos>"


def test_conversational_rows_with_image_parts_and_a_mapped_column(processor, tmp_path):
    (tmp_path / "x.png").write_bytes(png())
    row = {"pictures": ["x.png"], "messages": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it? "}]},
        {"role": "assistant", "content": [{"type": "text", "text": "a square"}]}]}
    (pair,) = sft(processor, jsonl(tmp_path, [row]), columns=DataColumns(images="pictures")).train
    assert processor.tokenizer.decode(pair.prompt).startswith("U:<|vision_start|><|image_pad|>")
    assert processor.tokenizer.decode(pair.prompt).endswith("What is it? \nA:")
    assert processor.tokenizer.decode(pair.completion) == "a square<eos>"
    assert pair.vision.num_images == 1


def test_the_datasets_image_feature_and_bytes(processor, tmp_path):
    import datasets

    ds = datasets.Dataset.from_dict({"image": [Image.new("RGB", (28, 28), (0, 0, 200))],
                                     "prompt": ["<image>colour? "], "completion": ["blue"]})
    ds.save_to_disk(str(tmp_path / "saved"))
    (pair,) = sft(processor, str(tmp_path / "saved")).train
    assert pair.vision.tensors["image_grid_thw"].tolist() == [[1, 2, 2]]
    as_bytes = datasets.Dataset.from_dict({"images": [[png((28, 28), (0, 0, 200))]], "prompt": ["<image>colour? "],
                                           "completion": ["blue"]})
    as_bytes.to_parquet(str(tmp_path / "b.parquet"))
    (same,) = sft(processor, str(tmp_path / "b.parquet")).train
    assert (same.vision.tensors["pixel_values"] - pair.vision.tensors["pixel_values"]).abs().max() < 1e-6


@pytest.mark.parametrize("row, needle", [
    ({"images": ["missing.png"], "prompt": "<image>?", "completion": "x"}, "row 0 names an image that cannot be read"),
    ({"images": ["not_an_image.png"], "prompt": "<image>?", "completion": "x"}, "row 0 names an image that cannot be read"),
    ({"images": ["ok.png", "ok.png"], "prompt": "<image>?", "completion": "x"}, "row 0 has 2 image(s) but its prompt marks 1"),
    ({"images": ["ok.png"], "messages": [{"role": "user", "content": "no part"}, {"role": "assistant", "content": "x"}]},
     "row 0 has 1 image(s) but its prompt marks 0"),
])
def test_bad_rows_are_one_paragraph_naming_the_row(processor, tmp_path, row, needle):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "not_an_image.png").write_text("hello")
    with pytest.raises(UserError, match="data.path=") as err:
        sft(processor, jsonl(tmp_path, [row]))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_images_for_a_text_only_model_are_refused(tmp_path):
    from rltrain.models.tokenizer import build_char_tokenizer

    (tmp_path / "ok.png").write_bytes(png())
    path = jsonl(tmp_path, [{"images": ["ok.png"], "prompt": "<image>?", "completion": "x"}])
    with pytest.raises(UserError, match="the model is text-only"):
        build_sft_data(build_char_tokenizer(), DataConfig(path=path, eval_fraction=0.0), 0, None)


def test_visual_tokens_count_towards_max_length(processor, tmp_path):
    (tmp_path / "big.png").write_bytes(png((112, 112)))  # 16 visual tokens
    path = jsonl(tmp_path, [{"images": ["big.png"], "prompt": "<image>?", "completion": "x"},
                            {"prompt": "short?", "images": [], "completion": "x"}])
    data = sft(processor, path, max_length=16)
    assert data.overlong.dropped == 1 and len(data.train) == 1
    with pytest.raises(UserError, match="more than data.max_length=16"):
        sft(processor, path, max_length=16, overlong="error")


def test_rl_prompts_keep_their_images_for_the_rollout_and_the_trainer(processor, tmp_path):
    (tmp_path / "a.png").write_bytes(png((56, 56)))
    rows = [{"image": "a.png", "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
             "answer": "red"},
            {"images": ["a.png", "a.png"], "prompt": "<image><image>same?", "answer": "yes"}]
    train, _, dropped = build_prompt_data(processor.tokenizer, DataConfig(path=jsonl(tmp_path, rows), eval_fraction=0.0), 0,
                                          processor=processor)
    assert dropped == 0 and [len(r.images) for r in train] == [1, 2] and [r.vision.num_images for r in train] == [1, 2]
    assert train[0].chat and train[0].text.count("<|image_pad|>") == 1  # the engine's text: one marker per image
    assert image_tokens(processor, train[0].ids) == 4 and image_tokens(processor, train[1].ids) == 8
    assert train[0].columns["answer"] == "red"  # reward functions still read the other columns


def test_kto_examples_carry_their_prompts_images_unpaired_and_paired(processor, tmp_path):
    from rltrain.algos.kto import examples_to_batch, mismatched
    from rltrain.data.unpaired_data import build_unpaired_data
    from rltrain.data.vision_inputs import VISION

    (tmp_path / "a.png").write_bytes(png((56, 56)))
    (tmp_path / "b.png").write_bytes(png((56, 56), (0, 0, 200)))
    user = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    unpaired = [{"image": "a.png", "prompt": "<image>colour? ", "completion": "red", "label": True},
                {"image": "b.png", "prompt": user, "completion": [{"role": "assistant", "content": "blue"}], "label": True},
                {"image": "b.png", "prompt": "<image>colour? ", "completion": "green", "label": False},
                {"image": "a.png", "prompt": "<image>colour? ", "completion": "blue", "label": False}]
    held_out = jsonl(tmp_path, unpaired, "held_out.jsonl")
    cfg = DataConfig(path=jsonl(tmp_path, unpaired), eval_path=held_out)
    data = build_unpaired_data(processor.tokenizer, cfg, 0, processor)
    assert [e.vision.num_images for e in data.train] == [1, 1, 1, 1]
    assert [image_tokens(processor, e.prompt) for e in data.train] == [4, 4, 4, 4]  # 56 pixels: 4 visual tokens
    # held out: per prompt and image, "red" against "blue" for image a; rows 0, 2 and 3 share their
    # prompt ids, but row 2's image is another, so its "green" is not a's undesirable completion
    assert len(data.eval) == 1 and processor.tokenizer.decode(data.eval[0].rejected[:-1]) == "blue"
    assert torch.equal(data.eval[0].vision.tensors["pixel_values"], data.train[0].vision.tensors["pixel_values"])
    batch = examples_to_batch(mismatched(data.train, 512))
    assert [v.num_images for v in batch.extras[VISION]] == [1, 1, 1, 1]
    assert batch.extras[VISION][1] is data.train[1].vision  # a mismatched pair keeps its prompt's images
    paired = [{"image": "a.png", "prompt": "<image>colour? ", "chosen": "red", "rejected": "blue"}]
    data = build_unpaired_data(processor.tokenizer, DataConfig(path=jsonl(tmp_path, paired), eval_fraction=0.0), 0, processor)
    assert [e.desirable for e in data.train] == [True, False] and data.train[0].vision is data.train[1].vision


def test_kto_image_rows_for_a_text_only_model_are_refused(tmp_path):
    from rltrain.data.unpaired_data import build_unpaired_data
    from rltrain.models.tokenizer import build_char_tokenizer

    (tmp_path / "ok.png").write_bytes(png())
    path = jsonl(tmp_path, [{"images": ["ok.png"], "prompt": "<image>?", "completion": "x", "label": True}])
    with pytest.raises(UserError, match="but the model is text-only"):
        build_unpaired_data(build_char_tokenizer(), DataConfig(path=path, eval_fraction=0.0), 0)


def test_a_kto_image_row_without_a_boolean_label_is_named(processor, tmp_path):
    from rltrain.data.unpaired_data import build_unpaired_data

    (tmp_path / "ok.png").write_bytes(png())
    rows = [{"image": "ok.png", "prompt": "<image>?", "completion": "x", "label": True},
            {"image": "ok.png", "prompt": "<image>?", "completion": "y", "label": "yes"}]
    with pytest.raises(UserError, match="row 1 needs 'prompt' and 'completion' .* and a boolean 'label'"):
        build_unpaired_data(processor.tokenizer, DataConfig(path=jsonl(tmp_path, rows), eval_fraction=0.0), 0, processor)


def test_preference_pairs_carry_their_prompts_images(processor, tmp_path):
    from rltrain.algos.preference import pairs_to_batch
    from rltrain.data.preference_data import build_preference_data
    from rltrain.data.vision_inputs import VISION

    (tmp_path / "a.png").write_bytes(png((56, 56)))
    (tmp_path / "b.png").write_bytes(png((28, 28)))
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}
    rows = [{"image": "a.png", "prompt": "<image>colour? ", "chosen": "red", "rejected": "blue"},
            {"image": "b.png", "chosen": [user, {"role": "assistant", "content": "red"}],
             "rejected": [user, {"role": "assistant", "content": [{"type": "text", "text": "green"}]}]},
            {"image": "b.png", "prompt": "<image>same", "chosen": "x", "rejected": "x"}]  # no preference: skipped
    data = build_preference_data(processor.tokenizer, DataConfig(path=jsonl(tmp_path, rows), eval_fraction=0.0), 0, processor)
    assert data.skipped.identical == 1 and len(data.train) == 2
    assert [image_tokens(processor, p.prompt) for p in data.train] == [4, 1]
    assert processor.tokenizer.decode(data.train[1].rejected) == "green<eos>"
    batch = pairs_to_batch(data.train)  # chosen, rejected, chosen, rejected: each with its pair's images
    grids = [v.tensors["image_grid_thw"].tolist() for v in batch.extras[VISION]]
    assert grids == [[[1, 4, 4]], [[1, 4, 4]], [[1, 2, 2]], [[1, 2, 2]]]
    assert [v.tensors["image_grid_thw"].tolist() for v in batch.select([3, 0]).extras[VISION]] == [[[1, 2, 2]], [[1, 4, 4]]]


def _is_rgb_square(image, size, colour) -> bool:
    return isinstance(image, Image.Image) and image.mode == "RGB" and image.size == size and image.getpixel((0, 0)) == colour


@pytest.mark.parametrize("layout", ["path", "bytes", "image value", "image value with a path", "PIL"])
def test_rl_rows_give_their_image_columns_as_pil_images_in_every_layout(processor, tmp_path, layout):
    """What the reward functions, environments and judges read: the image columns as RGB PIL images
    (the mapped column `data.columns.images` names too), whichever layout the dataset gave; a
    parquet file holds the datasets Image layout, a saved dataset PIL images."""
    import datasets

    red, blue = (200, 0, 0), (0, 0, 200)
    (tmp_path / "a.png").write_bytes(png((56, 56), red))
    (tmp_path / "b.png").write_bytes(png((28, 28), blue))
    as_layout = {
        "path": lambda name: name,
        "bytes": lambda name: (tmp_path / name).read_bytes(),
        "image value": lambda name: {"bytes": (tmp_path / name).read_bytes(), "path": None},
        "image value with a path": lambda name: {"bytes": None, "path": str(tmp_path / name)},
        "PIL": lambda name: Image.open(tmp_path / name),
    }[layout]
    columns = {"pics": [[as_layout("a.png")]], "image": [as_layout("b.png")], "prompt": ["<image>colour? "],
               "answer": ["red"]}
    if layout == "PIL":
        path = tmp_path / "saved"
        features = datasets.Features({"pics": [datasets.Image()], "image": datasets.Image(), "prompt": datasets.Value("string"),
                                      "answer": datasets.Value("string")})
        datasets.Dataset.from_dict(columns, features=features).save_to_disk(str(path))
    else:
        path = tmp_path / "rows.parquet"
        datasets.Dataset.from_dict(columns).to_parquet(str(path))
    cfg = DataConfig(path=str(path), eval_fraction=0.0, columns=DataColumns(images="pics"))
    (row,), _, _ = build_prompt_data(processor.tokenizer, cfg, 0, processor=processor)
    (image,) = row.images  # the prompt's images are the mapped column's
    assert _is_rgb_square(image, (56, 56), red)
    assert row.columns["images"] == [image] and row.columns["pics"] == [image]  # the mapped column and its copy: decoded once
    assert row.columns["images"][0] is image and row.columns["pics"][0] is image
    assert _is_rgb_square(row.columns["image"], (28, 28), blue)  # `image`, one image, besides
    assert row.columns["answer"] == "red" and "prompt" not in row.columns
