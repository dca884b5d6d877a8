"""The testbed's warm start: the smoke SFT recipe (format only: mutated baseline specs, no execution, no answers), so
the small policy writes valid multi-agent specs before CF-GRPO starts.

Why: the base SmolLM2-135M writes planner-only specs; in the simulated world a spec without a solver never succeeds, so
every sample of every group has expected reward 0 and there is no gradient at all (LOG.md, 2026-12-01). The corpus
is built from seeded TRAIN-pool questions (lemon.train.pipeline.training_examples, seed 0) and never executed, so
nothing about the world's optimum (capacities, verifiers, duties) is taught: only the YAML format and a spread of team
shapes.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from lemon.prompts import Prompts
from lemon.testbed.experiment import train_config
from lemon.train.config import sft_preset
from lemon.train.pipeline import warm_start


def warm_start_adapter(exp, world, prompts: Prompts, out_dir: Path, *, progress: bool = True) -> Path:
    """Build (or reuse: lemon.train.pipeline.warm_start skips a folder with sft.json) the format SFT adapter for `exp`
    in out_dir and return out_dir. Same recipe for every profile: sft_preset('smoke') at the profile's max_agents."""
    # arm and seed only change CF fields and the training seed; the corpus is drawn with seed 0 whatever the run seeds
    # are
    cfg = train_config(exp.arms[0], 0, replace(exp, init_adapter=None), world)
    sft = sft_preset("smoke", max_agents=cfg.max_agents)
    pool = world.pool()  # the smoke recipe executes nothing; warm_start still takes the pool it would use
    try:
        warm_start(cfg, sft, Path(out_dir), prompts, pool=pool, progress=progress)
    finally:
        pool.close()
    return Path(out_dir)
