"""What each notebook of the study does (01 data, 02 training, 03 ablations, 04 evaluation); the notebooks call these
and plot. Config, folder layout and the papermill runner are in lemon.study.runner. Everything here resumes from what is
on disk.
"""
from __future__ import annotations

import gc
import json
import random
from dataclasses import replace
from pathlib import Path

from lemon import benchmarks as B
from lemon.eval.baselines import BASELINES
from lemon.eval.served import ServedPolicySpecWriter
from lemon.policy.model import converted_dir, load_policy
from lemon.policy.served import ServedPolicy
from lemon.progress import bar as tqdm
from lemon.spec import SpecError, parse_spec
from lemon.train.edits import FAMILIES, apply_edit, eligible_sites
from lemon.train.pipeline import build_pool, checkpoint_step, checkpoints, train, training_examples, warm_start
from lemon.train.sft import mutated_baseline
from lemon.eval.runner import EvalConfig, read_rows, run_eval
from lemon.run.executor import ExecutorCaps, NodeCache, domain_reply_caps, execute
from lemon.manifest import write_json
from lemon.eval.orchestrator import OrchestratorConfig, PolicySpecWriter
from lemon.study.config import FIXED, ORCHESTRATORS, VARIANTS, StudyConfig, split_method
from lemon.study.runner import StudyPaths, load_samples


