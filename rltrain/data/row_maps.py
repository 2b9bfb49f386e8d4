"""Row functions for `data.map_fn` that the recipes use (conf/experiment/); each takes one row and
returns the columns to set. docs/models-and-data.md shows how to write your own.
"""

from __future__ import annotations

# verl's and TRL's GSM8K examples ask for the answer in the dataset's own format, after "####",
# which rltrain.rewards.math:accuracy reads as the final answer of a completion too.
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_prompt(row: dict) -> dict:
    """The question (`prompt`, e.g. `data.columns.prompt=question`) as the user's turn of a chat,
    with the instruction on the answer's format: an Instruct model answers through its template."""
    return {"prompt": [{"role": "user", "content": f"{row['prompt']} {GSM8K_INSTRUCTION}"}]}
