"""Images in episodes (docs/vision.md, "Agents, environments and tools"): observations and tool
results rendered as the tiny vision-language model's template marks image parts and its processor
expands them; images across the workers' JSON pipe; an agent's image_url parts and the chains they
continue; the trainer's image marks; and the bad inputs, each one paragraph. The tiny model's own
tokenizer and processor, real tool and environment workers; the engine is a scripted stand-in (a
random model never writes a tool call: the e2e runs are tests/e2e/test_cli_vision_agents.py)."""

from __future__ import annotations

import base64
import io
import json
import textwrap
from dataclasses import dataclass, field

import pytest
import torch
from PIL import Image

from rltrain.data.prompt_data import PromptRow
from rltrain.data.vision_inputs import VisionInputs, vision_call_inputs
from rltrain.data.vision_rows import VisionEncoder
from rltrain.envs.agent.endpoint import ApiError
from rltrain.envs.agent.record import EpisodeRecord
from rltrain.envs.agent.reply import render
from rltrain.envs.episodes import Episode, EpisodeRunner, before_placeholder, cut_observation
from rltrain.envs.images import agent_row, environment_row
from rltrain.envs.observations import Observation, ObservationRenderer
from rltrain.envs.tools import CallTools
from rltrain.envs.user_env import HostedEnvironments
from rltrain.envs.wire import from_wire, to_wire
from rltrain.models.tiny_vl import CHAT_TEMPLATE, IMAGE_MARKUP, build_processor, build_vl_tokenizer
from rltrain.models.tokenizer import build_char_tokenizer
from rltrain.rollout.base import Completion, SamplingSettings
from rltrain.rollout.control_wire import completions_from_json, completions_to_json
from rltrain.rollout.images import to_data_url
from rltrain.runtime.errors import UserError

