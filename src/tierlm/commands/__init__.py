"""What the `tierlm` command runs: `arguments` (every subcommand's options), `cli` (the commands), `speedrun`,
`ablate`, `chat`, `serve`, `push`, `evaluate` (pass@k), `harness` (lm-evaluation-harness) and `probe` (a
command's measured peak memory)."""
