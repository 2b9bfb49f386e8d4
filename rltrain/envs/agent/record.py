"""Every token an agent's episode was served, and the training sequences they make (env=agent).

Each call's prompt is the chat template's rendering of the request's messages. Where that text
starts with the text of a sequence the episode already has, up to one of its replies, the call
continues that sequence (or forks it there): its prompt ids are the sequence's ids
*as sampled* followed by the rest of the text, tokenized on its own. The model's tokens are never
re-tokenized, so the trainer scores exactly the ids the engine saw. A call whose messages do not
extend any sequence (the agent dropped, edited or summarised its history) starts a new sequence: a
history rewrite. A chain keeps its images too: a call continues it only with the chain's first
images (the same pixels). docs/agents.md, "Every token recorded"; docs/vision.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rltrain.data.vision_rows import VisionEncoder
from rltrain.rollout.images import collapse_placeholders


@dataclass
class Chain:
    """One training sequence: the first call's prompt, then every later call's new prompt tokens
    (masked) and sampled tokens (trained, with their sampling log-probabilities)."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampled: list[bool] = field(default_factory=list)
    finished: bool = True
    text: str = ""  # the decoded text of prompt_ids + tokens (what a continuing call's rendering starts with)
    # After each reply: (len(tokens), text then, images then). A call may go on from any of them (a fork).
    marks: list[tuple[int, str, int]] = field(default_factory=list)
    version: int | None = None  # the policy version of its last reply, where the engine reports it (rollout=server)
    images: list = field(default_factory=list)  # PIL images, in the order of their placeholders in `ids`

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def upto(self, mark: int) -> Chain:
        """This chain as it was after its reply `mark` (a copy)."""
        n, text, n_images = self.marks[mark]
        return Chain(
            self.prompt_ids, self.tokens[:n], self.logprobs[:n], self.sampled[:n], True, text, self.marks[: mark + 1], self.version,
            self.images[:n_images],
        )

    def extended(
        self, prompt_ids: list[int], completion: list[int], logprobs: list[float], finished: bool, text: str, version: int | None = None,
        images: list | None = None,
    ) -> Chain:
        """This chain continued by a call whose prompt starts with its ids (a copy), whose reply
        `version` sampled; `images`: the call's (its first ones the chain's)."""
        own = self.ids
        assert prompt_ids[: len(own)] == own, "a continuing call's prompt starts with the chain's ids"
        new = prompt_ids[len(own) :]
        tokens = self.tokens + new + completion
        return Chain(
            self.prompt_ids,
            tokens,
            self.logprobs + [0.0] * len(new) + logprobs,
            self.sampled + [False] * len(new) + [True] * len(completion),
            finished,
            text,
            [*self.marks, (len(tokens), text, len(images or []))],
            version,
            list(images or []),
        )


def same_images(mine: list, theirs: list) -> bool:
    """Whether two lists hold the same images, pixel for pixel."""
    return len(mine) == len(theirs) and all(
        a.size == b.size and a.mode == b.mode and a.tobytes() == b.tobytes() for a, b in zip(mine, theirs, strict=True)
    )


@dataclass
class Continuation:
    """What the engine is given for one call: `prompt_ids`, and the chain it continues (None: a new
    one) as it was then (`base`: calls of one episode in flight together may continue it both)."""

    prompt_ids: list[int]
    chain: int | None
    base: Chain | None = None
    images: list = field(default_factory=list)  # the call's images, in placeholder order


class EpisodeRecord:
    """The calls of one agent episode, as chains of tokens."""

    def __init__(self, tokenizer: Any, attempt: int = 1, encoder: VisionEncoder | None = None, image_token: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.encoder, self.image_token = encoder, image_token  # a vision-language model's (None: text-only)
        self.attempt = attempt  # the episode's attempt it records (rltrain/envs/agent/endpoint.py)
        self.chains: list[Chain] = []
        self.calls = 0  # chat completion requests served
        self.tool_calls = 0  # tool calls in the replies served
        self.rewrites = 0  # calls that started a new chain though the episode had one
        self.last_chain: int | None = None  # the chain of the episode's last reply (the one trained)

    def continuation(self, rendered: str, images: list | None = None) -> Continuation:
        """The prompt ids for a call whose messages rendered as `rendered` with `images`: the longest
        recorded conversation it starts with (a sequence after any of its replies, with the same
        first images), continued; else the rendering tokenized whole (a new chain)."""
        images = list(images or [])
        best: tuple[int, int] | None = None
        longest = -1
        for i, chain in enumerate(self.chains):
            for m, (_, text, n_images) in enumerate(chain.marks):
                if len(text) > longest and rendered.startswith(text) and same_images(chain.images[:n_images], images[:n_images]):
                    best, longest = (i, m), len(text)
        if best is None:
            return Continuation(self._encode(rendered, images), None, images=images)
        i, m = best
        chain = self.chains[i]
        base = chain if m == len(chain.marks) - 1 else chain.upto(m)  # not its end: a fork from there
        rest = self._encode(rendered[len(base.text) :], images[len(base.images) :])
        return Continuation(base.ids + rest, i, base, images)

    def record(self, at: Continuation, replies: list[tuple[list[int], list[float], bool]], version: int | None = None) -> None:
        """A served call's replies (ids, sampling log-probabilities, finished; sampled by policy
        `version` where the engine reports it), its `n` choices: the
        first continues the chain `at` names, the others fork copies of it (a new chain each), as
        does a call whose chain another call continued meanwhile."""
        self.calls += 1
        if at.chain is None and self.chains:
            self.rewrites += 1
        base = at.base if at.base is not None else Chain(list(at.prompt_ids), text=self._decode(at.prompt_ids))
        in_place = at.chain is not None and self.chains[at.chain] is at.base
        for k, (ids, logprobs, finished) in enumerate(replies):
            grown = base.extended(at.prompt_ids, ids, logprobs, finished, self._decode(at.prompt_ids + ids), version, at.images)
            if k == 0 and in_place:
                assert at.chain is not None
                self.chains[at.chain] = grown
                self.last_chain = at.chain
            else:
                self.chains.append(grown)
                if k == 0:
                    self.last_chain = len(self.chains) - 1

    def trained(self) -> Chain | None:
        """The sequence this episode trains on: the chain of its last reply (None: no call was served)."""
        return self.chains[self.last_chain] if self.last_chain is not None else None

    def _encode(self, text: str, images: list) -> list[int]:
        """`text` as ids, each image's placeholder expanded to its visual tokens by the processor."""
        if images and self.encoder is not None:
            return self.encoder.encode(text, images)[0]
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _decode(self, ids: list[int]) -> str:
        """The text of `ids` as a rendering writes it: each image one placeholder."""
        shown = collapse_placeholders(ids, self.image_token) if self.image_token is not None else ids
        return self.tokenizer.decode(shown, skip_special_tokens=False, clean_up_tokenization_spaces=False)