TOKENIZER = build_vl_tokenizer()
PROCESSOR = build_processor(TOKENIZER)
ENCODER = VisionEncoder(PROCESSOR)
PAD = TOKENIZER.convert_tokens_to_ids("<|image_pad|>")
START, END = TOKENIZER.convert_tokens_to_ids("<|vision_start|>"), TOKENIZER.convert_tokens_to_ids("<|vision_end|>")
EOS = TOKENIZER.eos_token_id
RED, GREEN = Image.new("RGB", (56, 56), (220, 20, 20)), Image.new("RGB", (28, 28), (20, 200, 20))  # 4 and 1 visual tokens


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def same(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and a.convert("RGB").tobytes() == b.convert("RGB").tobytes()


def test_an_image_observation_is_an_image_part_the_template_marks_and_the_processor_expands():
    renderer = ObservationRenderer(TOKENIZER, PROCESSOR)
    assert renderer.image_token_id == PAD
    # In a chat episode a bare image is a user message holding one image part.
    seen = renderer.render(RED, "Env.step()", chat=True)
    assert seen.ids == ids("U:") + [START] + [PAD] * 4 + [END] + ids("\nA:") and seen.images == [RED]
    # In a text episode, text and images in order: the model's image markup where each image goes.
    seen = renderer.render(["look ", GREEN, " and ", RED], "Env.step()", chat=False)
    assert seen.ids == ids("look ") + [START, PAD, END] + ids(" and ") + [START] + [PAD] * 4 + [END]
    assert seen.images == [GREEN, RED]
    # Messages with parts: a PIL image part and an OpenAI image_url part (a data URL), in order.
    messages = [{"role": "tool", "content": [{"type": "text", "text": "r="}, {"type": "image", "image": GREEN},
                                             {"type": "image_url", "image_url": {"url": to_data_url(RED)}}]}]
    seen = renderer.render(messages, "a tool result", chat=True)
    assert seen.ids == ids("T:r=") + [START, PAD, END, START] + [PAD] * 4 + [END] + ids("\nA:")
    assert same(seen.images[0], GREEN) and same(seen.images[1], RED)
    # Text stays exactly as a text-only model renders it.
    assert renderer.render("plain", "x", chat=True).ids == ids("plain")


def test_images_cross_the_workers_json_pipe_and_come_back_as_the_same_pixels():
    sent = {"observation": [RED, png(GREEN)], "parts": [{"type": "image", "image": png(RED)}], "n": 3}
    back = from_wire(json.loads(json.dumps(to_wire(sent))), "Env.step()")
    assert same(back["observation"][0], RED) and same(back["observation"][1], GREEN)
    assert same(back["parts"][0]["image"], RED) and back["n"] == 3


@pytest.mark.parametrize(
    ("renderer", "observation", "message"),
    [
        (ObservationRenderer(TOKENIZER), RED, "Env.step() returned an image, but the model is text-only"),
        (ObservationRenderer(TOKENIZER, PROCESSOR), [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/a.png"}}]}],
         "never fetched from a remote URL"),
        (ObservationRenderer(TOKENIZER, PROCESSOR), [{"role": "user", "content": [{"type": "image", "image": "a.png"}]}],
         "a content part is {'type': 'text'"),
    ],
)
def test_an_image_the_run_cannot_take_is_one_paragraph(renderer, observation, message):
    with pytest.raises(UserError) as caught:
        renderer.render(observation, "Env.step()", chat=True)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_unreadable_image_bytes_and_a_template_without_image_parts_are_refused_by_name():
    with pytest.raises(UserError, match="the tool 'look' returned an image that cannot be read .*5 bytes starting b'junk!'"):
        from_wire(json.loads(json.dumps(to_wire(b"junk!"))), "the tool 'look'")
    blind = build_vl_tokenizer()
    blind.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"  # writes no placeholder for image parts
    with pytest.raises(UserError, match="returned 1 image.s., but the chat template wrote 0 image placeholder"):
        ObservationRenderer(blind, PROCESSOR).render(RED, "Env.step()", chat=True)


def test_a_cut_observation_never_splits_an_image_and_a_reply_stops_before_a_sampled_placeholder():
    obs = [1, START, PAD, PAD, PAD, PAD, END, 2, START, PAD, END]
    assert cut_observation(obs, ["red", "green"], 4, PAD) == ([1, START], [])  # inside the first run: back to its start
    assert cut_observation(obs, ["red", "green"], 7, PAD) == (obs[:7], ["red"])
    assert cut_observation(obs, ["red", "green"], 10, PAD) == (obs[:10], ["red", "green"])
    assert cut_observation([1, 2, 3], [], 2, None) == ([1, 2], [])
    assert before_placeholder([5, 6, PAD, 7], [-0.1, -0.2, -0.3, -0.4], PAD) == ([5, 6], [-0.1, -0.2])
    assert before_placeholder([5, PAD], [-0.1, -0.2], None) == ([5, PAD], [-0.1, -0.2])  # a text-only model's


# --- episodes in real workers ---------------------------------------------------------------

TOOLS = textwrap.dedent('''
    from PIL import Image

    def look(colour: str):
        """Show a square.

        Args:
            colour: red or green
        """
        return Image.new("RGB", (28, 28), (20, 200, 20)) if colour == "green" else b"not an image"
''')

ENV = textwrap.dedent('''
    import io
    from PIL import Image

    class Shows:
        def reset(self, prompt, images, **_):
            assert isinstance(images[0], Image.Image) and images[0].size == (56, 56)
            return None

        def step(self, action):
            if action == "b":
                return None, 1.0, True
            buf = io.BytesIO()
            Image.new("RGB", (28, 28), (20, 200, 20)).save(buf, format="PNG")
            return buf.getvalue(), 1.0, False

    class ShowsInMessages:
        """Answers every reply but the third with a user message holding the green square."""
        def reset(self, **_):
            self.turns = 0

        def step(self, action):
            self.turns += 1
            green = Image.new("RGB", (28, 28), (20, 200, 20))
            return [{"role": "user", "content": [{"type": "image", "image": green}]}], 1.0, self.turns >= 3
''')


@dataclass
class EnvCfg:
    tools: list = field(default_factory=list)
    cls: str | None = None
    describe_tools: bool = False
    max_turns: int = 2
    max_tokens_per_turn: int | None = None
    max_total_tokens: int = 200
    timeout_s: float = 30
    workers: int = 1
    max_concurrency: int = 4


@dataclass
class RewardCfg:
    on_failure: float = 0.0
    max_failure_frac: float = 0.0


@pytest.fixture
def user_code(tmp_path, monkeypatch) -> None:
    (tmp_path / "seeing_tools.py").write_text(TOOLS)
    (tmp_path / "seeing_envs.py").write_text(ENV)
    monkeypatch.syspath_prepend(str(tmp_path))


def row_with_red() -> PromptRow:
    text = f"{IMAGE_MARKUP}Colour? "
    prompt_ids, vision = ENCODER.encode(text, [RED])
    return PromptRow(prompt_ids, text, {"images": ["red.png"]}, images=[RED], vision=vision)


def scripted(replies: list[str], seen: list):
    """The engine stand-in: reply `replies[turn]` + EOS, recording each call's prompts and images."""

    def generate(prompts: list[list[int]], sampling: SamplingSettings, images: list | None = None) -> list[Completion]:
        seen.append(([list(p) for p in prompts], images))  # copies: an episode's ids grow in place
        reply = ids(replies[len(seen) - 1]) + [EOS]
        return [Completion(i, reply, [-0.5] * len(reply), True) for i in range(len(prompts))]

    return generate


def test_a_tool_that_returns_an_image_sends_it_to_the_engine_and_the_trainer(user_code):
    env_cfg = EnvCfg(tools=["seeing_tools:look"])
    renderer = ObservationRenderer(TOKENIZER, PROCESSOR)
    runner = EpisodeRunner(env_cfg, RewardCfg(), TOKENIZER, 40, 600, CallTools(env_cfg, TOKENIZER, True, renderer), None, PAD)
    seen: list = []
    call = '<tool_call>{"name": "look", "arguments": {"colour": "green"}}</tool_call>'
    try:
        played = runner.run([row_with_red()], 1, SamplingSettings(stop_token_ids=[EOS]), "train-0", scripted([call, "g"], seen))
    finally:
        runner.close()
    (done,) = played.completions
    result = ids("<tool_response>") + [START, PAD, END] + ids("</tool_response>")
    assert done.token_ids == ids(call) + [EOS] + result + ids("g") + [EOS]
    assert done.sampled == [True] * (len(ids(call)) + 1) + [False] * len(result) + [True] * 2
    # The engine saw the prompt's image, then the prompt's and the tool's; the trainer gets both.
    assert [len(images[0]) for _, images in seen] == [1, 2] and same(seen[1][1][0][1], GREEN)
    assert done.images is not None and same(done.images[0], RED) and same(done.images[1], GREEN)


def test_a_tool_that_returns_unreadable_bytes_stops_the_run_in_one_paragraph(user_code):
    env_cfg = EnvCfg(tools=["seeing_tools:look"])
    runner = EpisodeRunner(env_cfg, RewardCfg(), TOKENIZER, 40, 600, CallTools(env_cfg, TOKENIZER, True, ObservationRenderer(TOKENIZER, PROCESSOR)))
    call = '<tool_call>{"name": "look", "arguments": {"colour": "red"}}</tool_call>'
    try:
        with pytest.raises(UserError, match="the tool 'look' returned an image that cannot be read"):
            runner.run([row_with_red()], 1, SamplingSettings(stop_token_ids=[EOS]), "train-0", scripted([call, "r"], []))
    finally:
        runner.close()


def test_an_environment_gets_its_rows_image_and_answers_with_image_bytes(user_code):
    env_cfg = EnvCfg(cls="seeing_envs:Shows", max_turns=2)
    renderer = ObservationRenderer(TOKENIZER, PROCESSOR)
    runner = EpisodeRunner(env_cfg, RewardCfg(), TOKENIZER, 40, 600, HostedEnvironments(env_cfg, RewardCfg(), TOKENIZER, True, renderer), None, PAD)
    seen: list = []
    try:
        played = runner.run([row_with_red()], 2, SamplingSettings(stop_token_ids=[EOS]), "train-0", scripted(["a", "b"], seen))
    finally:
        runner.close()
    assert played.failures.errors == 0 and played.returns == [2.0, 2.0]  # reset saw a PIL image (its assert held)
    for done in played.completions:
        assert done.token_ids == ids("a") + [EOS, START, PAD, END] + ids("b") + [EOS]
        assert done.images is not None and len(done.images) == 2 and same(done.images[1], GREEN)
    assert [len(images[0]) for _, images in seen] == [1, 2]


# The tiny template with a Qwen3-like rule: an assistant turn followed by more messages is
# rendered without its thinking block (what precedes '</think>').
DROPS_THINKING = CHAT_TEMPLATE.replace(
    "{% if m['content'] is string %}{{ m['content'] }}",
    "{% if m['content'] is string %}{{ m['content'].split('</think>')[-1] if m['role'] == 'assistant' and not loop.last else m['content'] }}",
)


def test_replies_the_template_rewrites_train_where_sampled_with_the_images_their_ids_hold(user_code):
    tokenizer = build_vl_tokenizer()
    tokenizer.chat_template = DROPS_THINKING
    env_cfg = EnvCfg(cls="seeing_envs:ShowsInMessages", max_turns=3)
    renderer = ObservationRenderer(tokenizer, build_processor(tokenizer))
    runner = EpisodeRunner(env_cfg, RewardCfg(), tokenizer, 40, 600, HostedEnvironments(env_cfg, RewardCfg(), tokenizer, True, renderer), None, PAD)
    seen: list = []
    replies = ["<think>hm</think>a", "<think>so</think>b", "c"]
    try:
        played = runner.run([row_with_red()], 1, SamplingSettings(stop_token_ids=[EOS]), "train-0", scripted(replies, seen))
    finally:
        runner.close()
    # Each next prompt holds the template's rendering of the reply (no thinking) and the green square, whole.
    history = [ids(f"{r}\nU:") + [START, PAD, END] + ids("\nA:") for r in "ab"]
    assert seen[2][0][0] == row_with_red().ids + history[0] + history[1]
    assert [len(images[0]) for _, images in seen] == [1, 2, 3] and same(seen[2][1][0][2], GREEN)
    (done,) = played.completions
    assert done.token_ids == history[0] + history[1] + ids("c") + [EOS] and sum(done.sampled) == 2
    assert done.images is not None and [im.size for im in done.images] == [(56, 56), (28, 28), (28, 28)]
    # Each rewritten reply trains after the ids it was sampled after, with the images those ids hold:
    # the first the row's (None), the second the row's and the first observation's.
    first, second = played.extra
    assert played.extra_episode == [0, 0]
    assert first.token_ids == ids(replies[0]) + [EOS] and all(first.sampled) and first.images is None
    assert second.token_ids == history[0] + ids(replies[1]) + [EOS]
    assert second.sampled == [False] * len(history[0]) + [True] * (len(ids(replies[1])) + 1)
    assert second.images is not None and [im.size for im in second.images] == [(56, 56), (28, 28)]
    assert second.token_ids.count(PAD) == 1  # its own ids hold the green square's one visual token, the prompt the red's


def test_a_rewritten_reply_frees_its_room_for_the_observation_and_the_cut_keeps_images_whole():
    rewritten = ids("a\nU:") + [START] + [PAD] * 4 + [END] + ids("\nA:")  # the reply re-rendered, then the red square

    def played(max_total_tokens: int) -> Episode:
        e = Episode(0, "train-0:0", {}, [7, 8], images=[GREEN])
        e.append([1, 2, 3], [-0.1, -0.2, -0.3])
        e.actions.append("<t>a")
        e.observe(Observation(rewritten, [RED], rewrites_reply=True), max_total_tokens - len(e.tokens), PAD)
        return e

    cut = played(7)  # room 7 ends inside the red square's visual tokens: the cut moves back to its start
    assert cut.tokens == rewritten[:5] and cut.context == [7, 8] + rewritten[:5] and cut.images == [GREEN] and not cut.seen_images
    assert cut.rewritten[0].token_ids == [1, 2, 3] and cut.rewritten[0].images is None
    whole = played(10)
    assert whole.tokens == rewritten[:10] and whole.images == [GREEN, RED] and whole.completion().images == [GREEN, RED]
    assert whole.sampled == [False] * 10 and whole.open_reply() is None


def test_episodes_without_new_images_keep_their_rows_and_rows_reach_user_code_as_it_reads_them():
    row = row_with_red()
    as_env = from_wire(json.loads(json.dumps(to_wire(environment_row(row)))), "row")
    assert same(as_env["images"][0], RED) and as_env["prompt"] == row.text
    chat = PromptRow(row.ids, row.text, {"images": ["red.png"], "answer": "red"}, True,
                     [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}], [RED], row.vision)
    as_agent = agent_row(chat)
    url = as_agent["prompt"][0]["content"][0]["image_url"]["url"]
    assert url == to_data_url(RED) and as_agent["images"] == [url] and as_agent["answer"] == "red"
    json.dumps(as_agent)  # plain data: it crosses the pipe to the agent's worker


def test_every_image_column_reaches_environments_as_pil_and_agents_as_data_urls():
    """A row's image columns hold PIL images (rltrain.data.vision_rows.columns_with_images): the
    mapped column and `image` beside `images`; each crosses to the user's code in its form."""
    row = row_with_red()
    chat = PromptRow(row.ids, row.text, {"images": [RED], "pics": [RED], "image": GREEN, "answer": "red"}, True,
                     [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}], [RED], row.vision)
    as_env = from_wire(json.loads(json.dumps(to_wire(environment_row(chat)))), "row")
    assert same(as_env["pics"][0], RED) and same(as_env["image"], GREEN) and as_env["answer"] == "red"
    as_agent = json.loads(json.dumps(agent_row(chat)))  # plain data: it crosses the pipe to the agent's worker
    assert as_agent["images"] == as_agent["pics"] == [to_data_url(RED)] and as_agent["image"] == to_data_url(GREEN)


