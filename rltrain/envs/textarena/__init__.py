"""`env=textarena`: TextArena's games as multi-turn episodes (docs/environments.md, "TextArena").
game_check.py (before the run), steps.py (the trainer's side), host.py (the games, in call workers),
opponents.py (a fixed opponent: scripted, or an OpenAI-compatible URL)."""
