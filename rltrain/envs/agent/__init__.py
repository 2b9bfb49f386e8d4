"""`env=agent`: the user's agent, unchanged, against an OpenAI-compatible endpoint in the rank.
`runner` (the trainer's side: episodes in call workers, their requests served with the rollout
engine, the step's results), `endpoint` (the HTTP endpoint), `record` (every token served, as
training sequences), `reply` (between chat messages and the model's tokens) and `episode` (the
worker's side: one episode of the agent). docs/agents.md.
"""