def test_completions_with_their_own_images_survive_a_checkpoint():
    done = Completion(0, [1, 2], [-0.1, -0.2], True, [True, False], [3], None, [RED, GREEN])
    (back,) = completions_from_json(json.loads(json.dumps(completions_to_json([done]))))
    assert back.images is not None and same(back.images[0], RED) and same(back.images[1], GREEN)
    assert (back.token_ids, back.sampled, back.prompt_ids) == ([1, 2], [True, False], [3])
    assert completions_from_json(completions_to_json([Completion(0, [1], [0.0], True)]))[0].images is None


# --- agents ---------------------------------------------------------------------------------


def test_an_agents_image_parts_render_for_a_model_that_sees_and_are_refused_for_one_that_does_not():
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": to_data_url(RED)}}, {"type": "text", "text": "Colour?"}]}]
    assert render(TOKENIZER, messages, None, None, sees=True) == f"U:{IMAGE_MARKUP}Colour?\nA:"
    with pytest.raises(ApiError, match="this run's model is text-only: it cannot read image_url content parts"):
        render(build_char_tokenizer(), messages, None, None, sees=False)
    with pytest.raises(ApiError, match="only text and image_url content parts"):
        render(TOKENIZER, [{"role": "user", "content": [{"type": "input_audio"}]}], None, None, sees=True)


