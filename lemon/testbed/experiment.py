"""The testbed comparison (issue 13): CF-GRPO vs global GRPO (lambda = 0) vs each single edit family, several seeds, the
same budget, on a SIMULATED world (lemon.testbed.world) whose optimum is known, so every sampled spec has an exact
expected reward and regret.

Layout of an experiment folder:  <root>/experiment.json (config, world, optimum per type)
                                  <root>/<arm>/seed-<s>/ (the trainer's run folder + run.json + heldout.jsonl)
The one call into the trainer is `run_arm`. Everything after it reads files: the trainer's `rollouts.jsonl` (one row per
sampled spec: step, example_id, text, valid, reward, family, delta, ...), re-scored here from the TEXT with the world's
exact expected reward, and `heldout.jsonl` (greedy specs on held-out questions every `eval_every` steps). The statistics
over those samples live in lemon.testbed.stats, so the aggregation is testable on hand-written files
(tests/test_testbed.py).
"""
from __future__ import annotations

import fcntl
import json
import os
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

import pandas as pd

from lemon.benchmarks import get_benchmark
from lemon.eval.orchestrator import orchestrator_messages
from lemon.policy import model as policy_model  # policy_model.cached_random_policy: tests patch it there
from lemon.policy.model import PolicyConfig, load_policy
from lemon.policy.rollout import GrammarConstraint, sample_specs
from lemon.prompts import Prompts
from lemon.run.executor import ExecutorCaps
from lemon.testbed.exact import exact_scorer_factory
from lemon.testbed.sim import SimConfig
from lemon.testbed.vocab import small_tokenizer_dir
from lemon.testbed.world import SimWorld, duty_world, edge_world, mixed_world, multi_world, tiny_world, two_type_world
from lemon.train.config import train_preset
from lemon.train.edits import FAMILIES
from lemon.train.pipeline import checkpoint_step, checkpoints, train
from lemon.train.rewards import RewardConfig

ARMS: Mapping[str, dict] = {"cf": {"cf_lambda": 1.0, "cf_families": FAMILIES}, "global": {"cf_lambda": 0.0},
                            "global-2x": {"cf_lambda": 0.0},
                            # cf with the contrast baselined per family (lemon.train.cf.baselined_deltas): an extension
                            "cf-base": {"cf_lambda": 1.0, "cf_families": FAMILIES, "cf_baseline": "family"},
                            **{f: {"cf_lambda": 1.0, "cf_families": (f,)} for f in FAMILIES}}
# global GRPO at EQUAL EXECUTIONS: cf runs G rollouts + G edits per question, so this arm samples 2G rollouts per
# question (the same questions per step; group size and batch doubled after every override)
GROUP_FACTOR: Mapping[str, int] = {"global-2x": 2}
# world name -> builder: which spec field carries the reward (lemon.testbed.world; issue 30)
#   tiny: capacity (one hard type);  duty: role / duty at equal capacity;  edge: a verifier reading the solver;
#   mixed: two types whose best workers differ (only a policy that reads the question is optimal);  two: easy + hard;
#   multi: several fields each pay a little (capacity, a note, a checker, both duties)
WORLD_BUILDERS = {"two": two_type_world, "tiny": tiny_world, "duty": duty_world, "edge": edge_world,
                  "mixed": mixed_world, "multi": multi_world}
WORLDS = tuple(WORLD_BUILDERS)
SCORINGS = ("exact", "sampled")
BASES = ("preset", "random-tiny", "random-tiny-bpe")
# the random-tiny base's LoRA (rank 8 on a 64-wide model) and fp32 weights, as the CI learning test trains it
RANDOM_TINY = {"backend": "transformers", "lora_r": 8, "lora_alpha": 16, "dtype": "fp32"}


