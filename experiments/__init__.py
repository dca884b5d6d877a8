"""Experiment drivers and their library code: the runs behind outputs/reference/ that are not part of the product
(bench/ only prints measured figures). Run from the repository root: `python -m experiments.duel ...`,
`python experiments/testbed_run.py ...`, `bash experiments/cf_seeds.sh ...`. They import lemon; lemon never imports
them."""