def test_a_call_continues_a_chain_only_with_the_same_images_and_its_ids_hold_every_visual_token():
    record = EpisodeRecord(TOKENIZER, 1, ENCODER, PAD)
    first = f"U:{IMAGE_MARKUP}Colour?\nA:"
    at = record.continuation(first, [RED])
    assert at.chain is None and at.prompt_ids == ENCODER.encode(first, [RED])[0] and at.prompt_ids.count(PAD) == 4
    record.record(at, [(ids("re"), [-0.1, -0.2], False)])
    # The agent appends the reply and a new image (decoded again: the same pixels, another object).
    second = first + f"re\nU:{IMAGE_MARKUP}And?\nA:"
    red_again = Image.open(io.BytesIO(base64.b64decode(to_data_url(RED).split(",")[1]))).convert("RGB")
    at = record.continuation(second, [red_again, GREEN])
    assert at.chain == 0 and at.prompt_ids == record.chains[0].ids + ENCODER.encode(f"\nU:{IMAGE_MARKUP}And?\nA:", [GREEN])[0]
    record.record(at, [(ids("g"), [-0.3], True)])
    (chain,) = record.chains
    assert chain.sampled == [True, True] + [False] * (len(at.prompt_ids) - len(ENCODER.encode(first, [RED])[0]) - 2) + [True]
    assert len(chain.images) == 2 and record.rewrites == 0
    # The same text with another first image is not that conversation: a new chain.
    at = record.continuation(second, [GREEN, GREEN])
    assert at.chain is None and at.prompt_ids.count(PAD) == 2


