"""The real-worker CF-GRPO vs global-GRPO comparison (issue 13, deliverable 2), run as a chain of session-sized legs.

Why legs: the comparison is ~10 h of 2 cores (two training arms of ~1 h, ~13 s per greedy spec, ~10-40 s per executed
question for ~8 methods on 150 questions) and a session here has 3 h with nothing kept but git. Every leg leaves only
small text in `ref` (outputs/reference/duel-...): the SFT corpus, each arm's training record, each trained policy's
greedy specs for the evaluation and dev questions, per-question results. Adapters and checkpoints stay in the work
folder (outputs/duel-cpu, gitignored) and are rebuilt when needed: the warm start from the committed corpus (its adapter
sha256 is compared with the first leg's, so both arms provably start from the same weights, or the mismatch is
reported).

The work folder uses the study's layout (lemon.study.runner.StudyPaths; the `cpu-long` profile's config with `steps`
CF-GRPO steps): the CF arm is train/grpo, the global arm ablations/variants/global, both from train/sft, so the study's
stages (evaluate, dev examples, summary pieces) apply unchanged.

Legs (each resumable; `status` prints what is missing and the command for it):
  train --arm cf|global   SFT warm start (built, or rebuilt from ref's corpus), `steps` steps, then the arm's specs
  specs --arm sft|cf|global   greedy specs (served policy, llguidance) for the eval sample and the dev set
  exec  --method M        execute committed specs (M = sft | cf | global) or run a baseline (cot@large, ...) on the
                          eval sample; results.jsonl per benchmark in ref
  report                  paired comparisons with CIs, learning curves, spec composition, plots -> ref/summary.md
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from lemon.eval.runner import read_rows
from lemon.manifest import git_sha, write_json
from lemon.run.models import file_sha256
from lemon.study.config import StudyConfig, study_preset
from lemon.study.runner import ROOT, StudyPaths, guard_config

ARMS = ("cf", "global")
POLICIES = ("sft", *ARMS)  # the three trained-policy methods compared on the same questions


@dataclass(frozen=True)
class DuelConfig:
    """One real-worker CF vs global comparison."""

    steps: int = 10
    """CF-GRPO steps of each arm (the same for both; cpu-long's design had 15, cut to fit one arm per 3-h session)."""
    eval_n: int = 50
    """EVAL-pool questions per math benchmark (150 paired; the cpu profile's 20 per benchmark are a prefix)."""
    dev_n: int = 5
    """Held-out TRAIN-pool questions per math benchmark for the learning curve (never trained on)."""
    dev_steps: tuple[int, ...] = (4,)
    """Checkpoints (besides step 0 = the warm start and the final step) whose greedy specs are written for the dev
    set."""
    seed: int = 0
    """Seeds data samples, training, and every worker call (both arms alike)."""
    work: str = "outputs/duel-cpu"
    """Work folder (adapters, checkpoints, caches; gitignored), relative to the repo root."""
    ref: str = "outputs/reference/duel-cpu-20261203"
    """Record kept in git (small text only), relative to the repo root."""

    def __post_init__(self):
        if self.steps < 1 or self.eval_n < 1 or self.dev_n < 0:
            raise ValueError("steps and eval_n must be >= 1, dev_n >= 0")
        bad = [s for s in self.dev_steps if not 0 < s < self.steps or s % 2]
        if bad:
            raise ValueError(f"dev_steps {bad}: each must be an even step (checkpoints are saved every 2) below steps="
                             f"{self.steps}")

    def study(self) -> StudyConfig:
        """The cpu-long study config this comparison runs (its trainer, SFT, pools and eval caps), resized."""
        c = study_preset("cpu-long", seed=self.seed)
        return replace(c, train=replace(c.train, max_steps=self.steps), ablation_steps=self.steps, eval_n=self.eval_n,
                       ablation_n=self.eval_n, dev_n=self.dev_n, dev_every=2)

    @property
    def paths(self) -> StudyPaths:
        return StudyPaths(ROOT / self.work)

    @property
    def refdir(self) -> Path:
        return ROOT / self.ref


def adapter_sha(adapter: Path) -> str:
    """sha256 of an adapter's weights file (what makes two warm starts the same policy)."""
    return file_sha256(Path(adapter) / "adapter_model.safetensors")


def arm_dir(d: DuelConfig, arm: str) -> Path:
    return d.paths.grpo if arm == "cf" else d.paths.variant("global")


def cpu_id() -> str:
    """The CPU's model name and a digest of its flags: float results (so a rebuilt adapter's bits) can differ across
    CPUs."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    field = lambda k: next((x.split(":", 1)[1].strip() for x in info.splitlines() if x.startswith(k)), "?")  # noqa: E731
    return f"{field('model name')} flags:{hashlib.sha256(field('flags').encode()).hexdigest()[:8]}"


def cli(d: DuelConfig) -> str:
    """The command line that addresses this comparison: `experiments/duel/` plus the global options that differ from the
    default config (so the commands printed by status and the report are right for a replicate too)."""
    dflt, opts = DuelConfig(), []
    for name, flag in (("seed", "--seed"), ("steps", "--steps"), ("work", "--work"), ("ref", "--ref")):
        if getattr(d, name) != getattr(dflt, name):
            opts.append(f"{flag} {getattr(d, name)}")
    if d.dev_steps != dflt.dev_steps:
        opts.append(f"--dev-steps '{','.join(map(str, d.dev_steps))}'")
    return " ".join(["experiments/duel/", *opts])


def check_config(d: DuelConfig) -> None:
    """A record folder holds one comparison: its DuelConfig is written to ref/config.json by the first leg, and a later
    leg with another config (say a second seed pointed at the same folder) is refused instead of mixing the two."""
    from dataclasses import asdict
    if not (d.refdir / "config.json").exists() and (d.refdir / "legs.jsonl").exists() and d != DuelConfig():
        raise ValueError(f"{d.refdir} predates config.json and was written by the default DuelConfig; this "
                         f"leg's is {d}")
    guard_config(d.refdir, asdict(d), "comparison", "give this one its own --work and --ref")


def log_event(d: DuelConfig, **kw) -> None:
    """One line per leg action in ref/legs.jsonl: what ran, when, at which commit, on which CPU (the chain's
    manifest)."""
    check_config(d)
    with open(d.refdir / "legs.jsonl", "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "git": git_sha(), "cpu": cpu_id(), **kw})
                + "\n")


def ensure_data(d: DuelConfig) -> dict:
    """Notebook 01's pools and seeded samples in the work folder (seconds); returns the samples."""
    from lemon.study.stages import prepare_data
    cfg, paths = d.study(), d.paths
    if not paths.samples.exists():
        prepare_data(cfg, paths)
    return json.loads(paths.samples.read_text())


def ensure_sft(d: DuelConfig, prompts, pool=None) -> dict:
    """The warm start: built with the workers (first leg: the corpus and its record go to ref/sft), or rebuilt from
    ref/sft/corpus.jsonl (later legs). Either way its adapter sha256 is checked against ref/sft/sft.json's."""
    from lemon.train.pipeline import warm_start
    cfg, paths, ref = d.study(), d.paths, d.refdir / "sft"
    corpus = read_rows(ref / "corpus.jsonl") or None
    rec = warm_start(cfg.train, cfg.sft, paths.sft, prompts, pool=pool, corpus=corpus)
    sha = adapter_sha(Path(rec["adapter"]))
    if (ref / "sft.json").exists():
        first = json.loads((ref / "sft.json").read_text())
        same = first["adapter_sha256"] == sha
        log_event(d, leg="sft", rebuilt_from_corpus=corpus is not None, adapter_sha256=sha, same_as_first_leg=same)
        if not same:
            print(f"[duel] WARNING: the rebuilt warm start differs from the first leg's (sha256 {sha[:12]} vs "
                  f"{first['adapter_sha256'][:12]}): the arms do not start from bit-identical weights; recorded in "
                  f"{ref / '..' / 'legs.jsonl'}", file=sys.stderr)
    else:
        ref.mkdir(parents=True, exist_ok=True)
        shutil.copy(paths.sft / "corpus.jsonl", ref / "corpus.jsonl")
        write_json(ref / "sft.json", {**{k: v for k, v in rec.items() if k != "adapter"}, "adapter_sha256": sha})
        log_event(d, leg="sft", rebuilt_from_corpus=False, adapter_sha256=sha, rows=rec["rows"])
    return rec


def keep_training_record(d: DuelConfig, arm: str) -> None:
    """Copy an arm's small training files (metrics, rollouts, manifest, the finished record) into ref/<arm>/."""
    src, dst = arm_dir(d, arm), d.refdir / arm
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "rollouts.jsonl", "manifest.json", "train.json", "cf_sampler.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    if (src / "adapter").exists():
        write_json(dst / "adapter.json", {"adapter_sha256": adapter_sha(src / "adapter"),
                                          "note": f"weights stay out of git; rerun `{cli(d)} train --arm {arm}` to "
                                                  "rebuild them"})


def train_arm(d: DuelConfig, arm: str, prompts) -> Path:
    """SFT warm start, then `steps` steps of the arm from it (resumable from the work folder's checkpoints)."""
    from lemon.study.stages import train_variant
    from lemon.train.pipeline import build_pool, train
    if arm not in ARMS:
        raise ValueError(f"arm {arm!r}; valid: {', '.join(ARMS)}")
    cfg, paths = d.study(), d.paths
    ensure_data(d)
    pool = build_pool(cfg.train)
    t0 = time.time()
    try:
        sft = ensure_sft(d, prompts, pool)
        if arm == "cf":
            res = train(cfg.train, paths.grpo, prompts, pool=pool, init_adapter=sft["adapter"])
            adapter = Path(res["adapter"])
        else:
            adapter = train_variant(cfg, paths, "global", prompts, pool)
    finally:
        pool.close()
    keep_training_record(d, arm)
    log_event(d, leg="train", arm=arm, steps=d.steps, seconds=round(time.time() - t0))
    return adapter


# ---- greedy specs of a trained policy (need its adapter: same leg as its training) ----------------------------------
def spec_points(d: DuelConfig, arm: str) -> list[tuple[int, Path, tuple[str, ...]]]:
    """(step, adapter, question sets) whose greedy specs a policy writes: the warm start ('sft', step 0) for the eval
    sample and the dev set; an arm's final adapter for both, its dev_steps checkpoints for the dev set. Final first: it
    is what the comparison needs most."""
    paths = d.paths
    if arm == "sft":
        return [(0, paths.sft, ("eval", "dev"))]
    run = arm_dir(d, arm)
    return [(d.steps, run / "adapter", ("eval", "dev")),
            *[(s, run / "grpo" / f"checkpoint-{s}", ("dev",)) for s in d.dev_steps]]


def spec_file(d: DuelConfig, arm: str, step: int, which: str) -> Path:
    return d.refdir / "specs" / f"{arm}-step{step}-{which}.jsonl"


def question_sets(d: DuelConfig) -> dict[str, dict[str, list]]:
    """{'eval': the seeded EVAL-pool sample, 'dev': held-out TRAIN-pool questions}, each {benchmark: [Example]}."""
    from lemon.study.runner import load_samples
    from lemon.study.stages import dev_examples
    ensure_data(d)
    cfg = d.study()
    return {"eval": load_samples(cfg, d.paths, "eval"), "dev": dev_examples(cfg) if d.dev_n else {}}


def qkey(question: str) -> str:
    return hashlib.sha256(question.encode()).hexdigest()


def write_specs(d: DuelConfig, arm: str, prompts, *, writer_factory=None, progress: bool = True) -> int:
    """Greedy specs of `arm` at each spec_points entry into ref/specs/<arm>-step<k>-<set>.jsonl (resumable: rows already
    there are kept). writer_factory(cfg, adapter, name) -> writer (default: the study's LazyPolicyWriter, served).
    Returns the number of specs written by this call."""
    from lemon import benchmarks as B
    from lemon.study.stages import LazyPolicyWriter
    from tqdm.auto import tqdm
    cfg, sets, n_new = d.study(), question_sets(d), 0
    factory = writer_factory or (lambda c, a, n: LazyPolicyWriter(c, a, n))
    for step, adapter, which in spec_points(d, arm):
        if not Path(adapter).exists():
            raise FileNotFoundError(f"{adapter}: arm {arm!r} at step {step} is not trained in {d.paths.root}; run "
                                    f"`{cli(d)} train --arm {arm if arm != 'sft' else 'cf'}` on this machine first")
        sha = adapter_sha(adapter)
        writer = factory(cfg, Path(adapter), f"{arm}-step{step}")
        try:
            for w in which:
                out = spec_file(d, arm, step, w)
                out.parent.mkdir(parents=True, exist_ok=True)
                done = {(r["benchmark"], r["id"]) for r in read_rows(out)}
                todo = [e for exs in sets[w].values() for e in exs if (e.benchmark, e.id) not in done]
                for e in tqdm(todo, desc=f"specs {arm} step {step} {w}", disable=not progress):
                    t0 = time.perf_counter()
                    prop = writer.propose(e.question, B.get_benchmark(e.benchmark).domain, prompts, seed=d.seed)
                    row = {"benchmark": e.benchmark, "id": e.id, "question_sha256": qkey(e.question), "text": prop.text,
                           "valid": prop.spec is not None, "error": prop.error, "prompt_tokens": prop.prompt_tokens,
                           "completion_tokens": prop.completion_tokens, "arm": arm, "step": step,
                           "adapter_sha256": sha, "seconds": round(time.perf_counter() - t0, 2)}
                    with open(out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                    n_new += 1
        finally:
            writer.close()
    log_event(d, leg="specs", arm=arm, written=n_new)
    return n_new


class ReplayWriter:
    """A spec writer that returns specs a policy wrote earlier (ref/specs/*.jsonl), looked up by the question's sha256:
    executing a trained policy's greedy specs needs no adapter, so it can run in any later session. The spec is parsed
    again exactly as the served writer parsed it; a question with no recorded spec is an error, never a silent skip."""

    def __init__(self, path: Path, name: str, max_agents: int):
        self.rows = {r["question_sha256"]: r for r in read_rows(path)}
        if not self.rows:
            raise FileNotFoundError(f"{path}: no recorded specs (write them first: experiments/duel/ specs)")
        self.name, self.max_agents, self.path = name, max_agents, path

    def propose(self, task: str, domain: str, prompts, seed: int = 0):
        from lemon.eval.orchestrator import SpecProposal
        from lemon.spec import SpecError, parse_spec
        r = self.rows.get(qkey(task))
        if r is None:
            raise KeyError(f"{self.path} has no spec for this question (sha256 {qkey(task)[:12]}): the specs "
                           "were written for another question sample")
        try:
            spec = parse_spec(r["text"], base_roles=prompts.roles_for(domain), max_agents=self.max_agents)
            return SpecProposal(r["text"], spec, None, None, r["prompt_tokens"], r["completion_tokens"])
        except SpecError as e:
            return SpecProposal(r["text"], None, str(e), e.code, r["prompt_tokens"], r["completion_tokens"])

    def close(self) -> None:
        pass


# ---- execution and baselines (no adapter needed: any leg) ------------------------------------------------------------
def eval_dir(d: DuelConfig, method: str, benchmark: str, which: str = "eval", step: int | None = None) -> Path:
    if which == "dev":
        return d.refdir / "dev" / f"{method}-step{step}" / benchmark
    return d.refdir / "eval" / method / benchmark


def run_method(d: DuelConfig, method: str, prompts, pool, *, progress: bool = True, concurrency: int = 1) -> list[dict]:
    """Evaluate one method on the eval sample into ref/eval/<method>/<benchmark>/ (resumable): a policy (sft / cf /
    global: its recorded final specs, executed) or any study eval method without an adapter (cot@large, sc-cot@medium,
    complete@medium, prompted, ...). For a policy also its dev-set specs at every recorded step, into ref/dev/.
    concurrency: questions in flight (seeds do not depend on it; a server's batched decode can still flip a greedy
    token)."""
    from lemon.study.config import FIXED
    from lemon.study.stages import evaluate, select_fixed
    cfg, sets = d.study(), question_sets(d)
    sums = []
    if method not in POLICIES:
        run_as = method
        # chosen on TRAIN-pool questions; the choice and its candidates' rows are kept in ref/select
        if method == FIXED:
            # best-fixed IS the chosen method on the same questions, seed and workers: its eval rows are the chosen
            # method's own (eval/<chosen>/, resumed if that method already ran), not a second execution of it; the
            # report shows the row as "best-fixed (= <chosen>)" (duel_report.evaluated)
            run_as = select_fixed(cfg, StudyPaths(d.refdir), pool, prompts, progress=progress, concurrency=concurrency)
        sums = evaluate(cfg, d.paths, run_as, sets["eval"], pool, prompts, progress=progress,
                        out_of=lambda b: eval_dir(d, run_as, b), concurrency=concurrency)
    else:
        for step, _, which in spec_points(d, method):
            for w in which:
                writer = ReplayWriter(spec_file(d, method, step, w), f"replay:{method}-step{step}",
                                      cfg.train.max_agents)
                s = evaluate(cfg, d.paths, method, sets[w], pool, prompts, writer=writer, progress=progress,
                             concurrency=concurrency,
                             out_of=lambda b, w=w, step=step: eval_dir(d, method, b, w, step),
                             pool_kind="eval" if w == "eval" else "train")
                sums += [{**x, "set": w, "step": step} for x in s]
    for p in d.refdir.rglob("node_cache.jsonl"):  # worker outputs are in results.jsonl; keep the record small
        p.unlink()
    return sums
