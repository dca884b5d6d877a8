"""Stage 2 of the paper: CF-GRPO training of the orchestrator, resumable. `train(cfg, out)` is what notebook 02 and
`python -m lemon train` call. Training questions come ONLY from the train pools (lemon.benchmarks.pools)."""
from __future__ import annotations

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

from lemon import benchmarks as B
from lemon.train.config import TrainConfig
from lemon.train.edits import FamilySampler
from lemon.run.executor import ExecutorCaps, NodeCache
from lemon.manifest import build_manifest, write_json
from lemon.eval.orchestrator import orchestrator_messages
from lemon.policy.dtype import cpu_bf16_native, resolve_sample_dtype
from lemon.policy.model import load_policy, resolve_backend
from lemon.progress import text_mode
from lemon.prompts import Prompts
from lemon.run.servers import ServerConfig
from lemon.run.workers import SERVER_BACKENDS, WorkerPool
from lemon.spec.grammar import GrammarCache
from lemon.train.scoring import SpecScorer
from lemon.train.sft import SFTConfig, build_corpus, run_sft, valid_rate


def training_examples(cfg: TrainConfig) -> list:
    """A seeded sample of `train_questions` examples from the train pools of `cfg.benchmarks`, round-robin over
    benchmarks."""
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
    if not cfg.workers:
        return WorkerPool.embedded_default(max_tokens=dict(cfg.worker_max_tokens),
                                           server=ServerConfig(deterministic=cfg.deterministic_workers))
    workers = dict(cfg.workers)
    if cfg.deterministic_workers:
        other = sorted(c for c, e in workers.items() if e.get("backend") not in SERVER_BACKENDS)
        if other:
            raise ValueError(f"deterministic_workers=True applies to llama-server workers, but {other} use "
                             "other backends (for vLLM, batch-invariant decoding is the server's own setting): turn it "
                             "off or change them")
        workers = {c: {**e, "deterministic": True} for c, e in workers.items()}
    return WorkerPool.from_config({**workers, "max_tokens": dict(cfg.worker_max_tokens)})


def checkpoint_step(p: Path) -> int:
    """The step of a TRL checkpoint folder `checkpoint-<step>`."""
    return int(Path(p).name.split("-")[1])


def checkpoints(d: Path) -> list[Path]:
    """The checkpoint folders under d, oldest step first."""
    return sorted(Path(d).glob("checkpoint-*"), key=checkpoint_step)


def latest_checkpoint(d: Path) -> Path | None:
    cks = checkpoints(d)
    return cks[-1] if cks else None


