"""Agents and environments that see, end to end (`python -m rltrain`, docs/vision.md): GRPO on the
tiny vision-language model with vLLM, where an agent sends the row's image and one of its own as
OpenAI `image_url` parts, and where a Python environment answers with images (a PIL image in a
message part, then bare PNG bytes). Every turn's images reach the engine and the trainer with the
episode's sequence: the trainer's log-probabilities of the sampled tokens equal the engine's (fp32
parity), which fails when an image is missing, misplaced or marked where the model sampled text.
An image sent to a text-only model is refused in one paragraph. Tools that return images:
tests/unit/envs/test_episode_images.py (a random model writes no tool call)."""

from __future__ import annotations

import json

import pytest
from cli import rltrain, train_rows

pytestmark = pytest.mark.e2e

AGENT = '''
import base64, io
from PIL import Image

def square(colour):
    buf = io.BytesIO()
    Image.new("RGB", (28, 28), colour).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

def run(client, row):
    messages = list(row["prompt"])  # the row's image part arrives as an image_url data URL
    assert messages[0]["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    first = client.chat.completions.create(model="any", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": [{"type": "text", "text": "And? "},
                                              {"type": "image_url", "image_url": {"url": square((20, 20, 220))}}]}]
    second = client.chat.completions.create(model="any", messages=messages, max_tokens=4)
    return sum(map(ord, second.choices[0].message.content or "")) % 5 / 4  # differs between samples

def remote(client, row):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]
    client.chat.completions.create(model="any", messages=messages, max_tokens=4)
    return 0.0

def text_only(client, row):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": square((1, 2, 3))}}]}]
    client.chat.completions.create(model="any", messages=messages, max_tokens=4)
    return 0.0
'''

ENV = '''
import io
from PIL import Image

class Looks:
    """Answers the first reply with a PIL image in a message part, the second with PNG bytes."""

    def reset(self, prompt, images, **_):
        assert isinstance(images[0], Image.Image)  # the row's image, as PIL
        self.turn = 0

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            part = {"type": "image", "image": Image.new("RGB", (56, 56), (200, 20, 20))}
            return [{"role": "user", "content": [{"type": "text", "text": "See: "}, part]}], 0.0, False
        if self.turn == 2:
            buf = io.BytesIO()
            Image.new("RGB", (28, 28), (20, 200, 20)).save(buf, format="PNG")
            return buf.getvalue(), 0.0, False
        return None, sum(map(ord, action)) % 5 / 4, True
'''

TOOL = '''
from PIL import Image

def look() -> object:
    """Show the square."""
    return Image.new("RGB", (56, 56), (200, 20, 20))

def score(prompts, completions, **_):
    return [sum(map(ord, c)) % 5 / 4 for c in completions]
'''
CALL = '<tool_call>{"name": "look"}</tool_call>'

GRPO = [
    "algo=grpo", "algo.prompts_per_step=2", "algo.group_size=2", "algo.max_new_tokens=4", "trainer.max_steps=2",
    "trainer.eval_every=0", "data.num_eval=2", "logger.wandb.mode=disabled", "optim.lr=1e-2", "trainer.progress=lines",
]


@pytest.fixture(scope="module")
def seeing(image_data, tmp_path_factory):
    """Prompts with an image each (the session's colour squares, tests/vision_data.py), the agent,
    the environment and the tool beside them."""
    root = tmp_path_factory.mktemp("seeing")
    squares = [str(image_data / "imgs" / f"{i}.png") for i in range(8)]
    rows = [{"images": [squares[i]], "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]}
            for i in range(6)]
    (root / "chat_prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "seeing_agent.py").write_text(AGENT)
    (root / "seeing_env.py").write_text(ENV)
    (root / "seeing_tool.py").write_text(TOOL)
    calls = [{"images": [square], "prompt": "<image>Colour? ", "completion": CALL} for square in squares]
    (root / "calls.jsonl").write_text("\n".join(json.dumps(r) for r in calls))
    (root / "text_prompts.jsonl").write_text("\n".join(json.dumps({k: r[k] for k in ("images", "prompt")}) for r in calls))
    return root


def check_parity(run_dir) -> list[dict]:
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # every sampled token of every turn, scored with the episode's images, is the engine's
        assert r["rollout/logprob_diff_max"] < 1e-3 and r["grad_norm"] > 0, r
        assert r["env/errors"] == r["env/timeouts"] == 0.0, r
    return rows


def test_an_agent_that_sends_images_trains_at_fp32_parity(tiny_cache, seeing, tmp_path):
    rltrain(*GRPO, "model=tiny_vl", "env=agent", "env.agent=seeing_agent:run", f"data.path={seeing / 'chat_prompts.jsonl'}",
            run_dir=tmp_path / "run", env={"PYTHONPATH": str(seeing)}, timeout=600)
    for r in check_parity(tmp_path / "run"):
        assert r["env/turns_mean"] == 2.0 and r["env/no_calls"] == 0.0, r
        # The second call continues the first call's sequence (its image matched pixel for pixel), except
        # where the reply sampled a special token the reply's text leaves out.
        assert r["env/history_rewrites"] < 4, r


def test_a_python_environment_that_answers_with_images_trains_at_fp32_parity(tiny_cache, seeing, tmp_path):
    rltrain(*GRPO, "model=tiny_vl", "env=python", "env.cls=seeing_env:Looks", "env.max_turns=3", f"data.path={seeing / 'chat_prompts.jsonl'}",
            run_dir=tmp_path / "run", env={"PYTHONPATH": str(seeing)}, timeout=600)
    for r in check_parity(tmp_path / "run"):
        assert r["env/turns_mean"] == 3.0, r


def test_a_tool_that_returns_an_image_trains_at_fp32_parity(tiny_cache, seeing, tmp_path):
    # A random model writes no tool call: 50 SFT steps teach it this one (most samples then call it).
    rltrain("algo=sft", "model=tiny_vl", f"data.path={seeing / 'calls.jsonl'}", "trainer.max_steps=50", "trainer.global_batch_size=8",
            "trainer.micro_batch_size=8", "optim.lr=1e-2", "trainer.eval_every=0", "logger.wandb.mode=disabled",
            run_dir=tmp_path / "sft", timeout=600)
    rltrain(*GRPO, f"model.path={tmp_path / 'sft' / 'final'}", "env=tools", "env.tools=[seeing_tool:look]", "env.describe_tools=false",
            "env.max_turns=2", "reward.fns=[seeing_tool:score]", "algo.max_new_tokens=48", f"data.path={seeing / 'text_prompts.jsonl'}",
            run_dir=tmp_path / "run", env={"PYTHONPATH": str(seeing)}, timeout=600)
    rows = train_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:  # the replies after the tool's image are scored with it, as the engine sampled them
        assert r["rollout/logprob_diff_max"] < 1e-3 and r["env/errors"] == 0.0, r
    assert sum(r["env/tool_calls_mean"] for r in rows) > 0, rows


@pytest.mark.parametrize(
    ("model", "agent", "message"),
    [
        ("tiny_vl", "remote", "remote URLs are not fetched"),
        ("tiny", "text_only", "this run's model is text-only: it cannot read image_url content parts"),
    ],
)
def test_an_image_the_run_cannot_take_is_refused_in_one_paragraph(tiny_cache, seeing, tmp_path, model, agent, message):
    proc = rltrain(*GRPO, f"model={model}", "rollout=hf", "trainer.max_steps=1", "env=agent", f"env.agent=seeing_agent:{agent}",
                   run_dir=tmp_path / "run", env={"PYTHONPATH": str(seeing)}, check=False, timeout=400)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