def test_the_trainer_marks_the_image_tokens_the_policy_did_not_sample():
    vision = VisionInputs({"pixel_values": torch.zeros(8, 4), "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}, 2)
    ids_BT = torch.tensor([[START, PAD, END, 7, PAD, START, PAD, END]])  # prompt image, a sampled PAD, an observation image
    sampled_BT = torch.tensor([[False, False, False, True, True, False, False, False]])
    marks = vision_call_inputs(PAD, ids_BT, [vision], sampled_BT)["mm_token_type_ids"]
    assert marks.tolist() == [[0, 1, 0, 0, 0, 0, 1, 0]]


@dataclass
class AgentCfg:
    agent: str = "seeing_agent:run"
    chat_template: str | None = None
    max_tokens_per_turn: int | None = None
    max_total_tokens: int = 64
    timeout_s: float = 30
    workers: int = 1
    max_concurrency: int = 4


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "messages[0].content[0]: an image must be a data URL"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"junk").decode()}},
         "does not hold a PNG image"),
        ({"type": "text", "text": "<|image_pad|>"}, "the messages hold 0 image(s) but their rendering has 1 image placeholder(s)"),
    ],
)
def test_an_agents_image_the_endpoint_cannot_take_is_a_400_naming_it(part, message):
    from rltrain.envs.agent.endpoint import Pending, parse_chat_request
    from rltrain.envs.agent.runner import AgentRunner

    runner = AgentRunner(AgentCfg(), RewardCfg(), TOKENIZER, 8, 64, 600, False, ObservationRenderer(TOKENIZER, PROCESSOR))
    try:
        request = parse_chat_request({"messages": [{"role": "user", "content": [part]}]})
        with pytest.raises(ApiError) as caught:
            runner._rendered(Pending(0, request))
        assert caught.value.status == 400 and message in caught.value.message
    finally:
        runner.close()
