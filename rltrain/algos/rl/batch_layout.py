"""Where this rank's prompts and sequences lie in an RL step's global batch (prompt-major order),
and how many micro-batches the rank with the most of them needs: every rank runs that many."""

from __future__ import annotations

from rltrain.data.sharding import rank_slice


class BatchLayout:
    """Where this rank's sequences sit in the global batch. Ranks split *prompts* (contiguous,
    `rank_slice`), each prompt's `group_size` completions stay together: global position
    `prompt * group_size + k`."""

    def __init__(self, prompts_per_step: int, group_size: int, rank: int, world_size: int) -> None:
        self.prompts_per_step, self.group_size = prompts_per_step, group_size
        self.rank, self.world_size = rank, world_size

    @property
    def global_size(self) -> int:
        return self.prompts_per_step * self.group_size

    def prompt_range(self, rank: int) -> tuple[int, int]:
        """Global positions [start, end) of `rank`'s sequences."""
        mine = rank_slice(list(range(self.prompts_per_step)), rank, self.world_size)
        if not mine:
            return 0, 0
        return mine[0] * self.group_size, (mine[-1] + 1) * self.group_size

    @property
    def offset(self) -> int:
        """Global position of this rank's first sequence."""
        return self.prompt_range(self.rank)[0]

    def micro_batches_per_rank(self, lo: int, hi: int, mb_size: int) -> int:
        """How many micro-batches every rank runs over the global positions [lo, hi): enough for
        the rank that holds the most of them (collectives must match). With prompts_per_step not
        a multiple of the rank count one rank holds a whole group more than another, and a count
        derived from an even split of the sequences would drop some."""
        most = 0
        for r in range(self.world_size):
            start, end = self.prompt_range(r)
            most = max(most, min(hi, end) - max(lo, start))
        return max(1, -(-most // mb_size))
