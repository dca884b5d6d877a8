"""The real-worker CF-GRPO vs global-GRPO comparison (issue 13) as session-sized legs: `legs` (what each leg does),
`report` (summary.md and plots from the committed records), `__main__` (the command line:
`python -m experiments.duel`)."""
