"""Stage 1 of the paper: SFT warm start on valid specs, built by rejection sampling (paper §3.3: "SFT on valid specs").

Candidates per training question come from (a) the prompted orchestrator (a worker model writing a spec, JSON-schema
constrained where the backend allows) and (b) mutated baseline specs (random topology, capacities and task-flavoured
duties from the prompts file's `duty_variants`). With `filter_by_execution`, every candidate is executed and only specs
that solved their question are kept, the cheapest (fewest nominal worker tokens) first; without it (smoke runs) the
corpus only teaches the format. Targets are always canonical(spec).to_yaml() (lemon.spec.schema.canonical): the exact
language of the spec grammar the trainer samples under (ids a1..an, quoted role and duty, final = the last agent), so
the warm-started policy's format and the constrained rollouts agree.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from lemon.eval.baselines import MULTI_AGENT, baseline_spec
from lemon.run.executor import ExecutorCaps, NodeCache, execute
from lemon.eval.orchestrator import OrchestratorConfig, orchestrator_messages, propose_spec
from lemon.progress import bar as tqdm, text_mode
from lemon.prompts import CAPACITIES, Prompts
from lemon.spec import MAX_AGENTS, Spec, SpecError, parse_spec
from lemon.spec.schema import canonical


@dataclass(frozen=True)
class SFTConfig:
    """Warm-start corpus and LoRA SFT."""

    questions: int | None = None
    """Training questions for the corpus (None = the training config's train_questions)."""
    candidates_per_question: int = 3
    """Mutated baseline specs per question (plus one from the prompted orchestrator when use_orchestrator)."""
    use_orchestrator: bool = False
    """Also ask the prompted orchestrator (pool capacity `orchestrator_capacity`) for a candidate."""
    orchestrator_capacity: str = "large"
    """Which worker writes the orchestrator candidate."""
    filter_by_execution: bool = True
    """Execute candidates and keep only those that solved their question (rejection sampling)."""
    keep_per_question: int = 1
    """How many solving specs to keep per question (cheapest first)."""
    max_agents: int = 4
    """Largest spec in the corpus."""
    epochs: float = 2.0
    """Passes over the corpus."""
    learning_rate: float = 2e-4
    """LoRA learning rate."""
    batch_size: int = 2
    """Sequences per optimisation step."""
    max_length: int = 1536
    """Prompt + spec tokens; longer rows are truncated (and counted)."""
    seed: int = 0
    """Seeds candidate mutation and the trainer."""
    probe_questions: int = 4
    """Training questions on which the policy's greedy valid-spec rate is measured before and after SFT."""
    gradient_checkpointing: bool | None = None
    """Recompute activations in the backward pass, on every backend; None = on with CUDA (a 7B policy at batch 8 x 4096
    tokens needs it beside the workers), off on a CPU."""

    def __post_init__(self):
        if self.candidates_per_question < 0 or self.keep_per_question < 1:
            raise ValueError("candidates_per_question must be >= 0 and keep_per_question >= 1")
        if self.candidates_per_question == 0 and not self.use_orchestrator:
            raise ValueError("no candidate source: set candidates_per_question > 0 or use_orchestrator=True")
        if self.orchestrator_capacity not in CAPACITIES:
            raise ValueError(f"orchestrator_capacity {self.orchestrator_capacity!r}; valid: {', '.join(CAPACITIES)}")
        if not 2 <= self.max_agents <= MAX_AGENTS:
            raise ValueError(f"max_agents must be in 2..{MAX_AGENTS} (multi-agent baselines need at least 2)")


def _topic(question: str, words: int = 8) -> str:
    w = question.split()
    return " ".join(w[:words]).rstrip(",.;:") + (" ..." if len(w) > words else "")


def mutated_baseline(domain: str, question: str, prompts: Prompts, rng: random.Random, max_agents: int = 4) -> Spec:
    """A random fixed topology with random capacities and task-flavoured duties (a plausible, varied spec)."""
    name = rng.choice(("cot",) + MULTI_AGENT)
    lo = 3 if name == "tree" else 2
    n = rng.randint(lo, max(lo, max_agents))
    base = baseline_spec(name, domain, n_agents=n, seed=rng.randrange(10**6), prompts=prompts)
    agents = []
    for a in base.agents:
        variants = prompts.duty_variants.get(a.base_role, ())
        duty = rng.choice(variants).format(topic=_topic(question)) if variants and rng.random() < 0.8 else a.duty
        agents.append(replace(a, duty=duty[:500], capacity=rng.choice(CAPACITIES)))
    spec = Spec(tuple(agents), base.final)
    return parse_spec(spec.to_yaml(), base_roles=prompts.roles_for(domain))


def build_corpus(examples, benchmarks: dict, prompts: Prompts, cfg: SFTConfig, *, pool=None,
                 caps: ExecutorCaps | None = None, cache: NodeCache | None = None,
                 progress: bool = True) -> tuple[list[dict], dict]:
    """Rows {"prompt": messages, "completion": [assistant message], "example_id", "tokens"} and stats
    (candidates, valid, executed, solved, kept, orchestrator_valid)."""
    if (cfg.filter_by_execution or cfg.use_orchestrator) and pool is None:
        raise ValueError("filter_by_execution / use_orchestrator need a worker pool")
    rng = random.Random(cfg.seed)
    caps = caps or ExecutorCaps(max_agents=cfg.max_agents)
    stats = dict.fromkeys(("questions", "candidates", "orchestrator_valid", "executed", "solved", "kept"), 0)
    rows, seen = [], set()
    for ex in tqdm(examples, desc="SFT corpus", disable=not progress):
        bench = benchmarks[ex.benchmark]
        stats["questions"] += 1
        cands = []
        if cfg.use_orchestrator:
            prop = propose_spec(pool, ex.question, bench.domain, prompts,
                                OrchestratorConfig(capacity=cfg.orchestrator_capacity, max_agents=cfg.max_agents),
                                seed=cfg.seed)
            stats["orchestrator_valid"] += prop.spec is not None
            cands += [prop.spec] if prop.spec is not None else []
        cands += [mutated_baseline(bench.domain, ex.question, prompts, rng, cfg.max_agents)
                  for _ in range(cfg.candidates_per_question)]
        cands = [canonical(c) for c in cands]  # execute exactly what the SFT target will say
        stats["candidates"] += len(cands)
        scored = []
        for spec in cands:
            if cfg.filter_by_execution:
                tr = execute(spec, ex, bench, pool, prompts=prompts, cache=cache, caps=caps, seed=cfg.seed)
                stats["executed"] += 1
                if tr.score < 1.0:
                    continue
                stats["solved"] += 1
                scored.append((tr.nominal_tokens, spec))
            else:
                scored.append((0, spec))
        scored.sort(key=lambda t: t[0])  # prefer the cheapest solving spec
        for tokens, spec in scored[:cfg.keep_per_question]:
            text = canonical(spec).to_yaml()
            if (ex.id, text) in seen:
                continue
            seen.add((ex.id, text))
            rows.append({"prompt": orchestrator_messages(ex.question, bench.domain, prompts, cfg.max_agents),
                         "completion": [{"role": "assistant", "content": text}], "example_id": ex.id, "tokens": tokens})
            stats["kept"] += 1
    return rows, stats


def run_sft(model, tokenizer, rows: list[dict], cfg: SFTConfig, out: Path, *, progress: bool = True) -> dict:
    """LoRA SFT with TRL's SFTTrainer on prompt/completion rows (loss on the spec tokens only). Saves the adapter in
    out."""
    import torch
    from datasets import Dataset
    from trl import SFTConfig as TRLSFTConfig, SFTTrainer
    if not rows:
        raise ValueError("empty SFT corpus: no candidate spec solved its question; raise "
                         "candidates_per_question, use more questions, or set filter_by_execution=False to train on "
                         "the format alone")
    cuda = torch.cuda.is_available()
    checkpointing = cuda if cfg.gradient_checkpointing is None else cfg.gradient_checkpointing
    args = TRLSFTConfig(output_dir=str(out / "sft_ckpt"), num_train_epochs=cfg.epochs, learning_rate=cfg.learning_rate,
                        per_device_train_batch_size=cfg.batch_size, max_length=cfg.max_length, logging_steps=1,
                        save_strategy="no", report_to="none", seed=cfg.seed, use_cpu=not cuda, bf16=cuda,
                        gradient_checkpointing=checkpointing, completion_only_loss=True,
                        disable_tqdm=not progress or text_mode())  # headless: TRL's loss log lines only
    ds = Dataset.from_list([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows])
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tokenizer)
    trainer.train()
    trainer.model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"steps": trainer.state.global_step, "history": trainer.state.log_history, "config": asdict(cfg)}


def valid_rate(model, tokenizer, examples, benchmarks: dict, prompts: Prompts, *, max_agents: int = 4,
               max_new_tokens: int = 320, progress: bool = True) -> dict:
    """Greedy-decode one spec per question with the policy; the fraction that parse (reported before/after SFT)."""
    import torch
    ok, codes = 0, {}
    model.eval()
    for ex in tqdm(examples, desc="valid rate", disable=not progress):
        msgs = orchestrator_messages(ex.question, benchmarks[ex.benchmark].domain, prompts, max_agents)
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = {k: v.to(model.device) for k, v in ids.items()}  # a CUDA policy needs its inputs on its device
        with torch.no_grad():
            gen = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
        text = tokenizer.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        try:
            parse_spec(text, base_roles=prompts.roles_for(benchmarks[ex.benchmark].domain), max_agents=max_agents)
            ok += 1
        except SpecError as e:
            codes[e.code] = codes.get(e.code, 0) + 1
    return {"n": len(examples), "valid": ok, "rate": ok / max(1, len(examples)), "errors": codes}
