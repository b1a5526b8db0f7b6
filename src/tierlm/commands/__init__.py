"""What the `tierlm` command runs: `cli` (every subcommand), `speedrun`, `ablate`, `chat`, `serve`, `push`,
`evaluate` (pass@k), `harness` (lm-evaluation-harness) and `probe` (a command's measured peak memory)."""
