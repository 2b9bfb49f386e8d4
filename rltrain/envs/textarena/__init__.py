"""`env=textarena`: TextArena's games as multi-turn episodes (docs/environments.md, "TextArena")."""