@dataclass(frozen=True)
class ExperimentConfig:
    """One comparison: which world, arms and seeds, and the budget every run gets."""

    world: str = "two"
    """A key of WORLD_BUILDERS: 'two' (MultiArith easy + GSM8K hard), 'tiny' (GSM8K, capacity pays), 'duty', 'edge',
    'mixed'."""
    arms: tuple[str, ...] = tuple(ARMS)
    """Training arms (keys of ARMS)."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Training seeds per arm (>= 3 for the issue's comparison)."""
    profile: str = "cpu"
    """Trainer preset (lemon.train.config.train_preset): policy, batch shape, token caps."""
    max_steps: int = 30
    """Optimisation steps of every run (the same budget for every arm)."""
    train_questions: int = 64
    """Training questions, the same for every arm and seed (stratified over task types)."""
    heldout_questions: int = 16
    """Held-out questions for the greedy evaluation (disjoint from the training ones)."""
    eval_every: int = 5
    """Greedy held-out evaluation every this many steps (= the trainer's checkpoint interval)."""
    data_seed: int = 0
    """Seeds the choice of training and held-out questions."""
    threshold: float = 0.25
    """Regret threshold for steps-to-threshold (smoothed per-step mean regret of the policy's samples)."""
    smooth: int = 3
    """Window (steps) of the running mean used for steps-to-threshold."""
    final_window: int = 5
    """Final regret = mean regret of the samples of the last this many steps."""
    init_adapter: str | None = None
    """LoRA to start every run from (e.g. an SFT warm start); None = the base policy with fresh adapters."""
    train_overrides: Mapping = field(default_factory=dict)
    """Further TrainConfig fields for every run (e.g. {"num_generations": 8})."""
    base: str = "preset"
    """The policy every run starts from: 'preset' (the trainer profile's policy, e.g. SmolLM2-135M for 'smoke') or
    'random-tiny' (a random 2-layer Qwen2 with SmolLM2's tokenizer, lemon.policy.model.cached_random_policy, drawn from
    the TRAINING seed: each seed is an independent policy, shared by every arm of that seed, so arms stay paired; ~10 s
    a step on 2 cores, which is what makes >= 10 seeds per arm and world affordable) or 'random-tiny-bpe' (the same draw
    on the testbed's own 2,048-token BPE, lemon.testbed.vocab: every vocabulary-sized operation ~20x cheaper)."""
    scoring: str = "exact"
    """'exact': rollouts and edits rewarded with their exact expected reward (lemon.testbed.exact, no outcome noise);
    'sampled': executed on the simulated pool, one sampled outcome each (the real trainer's noise)."""

    def __post_init__(self):
        if self.scoring not in SCORINGS:
            raise ValueError(f"scoring={self.scoring!r}; valid: {', '.join(SCORINGS)}")
        if self.base not in BASES:
            raise ValueError(f"base={self.base!r}; valid: {', '.join(BASES)}")
        if self.base.startswith("random-tiny") and self.init_adapter:
            raise ValueError("base='random-tiny' draws a new policy per seed: an init_adapter trained for another base "
                             "cannot start it")
        if self.world not in WORLDS:
            raise ValueError(f"world={self.world!r}; valid: {', '.join(WORLDS)}")
        bad = [a for a in self.arms if a not in ARMS]
        if bad or not self.arms or not self.seeds:
            raise ValueError(f"arms {bad} unknown (valid: {', '.join(ARMS)}), or no arms / seeds given")
        if min(self.max_steps, self.train_questions, self.heldout_questions, self.eval_every, self.smooth,
               self.final_window) < 1:
            raise ValueError("max_steps, train_questions, heldout_questions, eval_every, smooth and final_window "
                             "must be >= 1")


def make_world(name: str, prompts: Prompts) -> SimWorld:
    if name not in WORLD_BUILDERS:
        raise ValueError(f"world={name!r}; valid: {', '.join(WORLDS)}")
    return WORLD_BUILDERS[name](prompts)


def world_of_record(rec: dict, prompts: Prompts) -> SimWorld:
    """The world an experiment.json was run in: its named world, or, when the record's SimConfig differs from what that
    name builds today (a record written before a change of the sim, e.g. the duty rule), that recorded config, so its
    rollouts re-score as they scored when trained."""
    world = make_world(rec["config"]["world"], prompts)
    recorded = rec.get("world", {}).get("config")
    if recorded is None or SimConfig.from_dict(recorded) == world.config:
        return world
    return SimWorld(SimConfig.from_dict(recorded), prompts)


def split_examples(world: SimWorld, n_train: int, n_heldout: int, seed: int) -> tuple[list, list]:
    """Disjoint (train, held-out) examples, each balanced over the world's task types (round-robin), seeded."""
    rng = random.Random(f"testbed-split/{seed}")
    by_type = {t: sorted((e for e in world.examples() if world.type_of(e) == t), key=lambda e: e.id)
               for t in world.config.types}
    for v in by_type.values():
        rng.shuffle(v)
    order = [e for group in zip(*by_type.values()) for e in group]  # t1, t2, t1, t2, ... (up to the smallest type)
    if len(order) < n_train + n_heldout:
        raise ValueError(f"the world has only {len(order)} balanced examples for {n_train} + {n_heldout}")
    return order[:n_train], order[n_train:n_train + n_heldout]


