"""A known-optimum testbed for CF-GRPO: SIMULATED workers with an explicit success and cost model (`sim`), a world
of real train-pool examples with the exact expected reward, optimum and regret of any spec (`world`, `search`), and the
experiment driver and plots that compare training arms on it (`experiment`, `plots`). Only the workers are simulated:
the parser, executor, prompts, edits and trainer are the project's own. `exact` rewards each rollout and edit with its
exact expected reward instead of one simulated outcome (the experiment's default scoring; `scoring="sampled"` runs the
executor); `warm` builds the format SFT warm start every run starts from."""
from lemon.testbed.sim import SimBackend, SimConfig, TaskType  # noqa: F401
from lemon.testbed.world import TINY, TWO_TYPES, SimWorld, tiny_world, two_type_world  # noqa: F401