# ---- notebook 01: data -----------------------------------------------------------------------------------------------
def prepare_data(cfg: StudyConfig, paths: StudyPaths) -> dict:
    """Write the disjoint pools (ids per benchmark) and the seeded samples under data/; return the stats rows and the
    checks (counts, id and normalized-text overlap between train and eval, samples inside the eval pools). Raises on any
    overlap."""
    train, ev = B.train_pool(cfg.protocol), B.eval_pool(cfg.protocol)
    dropped = B.dropped_counts(cfg.protocol)
    stats, checks = [], {}
    for b in B.BENCHMARKS:
        for which, exs in (("train", train[b]), ("eval", ev[b])):
            lens = sorted(len(e.question) for e in exs)
            stats.append({"benchmark": b, "pool": which, "split": B.POOL_SPLITS[which][b], "n": len(exs),
                          "question_chars_median": lens[len(lens) // 2] if lens else 0,
                          "dropped_for_text_overlap": dropped[b] if which == "train" else 0})
        tid, eid = {e.id for e in train[b]}, {e.id for e in ev[b]}
        ttx = {B.normalize_question(e.question) for e in train[b]}
        etx = {B.normalize_question(e.question) for e in ev[b]}
        checks[b] = {"train": len(train[b]), "eval": len(ev[b]), "id_overlap": len(tid & eid),
                     "text_overlap": len(ttx & etx)}
    all_t = {B.normalize_question(e.question) for x in train.values() for e in x}
    checks["cross_benchmark_text_overlap"] = sum(B.normalize_question(e.question) in all_t
                                                 for x in ev.values() for e in x)
    order = {b: [e.id for e in ev[b]] for b in cfg.benchmarks}  # a seeded order; every sample is a prefix of it
    for ids in order.values():
        random.Random(cfg.seed).shuffle(ids)
    cut = lambda n, bs: {b: order[b][:n] if n is not None else order[b] for b in bs}  # noqa: E731
    samples = {"eval": cut(cfg.eval_n, cfg.benchmarks), "edit": cut(cfg.edit_n, cfg.benchmarks),
               "ablation": cut(cfg.ablation_n, cfg.ablation_benchmarks), "seed": cfg.seed, "protocol": cfg.protocol}
    bad = [b for b in B.BENCHMARKS if checks[b]["id_overlap"] or checks[b]["text_overlap"]]
    if bad:
        raise AssertionError(f"train and eval pools overlap for {bad}: {[checks[b] for b in bad]}")
    paths.data.mkdir(parents=True, exist_ok=True)
    write_json(paths.data / "train_ids.json", {b: [e.id for e in train[b]] for b in B.BENCHMARKS})
    write_json(paths.data / "eval_ids.json", {b: [e.id for e in ev[b]] for b in B.BENCHMARKS})
    write_json(paths.data / "checks.json", checks)
    write_json(paths.data / "stats.json", stats)
    write_json(paths.samples, samples)
    return {"stats": stats, "checks": checks, "samples": samples}


# ---- notebook 02: training -------------------------------------------------------------------------------------------
def warm_start_main(cfg: StudyConfig, paths: StudyPaths, prompts, pool, *, progress: bool = True) -> dict:
    """Stage 1: the SFT warm start into train/sft (resumes), with the training worker pool."""
    return warm_start(cfg.train, cfg.sft, paths.sft, prompts, pool=pool, progress=progress)


def train_main(cfg: StudyConfig, paths: StudyPaths, prompts, *, pool=None, progress: bool = True) -> tuple[dict, dict]:
    """SFT warm start then CF-GRPO (both resume), with one worker pool (`pool`, else one built and closed here); checks
    the training ids lie in 01's train pools."""
    pools = json.loads(paths.require(paths.data / "train_ids.json", "01_prepare_data").read_text())
    own = pool is None
    pool = build_pool(cfg.train) if own else pool
    try:
        sft = warm_start_main(cfg, paths, prompts, pool, progress=progress)
        res = train(cfg.train, paths.grpo, prompts, pool=pool, init_adapter=sft["adapter"], progress=progress)
    finally:
        if own:
            pool.close()
    allowed = {i for ids in pools.values() for i in ids}
    used = json.loads((paths.grpo / "manifest.json").read_text()).get("train_ids", [])
    if set(used) - allowed:
        raise AssertionError(f"training used ids outside notebook 01's train pools: {sorted(set(used) - allowed)[:5]}")
    return sft, res


# ---- notebook 03: ablations ------------------------------------------------------------------------------------------
def edit_effects(cfg: StudyConfig, paths: StudyPaths, prompts, pool, *, progress: bool = True) -> list[dict]:
    """On held-out specs (seeded mutated baselines) for the edit sample of the EVAL pools, apply each edit family at up
    to `edit_sites` eligible sites and execute original and edited spec (node cache shared). One row per edit in
    ablations/edit_effects.jsonl (resumed by key); d_score / d_tokens = edited minus original."""
    samples = load_samples(cfg, paths, "edit")
    paths.edits.parent.mkdir(parents=True, exist_ok=True)
    rows = read_rows(paths.edits)
    done = {r["key"] for r in rows}
    cache = NodeCache(path=paths.edits.with_name("edit_node_cache.jsonl"))
    jobs = [(b, ex, k) for b, exs in samples.items() for ex in exs for k in range(cfg.edit_specs)]
    for b, ex, k in tqdm(jobs, desc="edit effects", disable=not progress):
        bench = B.get_benchmark(b)
        rng = random.Random(f"{cfg.seed}/{ex.id}/{k}")
        spec = mutated_baseline(bench.domain, ex.question, prompts, rng, max_agents=min(cfg.train.max_agents, 4))
        orig = None
        for fam in FAMILIES:
            sites = eligible_sites(spec, fam, prompts)
            for site in rng.sample(sites, min(cfg.edit_sites, len(sites))):
                key = f"{ex.id}|{k}|{fam}|{'>'.join(site)}"
                if key in done:
                    continue
                caps = eval_caps(cfg, b)
                orig = orig or execute(spec, ex, bench, pool, prompts=prompts, cache=cache, caps=caps, seed=cfg.seed)
                e = apply_edit(spec, fam, site, prompts)
                tr = execute(e.spec, ex, bench, pool, prompts=prompts, cache=cache, caps=caps, seed=cfg.seed)
                row = {"key": key, "id": ex.id, "benchmark": b, "split": ex.split, "spec_index": k, "family": fam,
                       "site": list(site), "agents": len(spec.agents), "score_orig": orig.score, "score_edit": tr.score,
                       "tokens_orig": orig.nominal_tokens, "tokens_edit": tr.nominal_tokens,
                       "d_score": tr.score - orig.score, "d_tokens": tr.nominal_tokens - orig.nominal_tokens,
                       "spec": spec.text, "edited_spec": e.text}
                with open(paths.edits, "a") as f:
                    f.write(json.dumps(row) + "\n")
                rows.append(row)
    return rows


def train_variant(cfg: StudyConfig, paths: StudyPaths, name: str, prompts, pool, *, progress: bool = True) -> Path:
    """Train (or resume) one ablation variant from notebook 02's SFT warm start; returns its adapter folder.
    'sft' is the warm start itself; 'full' at the main run's step count is notebook 02's run (not retrained)."""
    sft = json.loads(paths.require(paths.sft / "sft.json", "02_train_grpo_lora").read_text())
    if name == "sft":
        return Path(sft["adapter"])
    if cfg.is_main_run(name):
        return Path(paths.require(paths.grpo / "adapter", "02_train_grpo_lora"))
    vcfg = replace(cfg.train, max_steps=cfg.ablation_steps, save_steps=min(cfg.train.save_steps, cfg.ablation_steps),
                   **VARIANTS[name])
    return Path(train(vcfg, paths.variant(name), prompts, pool=pool, init_adapter=sft["adapter"],
                      progress=progress)["adapter"])


def run_ablation(cfg: StudyConfig, paths: StudyPaths, prompts, pool, *, progress: bool = True) -> dict[str, Path]:
    """Train each variant (resumes) and evaluate its adapter on the ablation sample into
    ablations/variants/<name>/eval."""
    samples = load_samples(cfg, paths, "ablation")
    adapters = {}
    for name in cfg.ablation_variants:
        adapters[name] = train_variant(cfg, paths, name, prompts, pool, progress=progress)
        gc.collect()
        evaluate(cfg, paths, name, samples, pool, prompts, adapter=adapters[name], progress=progress,
                 out_of=lambda b, n=name: paths.variant_eval_dir(n, b))
    return adapters


def dev_examples(cfg: StudyConfig) -> dict[str, list]:
    """{benchmark: [Example]}: dev_n held-out TRAIN-pool questions per training benchmark, the ones that follow the
    training questions in lemon.train.pipeline.training_examples' seeded order (so no run trains on them)."""
    n = cfg.train.train_questions
    extra = training_examples(replace(cfg.train, train_questions=n + cfg.dev_n * len(cfg.train.benchmarks)))[n:]
    return {b: [e for e in extra if e.benchmark == b] for b in cfg.train.benchmarks}


def dev_curves(cfg: StudyConfig, paths: StudyPaths, prompts, pool, *, progress: bool = True) -> list[dict]:
    """Notebook 03 (cfg.dev_n > 0): the main run and each trained variant, evaluated at step 0 (the SFT adapter), every
    dev_every steps and at the end on the dev set (dev/<run>/step-<k>/<benchmark>, resumable). One row per (run, step):
    accuracy, n, mean worker tokens."""
    if not cfg.dev_n:
        return []
    sft = json.loads(paths.require(paths.sft / "sft.json", "02_train_grpo_lora").read_text())["adapter"]
    runs = {"lemon": paths.grpo, **{v: paths.variant(v) for v in cfg.ablation_variants  # the runs trained here
                                    if v != "sft" and not cfg.is_main_run(v)}}
    dev, rows = dev_examples(cfg), []
    for name, run in runs.items():
        final = json.loads(paths.require(run / "train.json", "03_ablations").read_text())["steps"]
        points = {0: Path(sft), final: run / "adapter"}
        points.update({checkpoint_step(c): c for c in checkpoints(run / "grpo")
                       if checkpoint_step(c) % cfg.dev_every == 0 and checkpoint_step(c) < final})
        for step, adapter in sorted(points.items()):
            sums = evaluate(cfg, paths, f"{name}-dev", dev, pool, prompts, adapter=adapter, progress=progress,
                            out_of=lambda b, name=name, step=step: paths.root / "dev" / name / f"step-{step}" / b,
                            pool_kind="train")
            rows.append({"run": name, "step": step, **pooled(sums)})
    write_json(paths.root / "dev" / "curves.json", rows)
    return rows


# ---- evaluation (notebooks 03 and 04) --------------------------------------------------------------------------------
def eval_pool(cfg: StudyConfig):
    """The worker pool of notebooks 03/04: the models LEMON was trained with, its reply caps raised to what the
    evaluated benchmarks' domains need (lemon.run.executor.domain_reply_caps; eval_caps clips each benchmark back to its
    own). Close it when done."""
    domains = {B.get_benchmark(b).domain for b in (*cfg.benchmarks, *cfg.ablation_benchmarks)}
    caps = [domain_reply_caps(cfg.train.worker_max_tokens, d) for d in domains] or [dict(cfg.train.worker_max_tokens)]
    # deterministic_workers off: it is for training's reward contrasts (one request in flight per server); evaluation
    # keeps the servers' batching throughput (greedy replies can then differ with what else is in flight, LOG.md
    # 2026-12-05)
    return build_pool(replace(cfg.train, worker_max_tokens={c: max(x[c] for x in caps) for c in caps[0]},
                              deterministic_workers=False))


def eval_caps(cfg: StudyConfig, benchmark: str = "gsm8k") -> ExecutorCaps:
    """Executor caps of one evaluated benchmark: the training reply caps raised for its domain (code needs more), the
    training task budget, and room for the baselines' agents. Recorded in each eval folder's manifest."""
    return ExecutorCaps(max_agents=max(cfg.train.max_agents, cfg.n_agents, 4),
                        max_tokens=domain_reply_caps(cfg.train.worker_max_tokens, B.get_benchmark(benchmark).domain),
                        task_token_budget=max(cfg.train.task_token_budget, 6000))


def orch_config(cfg: StudyConfig) -> OrchestratorConfig:
    return OrchestratorConfig(capacity=cfg.orchestrator_capacity, max_tokens=cfg.orchestrator_max_tokens,
                              max_agents=cfg.train.max_agents)


class LazyPolicyWriter:
    """The trained orchestrator (base model + adapter), loaded on its first spec: a resumed eval whose rows all exist
    never loads the model. cfg.policy_server: a llama-server writes the specs (lemon.eval.served; its name gets
    '@served'), else transformers (PolicySpecWriter)."""

    def __init__(self, cfg: StudyConfig, adapter: Path, name: str):
        self.cfg, self.adapter, self._w, self._server = cfg, Path(adapter), None, None
        self.name = name + ("@served" if cfg.policy_server else "")

    def propose(self, *a, **kw):
        if self._w is None:
            orch = replace(orch_config(self.cfg),
                           max_tokens=self.cfg.train.max_completion_length)  # its training length
            if self.cfg.policy_server:
                from transformers import AutoTokenizer
                model = self.cfg.train.policy.model
                self._server = ServedPolicy(model, self.adapter)
                tok = AutoTokenizer.from_pretrained(str(converted_dir(model)))  # the tokenizer load_policy uses
                self._w = ServedPolicySpecWriter(self._server, tok, orch)
            else:
                model, tok = load_policy(self.cfg.train.policy, adapter=self.adapter)
                model.eval()
                self._w = PolicySpecWriter(model, tok, orch, self.name)
        return self._w.propose(*a, **kw)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._w, self._server = None, None
        gc.collect()


def evaluate(cfg: StudyConfig, paths: StudyPaths, method: str, examples: dict[str, list], pool, prompts, *,
             adapter: Path | None = None, out_of=None, progress: bool = True, pool_kind: str = "eval",
             writer=None, concurrency: int | None = None) -> list[dict]:
    """Run (or resume) one method on each benchmark's examples (default folder eval/<method>/<benchmark>); returns the
    summaries. method: a baseline, 'prompted' (a worker writes the spec) or any other name with `adapter` (a trained
    policy).
    pool_kind: which pools the examples come from ('eval', or 'train' for best-fixed's choice), for the recorded split.
    writer: a spec writer to use instead of loading `adapter` (e.g. experiments.duel.legs.ReplayWriter: recorded specs).
    concurrency: questions in flight (lemon.eval.runner.run_eval; the servers batch them); None =
    cfg.eval_concurrency."""
    base, cap = split_method(method)  # 'cot@large': the cot baseline at capacity large
    if base not in BASELINES and method != "prompted" and adapter is None and writer is None:
        raise ValueError(f"method {method!r} is a trained orchestrator: pass its adapter (or a spec writer)")
    if adapter is not None:
        rel = (Path(adapter).resolve().relative_to(paths.root) if paths.root in Path(adapter).resolve().parents
               else adapter)
        writer = LazyPolicyWriter(cfg, Path(adapter), name=f"lemon:{cfg.train.policy.model}:{rel}")
    out_of = out_of or (lambda b: paths.eval_dir(method, b))
    sums = []
    try:
        for b, exs in examples.items():
            ecfg = EvalConfig(base if base in BASELINES else "orchestrator", b, B.POOL_SPLITS[pool_kind][b],
                              seed=cfg.seed, capacity=cap or cfg.baseline_capacity, n_agents=cfg.n_agents, k=cfg.sc_k)
            s = run_eval(ecfg, pool, prompts, out_of(b), caps=eval_caps(cfg, b), orch=orch_config(cfg), writer=writer,
                         examples=exs, progress=progress,
                         concurrency=cfg.eval_concurrency if concurrency is None else concurrency)
            sums.append({**s, "method": method})
    finally:
        if writer:
            writer.close()
    return sums


def pooled(sums: list[dict]) -> dict:
    """Per-benchmark eval summaries (lemon.eval.runner.summarize) pooled over benchmarks: n, accuracy, mean worker
    tokens."""
    n = sum(s["n"] for s in sums)
    return {"n": n, "accuracy": sum(s["correct"] for s in sums) / n,
            "tokens": sum(s["mean_worker_tokens"] * s["n"] for s in sums) / n}


def select_fixed(cfg: StudyConfig, paths: StudyPaths, pool, prompts, *, progress: bool = True,
                 concurrency: int | None = None) -> str:
    """'best-fixed': run every cfg.fixed_candidates method on a seeded sample of fixed_dev_n TRAIN-pool questions per
    benchmark (select/<method>/<benchmark>, resumable) and return the most accurate (ties: fewer mean worker tokens).
    The choice, every candidate's score and the dev ids go to select/choice.json; a folder that has it is not redone."""
    out = paths.root / "select" / "choice.json"
    if out.exists():
        return json.loads(out.read_text())["chosen"]
    train = B.train_pool(cfg.protocol)
    dev = {}
    for b in cfg.benchmarks:
        exs = sorted(train[b], key=lambda e: e.id)
        random.Random(cfg.seed).shuffle(exs)
        dev[b] = exs[:cfg.fixed_dev_n]
    scores = []
    for m in cfg.fixed_candidates:
        sums = evaluate(cfg, paths, m, dev, pool, prompts, out_of=lambda b, m=m: paths.root / "select" / m / b,
                        progress=progress, pool_kind="train", concurrency=concurrency)
        scores.append({"method": m, **pooled(sums)})
    best = max(scores, key=lambda r: (r["accuracy"], -r["tokens"]))
    write_json(out, {"chosen": best["method"], "candidates": scores,
                     "dev_ids": {b: [e.id for e in v] for b, v in dev.items()}, "seed": cfg.seed})
    return best["method"]


def evaluate_all(cfg: StudyConfig, paths: StudyPaths, pool, prompts, *, progress: bool = True) -> None:
    """Notebook 04: every method of cfg.eval_methods on the eval sample (LEMON = notebook 02's adapter; 'best-fixed' =
    the method select_fixed chose, evaluated into eval/best-fixed/)."""
    samples = load_samples(cfg, paths, "eval")
    for m in cfg.eval_methods:
        evaluate_method(cfg, paths, m, samples, pool, prompts, progress=progress)


def evaluate_method(cfg: StudyConfig, paths: StudyPaths, method: str, samples: dict[str, list], pool, prompts, *,
                    progress: bool = True) -> list[dict]:
    """One method of notebook 04 into eval/<method>/: 'lemon' with notebook 02's adapter, 'best-fixed' as the method
    select_fixed chose, anything else as itself."""
    if method == FIXED:
        chosen = select_fixed(cfg, paths, pool, prompts, progress=progress)
        return evaluate(cfg, paths, chosen, samples, pool, prompts, out_of=lambda b: paths.eval_dir(FIXED, b),
                        progress=progress)
    adapter = paths.require(paths.grpo / "adapter", "02_train_grpo_lora") if method == "lemon" else None
    return evaluate(cfg, paths, method, samples, pool, prompts, adapter=adapter, progress=progress)


def generated_specs(cfg: StudyConfig, paths: StudyPaths, prompts, methods=ORCHESTRATORS) -> list[dict]:
    """Specs the orchestrators wrote in notebook 04 (parsed again; invalid ones keep their error), valid ones first."""
    out = []
    for m in methods:
        for b in cfg.benchmarks:
            for r in read_rows(paths.eval_dir(m, b) / "results.jsonl"):
                if not r.get("spec"):
                    continue
                try:
                    spec = parse_spec(r["spec"], base_roles=prompts.roles_for(B.get_benchmark(b).domain))
                except SpecError:
                    spec = None
                out.append({"method": m, "benchmark": b, "id": r["id"], "spec": spec, "text": r["spec"],
                            "error": r.get("spec_error"), "correct": r["correct"], "tokens": r["tokens"]})
    return sorted(out, key=lambda d: d["spec"] is None)