def train_config(arm: str, seed: int, exp: ExperimentConfig, world: SimWorld):
    """The TrainConfig of one run: the preset, the arm's CF settings, the seed, the budget. Sized to the sim like
    lemon.train.config.size_budgets sizes real workers: reply caps at least the sim's reply lengths, task budget at
    least and efficiency budget exactly the nominal tokens of the most expensive allowed spec (lemon.testbed.world)."""
    from dataclasses import replace
    over = {"max_steps": exp.max_steps, "save_steps": exp.eval_every, "seed": seed,
            "train_questions": exp.train_questions, "benchmarks": tuple(world.config.benchmark_type), **ARMS[arm],
            **dict(exp.train_overrides)}
    if exp.base == "random-tiny":
        over["policy"] = PolicyConfig(model=str(policy_model.cached_random_policy(seed)), **RANDOM_TINY)
    elif exp.base == "random-tiny-bpe":
        # the same random draw shape on the testbed's 2,048-token BPE (lemon.testbed.vocab)
        over["policy"] = PolicyConfig(
            model=str(policy_model.cached_random_policy(seed, tokenizer_dir=small_tokenizer_dir())), **RANDOM_TINY)
    cfg = train_preset(exp.profile, **over)
    k = GROUP_FACTOR.get(arm, 1)
    if k > 1:
        cfg = replace(cfg, num_generations=k * cfg.num_generations, batch_size=k * cfg.batch_size,
                      micro_batch=k * cfg.micro_batch)
    worst = world.worst_tokens(cfg.max_agents)
    caps = {c: max(int(cfg.worker_max_tokens.get(c, 0)), n) for c, n in world.worker_max_tokens().items()}
    # a fresh sim draw per step: with one fixed worker seed a spec would get the same lucky (or unlucky) outcome at
    # every step and the policy could learn the draw instead of the expected reward
    fitted = {"worker_max_tokens": caps, "task_token_budget": max(cfg.task_token_budget, worst),
              "worker_seed_per_step": dict(exp.train_overrides).get("worker_seed_per_step", True)}
    if "reward" not in exp.train_overrides:
        fitted["reward"] = replace(cfg.reward, token_budget=worst)
    return replace(cfg, **fitted)


def run_caps(cfg) -> ExecutorCaps:
    """The executor caps the trainer uses for this config (lemon.train.pipeline builds the same)."""
    return ExecutorCaps(max_agents=cfg.max_agents, max_tokens=dict(cfg.worker_max_tokens),
                        task_token_budget=cfg.task_token_budget)


