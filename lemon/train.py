"""Stage 2 of the paper: CF-GRPO training of the orchestrator, resumable. `train(cfg, out)` is what notebook 02 and
`python -m lemon train` call. Training questions come ONLY from the train pools (lemon.benchmarks.pools)."""
from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

from . import benchmarks as B
from .config import TrainConfig
from .edits import FamilySampler
from .executor import ExecutorCaps, NodeCache
from .manifest import build_manifest, write_json
from .orchestrator import orchestrator_messages
from .policy import load_policy, resolve_backend
from .prompts import Prompts


def training_examples(cfg: TrainConfig) -> list:
    """A seeded sample of `train_questions` examples from the train pools of `cfg.benchmarks`, round-robin over benchmarks."""
    pools = {b: B.pool(b, "train") for b in cfg.benchmarks}
    rng = random.Random(cfg.seed)
    for p in pools.values():
        rng.shuffle(p)
    out, i = [], 0
    while len(out) < cfg.train_questions and any(pools.values()):
        b = cfg.benchmarks[i % len(cfg.benchmarks)]
        if pools[b]:
            out.append(pools[b].pop())
        i += 1
    return out


def build_pool(cfg: TrainConfig):
    from .workers import WorkerPool
    if cfg.workers:
        return WorkerPool.from_config({**cfg.workers, "max_tokens": dict(cfg.worker_max_tokens)})
    return WorkerPool.embedded_default(max_tokens=dict(cfg.worker_max_tokens))


def latest_checkpoint(d: Path) -> Path | None:
    cks = sorted(Path(d).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return cks[-1] if cks else None


def train(cfg: TrainConfig, out: Path, prompts: Prompts, *, pool=None, progress: bool = True) -> dict:
    """Train (or resume) into `out`: checkpoints under out/grpo, the final adapter in out/adapter, per-step metrics in
    out/metrics.jsonl, manifest.json. Returns {"steps", "adapter", "history"}."""
    from datasets import Dataset
    from trl import GRPOConfig
    from .grpo import CFGRPOTrainer, CFStateCallback, SpecRewarder, load_cf_state

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    examples = training_examples(cfg)
    domains = {b: B.get_benchmark(b) for b in B.BENCHMARKS}
    rows = [{"prompt": orchestrator_messages(e.question, domains[e.benchmark].domain, prompts, cfg.max_agents),
             "example_id": e.id} for e in examples]
    own_pool = pool is None
    pool = pool or build_pool(cfg)
    if not (out / "manifest.json").exists():
        write_json(out / "manifest.json", build_manifest(cfg.to_dict(), prompts_sha256=prompts.sha256, workers=pool.describe(),
                                                         seeds={"train": cfg.seed},
                                                         extra={"train_ids": [e.id for e in examples],
                                                                "policy_backend": resolve_backend(cfg.policy)}))
    model, tok = load_policy(cfg.policy)
    caps = ExecutorCaps(max_agents=cfg.max_agents, max_tokens=dict(cfg.worker_max_tokens))
    rewarder = SpecRewarder(pool, prompts, {e.id: e for e in examples}, domains, tok, reward=cfg.reward, caps=caps,
                            cache=NodeCache(path=out / "node_cache.jsonl"), sampler=FamilySampler(floor=cfg.family_floor),
                            cf_lambda=cfg.cf_lambda, families=cfg.cf_families, max_agents=cfg.max_agents, seed=cfg.seed)
    funcs, weights = rewarder.functions()
    import torch
    cuda = torch.cuda.is_available()
    args = GRPOConfig(
        output_dir=str(out / "grpo"), max_steps=cfg.max_steps, learning_rate=cfg.learning_rate,
        per_device_train_batch_size=cfg.batch_size, num_generations=cfg.num_generations,
        max_completion_length=cfg.max_completion_length, temperature=cfg.temperature, beta=cfg.beta,
        reward_weights=weights, logging_steps=1, save_strategy="steps", save_steps=cfg.save_steps, report_to="none",
        seed=cfg.seed, use_cpu=not cuda, bf16=cuda, gradient_checkpointing=False, disable_tqdm=not progress,
        log_completions=False)
    trainer = CFGRPOTrainer(model=model, processing_class=tok, reward_funcs=funcs, args=args,
                            train_dataset=Dataset.from_list(rows), rewarder=rewarder)
    trainer.add_callback(CFStateCallback(rewarder, out / "metrics.jsonl"))
    ckpt = latest_checkpoint(out / "grpo")
    if ckpt is not None:
        load_cf_state(rewarder, ckpt)
    try:
        trainer.train(resume_from_checkpoint=str(ckpt) if ckpt else None)
    finally:
        if own_pool:
            pool.close()
    trainer.model.save_pretrained(out / "adapter")
    tok.save_pretrained(out / "adapter")
    (out / "cf_sampler.json").write_text(json.dumps(rewarder.sampler.state_dict()))
    return {"steps": trainer.state.global_step, "adapter": str(out / "adapter"), "history": trainer.state.log_history,
            "config": asdict(cfg)}
