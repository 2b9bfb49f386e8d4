"""A judge model served by the run (`reward_model.path`): vLLM's OpenAI-compatible API server in a
process of its own, started and stopped like `rollout=server`'s spawned servers (it dies with the
trainer however the trainer dies), so the judge is asked over the same HTTP as any endpoint and a
judge that wedges is a request that times out, never a hung trainer.

Under `placement.time_sharing=true` on CUDA it is started in sleep mode and sleeps (level 1: the
weights kept in host memory) except while it scores, so it holds no accelerator memory while the
trainer trains or the rollout engine generates (on a CPU it stays up). Its completions requests
carry token ids from rltrain's tokenizer loader. docs/rewards-and-roles.md, "The LLM judge".
"""

from __future__ import annotations

from pathlib import Path

from rltrain.config.group_options import JudgeRewardModelConfig, ServerRolloutConfig
from rltrain.rollout.server.client import call
from rltrain.rollout.server.process import SpawnedServer

SLEEP_TIMEOUT_S = 120.0


class ServedJudge:
    """The run's judge server; `url` is its API base (…/v1), the model name its directory."""

    def __init__(
        self, model_dir: str | Path, rm: JudgeRewardModelConfig, dtype: str, cuda: bool, log_path: Path, seed: int,
        time_sharing: bool,
    ) -> None:
        from rltrain.models.tokenizer import load_tokenizer

        # First: a directory that holds no tokenizer fails here, before a server is started for it.
        self.tokenizer = load_tokenizer(model_dir)
        self.model_name = str(model_dir)
        self.sleeps = cuda and time_sharing
        settings = ServerRolloutConfig(
            seed=seed, kv_cache_gib=rm.kv_cache_gib, max_model_len=rm.max_length,
            gpu_memory_utilization=rm.gpu_memory_utilization,
        )
        extra = ("--enable-sleep-mode",) if self.sleeps else ()
        self.server = SpawnedServer(settings, model_dir, dtype, cuda, log_path, extra_args=extra)
        self.url = self.server.url + "/v1"
        self.start_timeout_s = rm.start_timeout_s
        self.ready = False

    def encode(self, texts: list[str]) -> list[list[int]]:
        """The judge prompts as token ids, read by the judge's tokenizer as rltrain reads it (what a
        judge trained by rltrain saw): vLLM's own loading of a tokenizer may differ (it drops the
        tiny model's spaces), and the engine takes ids as they are."""
        return [list(ids) for ids in self.tokenizer(texts)["input_ids"]]

    def wait_ready(self) -> None:
        """Blocks until the server answers (once); it started loading when this object was made,
        so it loads while the rest of the run is built."""
        if not self.ready:
            self.server.wait_ready(self.start_timeout_s)
            self.ready = True
            self.sleep()

    def wake(self) -> None:
        if self.sleeps:
            call(self.server.url, "/wake_up", {}, SLEEP_TIMEOUT_S)

    def sleep(self) -> None:
        if self.sleeps:
            call(self.server.url, "/sleep?level=1", {}, SLEEP_TIMEOUT_S)

    def close(self) -> None:
        self.server.stop()
