"""A megatron-core GPTModel whose last stage returns its final hidden states, not logits.

Why: megatron's own post-processing runs the vocab-parallel output layer over every position of
the padded `[B, T]` rectangle (prompts and padding included) and keeps `[B, T, V/tp]` logits.
The engine scores only completion tokens, so it takes the hidden states (after the final norm,
`[B, T, H]`) and applies the output layer itself, to the positions that predict completion tokens
only, chunked when large (`logprobs.head_logps`). Parameters and their names do not change.
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel


class HiddenStatesGPTModel(GPTModel):
    def _postprocess(self, hidden_states, *args, **kwargs):
        """`[T, B, H]` out of the decoder (final norm applied on the last stage) -> `[B, T, H]` on
        the last stage; earlier stages return the decoder's output unchanged, as GPTModel does."""
        if not self.post_process:
            return hidden_states
        if self.config.mtp_num_layers is not None:
            raise ValueError("multi-token prediction layers are not supported by this backend")
        return hidden_states.transpose(0, 1)
