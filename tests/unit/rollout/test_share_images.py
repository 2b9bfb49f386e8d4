"""`share_completions` refuses completions that carry an episode's own images instead of dropping
them on the replica's peers (rltrain/rollout/share.py: only text travels; Megatron, the one backend
with replica groups, refuses vision-language models). The bitwise sharing itself is
tests/dist/rollout/test_rollout_share.py."""

from __future__ import annotations

import pytest

from rltrain.rollout.base import Completion
from rltrain.rollout.share import share_completions


def test_a_leader_holding_episode_images_is_refused_before_any_collective():
    from PIL import Image

    seen = Completion(prompt_index=0, token_ids=[4, 9], logprobs=[-0.5, -1.0], finished=True, images=[Image.new("RGB", (28, 28))])
    # group=None: the check runs before the replica's leader is looked up, so no process group is needed
    with pytest.raises(ValueError, match="does not carry Completion.images"):
        share_completions([Completion(0, [3], [-0.1], True), seen], group=None)
