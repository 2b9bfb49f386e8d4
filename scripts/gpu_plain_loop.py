"""bench_gpu.py's ceiling reference: SFT as a plain PyTorch loop over a transformers model.

No rltrain code trains here: `AutoModelForCausalLM` with fp32 weights, bf16 autocast on CUDA (fp32
on CPU), completion-only NLL summed over each micro-batch and divided by the step's completion
tokens (as rltrain's SFT normalises), backward per micro-batch, clipping at 1.0, AdamW (foreach,
the same settings as the other rows), `zero_grad(set_to_none=True)`. bench_gpu.py hands it the
same micro-batches as rltrain's SFT (the same rows, split the same way), so its tokens/s and MFU
are what the hardware gives this workload without a framework.

Two output heads:
- `full`: the model's own forward, full `[rows, width, vocab]` logits, then `cross_entropy` on
  the completion positions (what a first loop writes).
- `chunked`: the decoder's hidden states (`model.model`), the completion positions only, then the
  output head + cross-entropy one chunk of positions at a time, each chunk under
  `torch.utils.checkpoint` so its logits are recomputed in the backward and the whole
  `[tokens, vocab]` logits never exist at once (a fused linear cross-entropy in plain PyTorch).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Logit elements one chunk may hold (the budget rltrain's own chunked head uses).
CHUNK_ELEMENTS = 1 << 27
HEADS = {"full": "plain loop", "chunked": "plain loop, chunked CE"}

Micro = list[tuple[list[int], list[int]]]  # (prompt ids, completion ids incl. EOS) per row


def _head_ce_sum(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, targets_C: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden_CH, weight_VH).float(), targets_C, reduction="sum")


def chunked_ce_sum(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Summed NLL of `targets_N` under `hidden_NH @ weight_VH.T`, a chunk of positions at a time,
    each chunk's logits recomputed in the backward (never all of them at once)."""
    chunk = max(1, CHUNK_ELEMENTS // weight_VH.shape[0])
    total = hidden_NH.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden_NH.shape[0], chunk):
        total = total + checkpoint(
            _head_ce_sum, hidden_NH[start : start + chunk], weight_VH, targets_N[start : start + chunk],
            use_reentrant=False,
        )
    return total


class PlainLoop:
    """`step(k)` runs optimizer step k over `steps[k]` (a list of micro-batches) -> seconds."""

    def __init__(
        self, model_dir: Path, steps: list[list[Micro]], head: str, device: torch.device, mixed: bool, pad_id: int,
        lr: float,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.head, self.device, self.mixed, self.pad_id = head, device, mixed, pad_id
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
        self.model = model.to(device).train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=True
        )
        self.steps = [[self._tensors(micro) for micro in step] for step in steps]

    def _tensors(self, micro: Micro) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input ids, attention mask, labels: -100 on prompts and padding), right-padded to the
        micro-batch's longest row, already on the device (as TRL's collated batches are)."""
        width = max(len(p) + len(c) for p, c in micro)
        ids_BT = torch.full((len(micro), width), self.pad_id, dtype=torch.long, device="cpu")
        mask_BT = torch.zeros((len(micro), width), dtype=torch.long, device="cpu")
        labels_BT = torch.full((len(micro), width), -100, dtype=torch.long, device="cpu")
        for i, (p, c) in enumerate(micro):
            ids_BT[i, : len(p) + len(c)] = torch.tensor(p + c, device="cpu")
            mask_BT[i, : len(p) + len(c)] = 1
            labels_BT[i, len(p) : len(p) + len(c)] = torch.tensor(c, device="cpu")
        return ids_BT.to(self.device), mask_BT.to(self.device), labels_BT.to(self.device)

    def _nll_sum(self, ids_BT: torch.Tensor, mask_BT: torch.Tensor, labels_BT: torch.Tensor) -> torch.Tensor:
        targets_BT = labels_BT[:, 1:]
        if self.head == "full":
            logits_BTV = self.model(input_ids=ids_BT, attention_mask=mask_BT).logits
            return F.cross_entropy(
                logits_BTV[:, :-1].flatten(0, 1).float(), targets_BT.flatten(), ignore_index=-100, reduction="sum"
            )
        hidden_BTH = self.model.model(input_ids=ids_BT, attention_mask=mask_BT).last_hidden_state
        keep_BT = targets_BT != -100
        return chunked_ce_sum(hidden_BTH[:, :-1][keep_BT], self.model.lm_head.weight, targets_BT[keep_BT])

    def step(self, k: int) -> float:
        micro = self.steps[k]
        completion_tokens = float(sum(int((labels != -100).sum()) for _, _, labels in micro))
        _sync(self.device)
        t0 = time.perf_counter()
        for ids_BT, mask_BT, labels_BT in micro:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.mixed):
                loss = self._nll_sum(ids_BT, mask_BT, labels_BT) / completion_tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _sync(self.device)
        return time.perf_counter() - t0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
