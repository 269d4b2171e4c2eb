"""The commands a user runs: the CLI and what it calls after a compile (explain, verify, consolidate)."""