def run_arm(arm: str, seed: int, out_dir: Path, world: SimWorld, exp: ExperimentConfig, prompts: Prompts, *,
            progress: bool = True) -> dict:
    """Train one (arm, seed) into out_dir (resumable). THE one call into the trainer; run.json records what scoring
    needs."""
    cfg = train_config(arm, seed, exp, world)
    train_ex, _ = split_examples(world, exp.train_questions, exp.heldout_questions, exp.data_seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_run_info(out_dir, arm, seed, cfg.reward, cfg.max_agents, run_caps(cfg), exp.scoring)
    pool = world.pool()  # 'exact' makes no worker call; the pool still describes the workers in the manifest
    factory = exact_scorer_factory(world) if exp.scoring == "exact" else None
    try:
        return train(cfg, out_dir, prompts, pool=pool, init_adapter=exp.init_adapter, examples=train_ex,
                     progress=progress, scorer_factory=factory)
    finally:
        pool.close()


def write_run_info(run_dir: Path, arm: str, seed: int, reward: RewardConfig, max_agents: int, caps: ExecutorCaps,
                   scoring: str = "sampled") -> None:
    info = {"arm": arm, "seed": seed, "scoring": scoring, "reward": asdict(reward), "max_agents": max_agents,
            "caps": {"max_agents": caps.max_agents, "max_tokens": dict(caps.max_tokens),
                     "task_token_budget": caps.task_token_budget, "max_context_chars": caps.max_context_chars}}
    (Path(run_dir) / "run.json").write_text(json.dumps(info, indent=1))


def read_run_info(run_dir: Path) -> tuple[dict, RewardConfig, int, ExecutorCaps]:
    info = json.loads((Path(run_dir) / "run.json").read_text())
    return info, RewardConfig(**info["reward"]), info["max_agents"], ExecutorCaps(**info["caps"])


def read_text(path: Path) -> str | None:
    """A file's text, or its gzipped copy's (`<path>.gz`, as outputs/reference/ keeps large records); None if
    neither."""
    path, gz = Path(path), Path(str(path) + ".gz")
    if path.exists():
        return path.read_text()
    if gz.exists():
        import gzip
        return gzip.decompress(gz.read_bytes()).decode()
    return None


def read_jsonl(path: Path) -> list[dict]:
    text = read_text(path)
    return [json.loads(line) for line in text.splitlines() if line.strip()] if text else []


def score_rows(rows: list[dict], world: SimWorld, run_dir: Path) -> pd.DataFrame:
    """Rows with `text` and `example_id` (rollouts.jsonl / heldout.jsonl) + exact expected_reward, regret, type."""
    if not rows:
        return pd.DataFrame(columns=["arm", "seed", "step", "example_id", "type", "valid", "expected_reward", "regret",
                                     "reward"])
    info, reward, max_agents, caps = read_run_info(run_dir)
    scores = world.score_texts([r["text"] for r in rows], [r["example_id"] for r in rows], reward, max_agents, caps)
    return pd.DataFrame([{"arm": info["arm"], "seed": info["seed"], "step": int(r["step"]),
                          "example_id": r["example_id"], "type": world.type_of(world.example(r["example_id"])),
                          "valid": s.valid, "expected_reward": s.expected_reward, "regret": s.regret,
                          "reward": r.get("reward"), **_shape(s.spec)} for r, s in zip(rows, scores)])


def _shape(spec) -> dict:
    """What a spec looks like (for 'what did the policy learn'): agents, share of large agents, the final agent's base
    role and capacity; NaN / None for an invalid text (spec None: TextScore.spec as world.score_texts parsed it)."""
    if spec is None:
        return {"agents": float("nan"), "large_share": float("nan"), "final_role": None, "final_capacity": None}
    fin = spec.agent(spec.final)
    return {"agents": float(len(spec.agents)),
            "large_share": sum(a.capacity == "large" for a in spec.agents) / len(spec.agents),
            "final_role": fin.base_role, "final_capacity": fin.capacity}


def run_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in Path(root).glob("*/seed-*/run.json"))


def collect(root: Path, world: SimWorld, which: str = "rollouts") -> pd.DataFrame:
    """Every scored sample of every run under root: which='rollouts' (training samples) or 'heldout' (greedy eval)."""
    # rollouts.jsonl also logs the groups that dynamic sampling discarded (kept=false): they were not trained on
    frames = [score_rows([r for r in read_jsonl(d / f"{which}.jsonl") if r.get("kept", True)], world, d)
              for d in run_dirs(root)]
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else score_rows([], world, Path(root))


# ---- held-out greedy evaluation and the experiment record -----------------------------------------------------------
def eval_points(run_dir: Path, exp: ExperimentConfig) -> list[tuple[int, str | None]]:
    """(step, adapter) to evaluate: step 0 = the starting adapter, then every checkpoint, then the final adapter."""
    run_dir = Path(run_dir)
    pts = {0: exp.init_adapter}
    for p in (run_dir / "grpo").glob("checkpoint-*"):
        pts[checkpoint_step(p)] = str(p)
    if (run_dir / "train.json").exists() and (run_dir / "adapter").exists():
        pts.setdefault(int(json.loads((run_dir / "train.json").read_text())["steps"]), str(run_dir / "adapter"))
    return sorted(pts.items())