def warm_start(cfg: TrainConfig, sft: SFTConfig, out: Path, prompts: Prompts, *, pool=None, progress: bool = True,
               corpus: list[dict] | None = None) -> dict:
    """Stage 1: SFT warm start into out/ (adapter files + sft.json with corpus stats and valid rate before/after).
    Skipped (its saved record returned) when out/sft.json exists: rerunning a study resumes instead of redoing.
    `corpus`: rows an earlier build_corpus wrote (corpus.jsonl), used instead of building one with the workers (the
    executed corpus is the costly part; SFT on the same rows and seed rebuilds the same adapter)."""
    out = Path(out)
    if (out / "sft.json").exists():
        return json.loads((out / "sft.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    n_sft = sft.questions or cfg.train_questions
    # the valid-rate probe uses further TRAIN-pool questions that are not in the corpus (training_examples is
    # prefix-stable)
    drawn = training_examples(replace(cfg, train_questions=n_sft + sft.probe_questions))
    examples, probe = drawn[:n_sft], drawn[n_sft:]
    benches = {b: B.get_benchmark(b) for b in B.BENCHMARKS}
    own_pool = pool is None and (sft.filter_by_execution or sft.use_orchestrator) and corpus is None
    if own_pool:
        pool = build_pool(cfg)
    try:
        if corpus is not None:
            rows, stats = list(corpus), {"given": len(corpus)}
        elif (out / "corpus.jsonl").exists() and (out / "corpus_stats.json").exists():  # built before an interruption
            rows = [json.loads(x) for x in (out / "corpus.jsonl").read_text().splitlines() if x.strip()]
            stats = json.loads((out / "corpus_stats.json").read_text())
        else:
            rows, stats = build_corpus(examples, benches, prompts, sft, pool=pool,
                                       caps=ExecutorCaps(max_agents=sft.max_agents,
                                                         max_tokens=dict(cfg.worker_max_tokens)),
                                       cache=NodeCache(path=out / "node_cache.jsonl"), progress=progress)
    finally:
        if own_pool:
            pool.close()
    with open(out / "corpus.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    write_json(out / "corpus_stats.json", stats)
    model, tok = load_policy(cfg.policy, seed=sft.seed)  # seeded fresh LoRA: the same corpus rebuilds the same adapter
    before = valid_rate(model, tok, probe, benches, prompts, max_agents=cfg.max_agents,
                        max_new_tokens=cfg.max_completion_length, progress=progress)
    res = run_sft(model, tok, rows, sft, out, progress=progress)
    after = valid_rate(model, tok, probe, benches, prompts, max_agents=cfg.max_agents,
                       max_new_tokens=cfg.max_completion_length, progress=progress)
    rec = {"adapter": str(out), "corpus": stats, "rows": len(rows), "valid_before": before, "valid_after": after,
           "steps": res["steps"], "loss": [h["loss"] for h in res["history"] if "loss" in h], "config": asdict(sft)}
    write_json(out / "sft.json", rec)
    return rec


def train(cfg: TrainConfig, out: Path, prompts: Prompts, *, pool=None, init_adapter: str | Path | None = None,
          examples: list | None = None, progress: bool = True, scorer_factory=None) -> dict:
    """Train (or resume) into `out`: checkpoints under out/grpo, the final adapter in out/adapter, per-step metrics in
    out/metrics.jsonl, every rollout in out/rollouts.jsonl, manifest.json. `init_adapter` (e.g. the SFT warm start) is
    where the LoRA starts; `examples` replaces the seeded train-pool sample (e.g. the testbed's questions; they must
    still come from train pools). `scorer_factory` replaces lemon.train.scoring.SpecScorer (same arguments; e.g. the
    testbed's exact scorer, lemon.testbed.exact). Returns {"steps", "adapter", "history"}; a run finished with this very
    config is returned as is."""
    out = Path(out)
    if (out / "train.json").exists() and (out / "adapter").exists():
        done = json.loads((out / "train.json").read_text())
        if done["config"] == json.loads(json.dumps(asdict(cfg))):
            return done  # finished with this very config: nothing to redo
        # otherwise (e.g. more max_steps) continue from the latest checkpoint below
    out.mkdir(parents=True, exist_ok=True)
    own_pool = pool is None
    pool = pool or build_pool(cfg)
    try:  # whatever fails below (a policy that does not load, a bad config), a pool we started is closed
        return _train(cfg, out, prompts, pool, init_adapter, examples, progress, scorer_factory)
    finally:
        if own_pool:
            pool.close()


def _train(cfg: TrainConfig, out: Path, prompts: Prompts, pool, init_adapter, examples, progress: bool,
           scorer_factory=None) -> dict:
    from datasets import Dataset
    from lemon.train.episodes import SpecRollouts, prompt_key  # lazy: torch
    from lemon.train.grpo import reward_functions, trainer_class  # lazy: torch, transformers, peft

    examples = examples if examples is not None else training_examples(cfg)
    benches = {b: B.get_benchmark(b) for b in B.BENCHMARKS}
    rows = [{"prompt": orchestrator_messages(e.question, benches[e.benchmark].domain, prompts, cfg.max_agents),
             "example_id": e.id} for e in examples]
    backend = resolve_backend(cfg.policy)
    if backend == "unsloth" and cfg.cf_lambda > 0 and (cfg.micro_batch or cfg.batch_size) < cfg.batch_size:
        # refused here, before minutes of loading, rather than at the first step (lemon.train.unsloth_compat says why)
        raise ValueError("the unsloth backend with cf_lambda > 0 needs micro_batch = batch_size "
                         f"({cfg.batch_size}), got micro_batch={cfg.micro_batch}: Unsloth's loss window per "
                         "micro-batch is unknown when the advantages are made. Use micro_batch=0, cf_lambda=0, or "
                         "policy backend 'transformers'.")
    if not (out / "manifest.json").exists():
        write_json(out / "manifest.json",
                   build_manifest(cfg.to_dict(), prompts_sha256=prompts.sha256, workers=pool.describe(),
                                  seeds={"train": cfg.seed},
                                  extra={"train_ids": [e.id for e in examples], "policy_backend": backend,
                                         "scorer": getattr(scorer_factory, "name", "SpecScorer")}))
    model, tok = load_policy(cfg.policy, adapter=init_adapter, seed=cfg.seed)
    caps = ExecutorCaps(max_agents=cfg.max_agents, max_tokens=dict(cfg.worker_max_tokens),
                        task_token_budget=cfg.task_token_budget)
    scorer = (scorer_factory or SpecScorer)(
        pool, prompts, {e.id: e for e in examples}, benches, reward=cfg.reward, caps=caps,
        cache=NodeCache(path=out / "node_cache.jsonl"), sampler=FamilySampler(floor=cfg.family_floor),
        cf_lambda=cfg.cf_lambda, families=cfg.cf_families, max_agents=cfg.max_agents, seed=cfg.seed,
        concurrency=cfg.rollout_concurrency, worker_seed_per_step=cfg.worker_seed_per_step)
    grammars = cache = None
    if cfg.constrained:  # one grammar per domain (its base roles), compiled once per run
        by_domain = {d: cfg.grammar(prompts, d) for d in {benches[e.benchmark].domain for e in examples}}
        grammars, cache = {e.id: by_domain[benches[e.benchmark].domain] for e in examples}, GrammarCache()
    by_prompt = {prompt_key(r["prompt"]): r["example_id"] for r in rows}
    rollouts = SpecRollouts(scorer, tok, by_prompt, num_generations=cfg.num_generations, temperature=cfg.temperature,
                            max_new_tokens=cfg.max_completion_length, grammars=grammars, grammar_cache=cache,
                            resample=cfg.resample,
                            seed=cfg.seed, scale_rewards=cfg.scale_rewards, std_floor=cfg.std_floor,
                            rollouts_path=out / "rollouts.jsonl",
                            sample_dtype=sample_dtype_for(cfg),
                            curriculum_ids=[r["example_id"] for r in rows] if cfg.curriculum or cfg.stratify else None,
                            strata=[e.benchmark for e in examples] if cfg.stratify else None, weighted=cfg.curriculum,
                            mask_forced=cfg.mask_forced_tokens and cfg.constrained, cf_baseline=cfg.cf_baseline)
    funcs, weights = reward_functions(rollouts)
    Trainer = trainer_class(backend)
    args = grpo_args(cfg, out, weights, progress, backend)
    trainer = Trainer(model=model, processing_class=tok, reward_funcs=funcs, args=args,
                      train_dataset=Dataset.from_list(rows), rollouts=rollouts)
    return _fit(trainer, rollouts, cfg, out, tok, init_adapter, args.bf16, progress)


def sample_dtype_for(cfg: TrainConfig) -> str:
    """How rollouts sample, resolved for the device the TRAINER samples on. The policy is still on the CPU when this is
    decided, so resolving against model.device would pick a merged bf16 deep copy of the whole policy per step on a GPU
    host with a native-bf16 CPU. On CUDA the bf16 policy samples as it is."""
    import torch
    return resolve_sample_dtype(cfg.sample_dtype, "cuda" if torch.cuda.is_available() else "cpu")


def grpo_args(cfg: TrainConfig, out: Path, weights, progress: bool, backend: str):
    """TRL's GRPOConfig for this run, of the class `backend`'s trainer expects (lemon.train.grpo.config_class)."""
    import torch
    from lemon.train.grpo import check_trl_cpu, config_class  # lazy: torch, transformers, peft
    GRPOConfig = config_class(backend)
    cuda = torch.cuda.is_available()
    if not cuda:
        check_trl_cpu()
    bf16 = cuda or cfg.train_dtype == "bf16" or (cfg.train_dtype == "auto" and cpu_bf16_native())
    mb = cfg.micro_batch or cfg.batch_size
    return GRPOConfig(
        output_dir=str(out / "grpo"), max_steps=cfg.max_steps, learning_rate=cfg.learning_rate,
        per_device_train_batch_size=mb, gradient_accumulation_steps=cfg.batch_size // mb,
        num_generations=cfg.num_generations, max_completion_length=cfg.max_completion_length,
        temperature=cfg.temperature, beta=cfg.beta, reward_weights=weights, logging_steps=1, save_strategy="steps",
        save_steps=cfg.save_steps, report_to="none", seed=cfg.seed, use_cpu=not cuda,
        # on CPU: fp32 weights, bf16 autocast for the loss forward/backward (2.4x faster on this CPU, LOG.md 2026-12-01)
        bf16=bf16,
        gradient_checkpointing=cfg.gradient_checkpointing,
        disable_tqdm=not progress or text_mode(),  # headless: the callback's step lines
        log_completions=False)


def _fit(trainer, rollouts, cfg: TrainConfig, out: Path, tok, init_adapter, bf16: bool, progress: bool) -> dict:
    """Train (resuming from the latest checkpoint), save the adapter and train.json."""
    from lemon.train.grpo import (CFStateCallback, completion_only_lm_head,  # lazy: torch, transformers, peft
                                  load_cf_state)
    trainer.add_callback(CFStateCallback(rollouts, out / "metrics.jsonl", verbose=progress))
    if text_mode():  # headless: the callback's one line per step replaces the Trainer's dump of every logged key
        from transformers.trainer_callback import PrinterCallback
        trainer.remove_callback(PrinterCallback)
    ckpt = latest_checkpoint(out / "grpo")
    if ckpt is not None:
        load_cf_state(rollouts, ckpt)
    # Rows of steps after the checkpoint (all rows, when a run died before its first checkpoint) are sampled again.
    done_step = checkpoint_step(ckpt) if ckpt is not None else 0
    for name in ("rollouts.jsonl", "metrics.jsonl"):
        _truncate_rows(out / name, done_step)
    with completion_only_lm_head():  # the prompt's positions are not scored on a CPU either (its docstring)
        trainer.train(resume_from_checkpoint=str(ckpt) if ckpt else None)
    trainer.model.save_pretrained(out / "adapter")
    tok.save_pretrained(out / "adapter")
    (out / "cf_sampler.json").write_text(json.dumps(rollouts.state_dict()))
    rec = {"steps": trainer.state.global_step, "adapter": str(out / "adapter"), "history": trainer.state.log_history,
           "config": asdict(cfg), "init_adapter": str(init_adapter) if init_adapter else None,
           "train_bf16_autocast": bf16}
    write_json(out / "train.json", rec)
    return rec


def _truncate_rows(path: Path, step: int) -> None:
    """On resume from checkpoint-<step> (step 0: no checkpoint), drop JSONL rows of later steps (they are redone)."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    path.write_text("".join(line + "\n" for line in keep))
