"""Context parallelism (`backend.cp`) on the FSDP engine: one sequence's tokens split over cp ranks.

`ulysses` (attention across the split: all-to-all over heads), `split` (a rectangle's slice per
rank, the scores gathered back), `sequence_split` (what the scorer calls). docs/long-sequences.md.
"""