def evaluate_heldout(run_dir: Path, world: SimWorld, exp: ExperimentConfig, prompts: Prompts, cfg, *,
                     prune: bool = False) -> int:
    """Greedy specs (the training grammar when constrained) of each eval point's policy on the held-out questions,
    appended to run_dir/heldout.jsonl ({step, example_id, text}); points already there are skipped.
    Returns rows written.
    prune=True deletes each evaluated checkpoint except the latest (which a resume needs): 0.5B LoRA checkpoints with
    optimizer state are tens of MB each, times steps / eval_every, times arms x seeds."""
    import gc
    import shutil

    run_dir = Path(run_dir)
    _, heldout = split_examples(world, exp.train_questions, exp.heldout_questions, exp.data_seed)
    domains = [get_benchmark(e.benchmark).domain for e in heldout]
    msgs = [orchestrator_messages(e.question, d, prompts, cfg.max_agents) for e, d in zip(heldout, domains)]
    constraint = None
    if getattr(cfg, "constrained", False):
        constraint = GrammarConstraint(tuple(cfg.grammar(prompts, d) for d in domains))
    done, written = {r["step"] for r in read_jsonl(run_dir / "heldout.jsonl")}, 0
    for step, adapter in eval_points(run_dir, exp):
        if step in done:
            continue
        model, tok = load_policy(cfg.policy, adapter=adapter)
        samples = sample_specs(model, tok, msgs, n=1, temperature=0.0, max_new_tokens=cfg.max_completion_length, seed=0,
                               constraint=constraint, dtype="model")  # fp32 greedy: held-out scores comparable
        with open(run_dir / "heldout.jsonl", "a") as f:
            for e, s in zip(heldout, samples):
                f.write(json.dumps({"step": step, "example_id": e.id, "text": s.text}) + "\n")
                written += 1
        del model, tok
        gc.collect()
    if prune:
        ckpts = checkpoints(run_dir / "grpo")
        for p in ckpts[:-1]:
            shutil.rmtree(p)
    return written


def optimum_rows(world: SimWorld, reward: RewardConfig, max_agents: int, caps: ExecutorCaps) -> list[dict]:
    """The optimum of each task type (its spec text, expected reward, success probability, tokens)."""
    out = []
    for t in world.config.types:
        ex = next(e for e in world.examples() if world.type_of(e) == t)
        o = world.optimum(ex, reward, max_agents, caps)
        out.append({"type": t, "expected_reward": o.expected_reward, "p_success": o.p_success, "tokens": o.tokens,
                    "agents": len(o.spec.agents), "searched": o.searched, "spec": o.spec.to_yaml()})
    return out


def write_experiment(root: Path, exp: ExperimentConfig, world: SimWorld, reward: RewardConfig, max_agents: int,
                     caps: ExecutorCaps, command: str) -> dict:
    """Write <root>/experiment.json. A folder filled by several invocations (one per arm or seed, so a crash loses one
    run) keeps ONE record: arms and seeds are merged and every command is kept in `commands`, provided everything else
    (world, budget, init adapter, overrides, reward, optimum) is identical; otherwise ValueError, since runs of
    different configs in one folder would be compared as if they were one experiment."""
    rec = {"config": {**asdict(exp), "train_overrides": dict(exp.train_overrides)}, "world": world.describe(),
           "optimum": optimum_rows(world, reward, max_agents, caps), "reward": asdict(reward), "command": command}
    rec = json.loads(json.dumps(rec))  # tuples -> lists, as they read back
    path = Path(root) / "experiment.json"
    Path(root).mkdir(parents=True, exist_ok=True)
    # Two chains may start runs in one folder at once (experiments/mechanisms.sh with one world splits its seeds over
    # both cores): the read-merge-write holds an exclusive lock, and the write is atomic, so neither reads a
    # half-written file.
    with open(Path(root) / ".experiment.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _merge_experiment(path, rec, command)


def _merge_experiment(path: Path, rec: dict, command: str) -> dict:
    if path.exists():
        old = json.loads(path.read_text())
        mine = {k: v for k, v in rec["config"].items() if k not in ("arms", "seeds")}
        theirs = {k: v for k, v in old["config"].items() if k not in ("arms", "seeds")}
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        diff += [k for k in ("world", "optimum", "reward") if old.get(k) != rec[k]]
        if diff:
            raise ValueError(f"{path} records another experiment (differs in {diff}): use a new --out folder")
        rec["config"]["arms"] = old["config"]["arms"] + [a for a in rec["config"]["arms"]
                                                         if a not in old["config"]["arms"]]
        rec["config"]["seeds"] = sorted(set(old["config"]["seeds"]) | set(rec["config"]["seeds"]))
        rec["commands"] = old.get("commands", [old["command"]]) + [command]
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec, indent=1))
    os.replace(tmp, path)
    return rec
