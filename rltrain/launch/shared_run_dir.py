"""Under torchrun, every rank of every node must use one run directory, on storage they all see.

Each torchrun process composes its own Hydra run directory (the default one carries the time its
node started), so rank 0 decides: it writes a token file into its run directory and broadcasts
the directory and the token; every rank then reads the token back from that path. Every rank
writes into the run directory (its checkpoint shard and RNG state, its heartbeat, its user-error
report), and rank 0 reads what the others wrote (to complete a checkpoint, to judge the ranks'
health), so a rank that cannot see rank 0's file would silently split checkpoints across
machines and make them unresumable. That is refused at start, on every rank, with one paragraph.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import torch

from rltrain.runtime.distributed import DistInfo, all_reduce_sum, broadcast_str, control_tensor
from rltrain.runtime.errors import UserError

TOKEN_FILE = ".rank0_token"


def agree_on_run_dir(own_dir: Path, dist_info: DistInfo) -> Path:
    """Rank 0's run directory, checked to be the same directory on every rank (a UserError on
    every rank naming the ranks that cannot see it)."""
    token = uuid.uuid4().hex
    if dist_info.is_main:
        own_dir.mkdir(parents=True, exist_ok=True)
        tmp = own_dir / f"{TOKEN_FILE}.tmp"
        tmp.write_text(token)
        tmp.replace(own_dir / TOKEN_FILE)
    run_dir_text, token = broadcast_str(f"{own_dir}\n{token}" if dist_info.is_main else None).split("\n")
    run_dir = Path(run_dir_text)
    blind = control_tensor([0] * dist_info.world_size, torch.long)
    blind[dist_info.rank] = int(not _sees(run_dir / TOKEN_FILE, token))
    blind_ranks = all_reduce_sum(blind).nonzero().flatten().tolist()
    if blind_ranks:
        raise UserError(
            f"rank(s) {', '.join(map(str, blind_ranks))} cannot see the run directory {run_dir} that rank 0 uses "
            f"(the file {TOKEN_FILE} it wrote there is missing or different): every rank writes its checkpoint "
            "shard, heartbeat and error report there. Put the run directory on storage every node mounts at the "
            "same path (NFS, Lustre, ...) and pass the same hydra.run.dir=/shared/path to every node's torchrun."
        )
    return run_dir


def _sees(path: Path, token: str) -> bool:
    try:
        return path.read_text() == token
    except OSError:
        return False
