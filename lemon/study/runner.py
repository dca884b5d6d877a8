"""The user-facing study: notebooks 01 (data) -> 02 (SFT + CF-GRPO) -> 03 (ablations) -> 04 (evaluation), executed with
papermill into outputs/<profile>-<timestamp>/ by ONE command (`scripts/main.sh --profile smoke|cpu|paper [--out DIR | --resume]`).
Here: the config of each profile, the folder layout and the runner; what each notebook computes is in lemon.study.stages,
the plots and summary tables in lemon.study.plots; the notebooks orchestrate and display. Every step resumes: notebooks that finished
are skipped (a marker under .done/), and inside a notebook training resumes from checkpoints and evaluation from results.jsonl.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from lemon import benchmarks as B
from lemon.eval.baselines import BASELINES
from lemon.train.config import PROFILES, TrainConfig, sft_preset, train_preset
from lemon.train.edits import FAMILIES
from lemon.eval.runner import EvalConfig
from lemon.manifest import build_manifest, git_sha, write_json
from lemon.run.models import DEFAULT_LADDER, SHIPPED
from lemon.eval.orchestrator import OrchestratorConfig
from lemon.progress import TEXT_ENV
from lemon.prompts import CAPACITIES
from lemon.train.sft import SFTConfig

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ("01_prepare_data", "02_train_grpo_lora", "03_ablations", "04_evaluate")
ORCHESTRATORS = ("prompted", "lemon")  # eval methods besides the baselines: the untrained prompted worker, the trained policy
VARIANTS = {"sft": None, "global": {"cf_lambda": 0.0}, "full": {},  # sft = warm start only (no RL); full = CF over all families
            **{f: {"cf_families": (f,)} for f in FAMILIES}}  # one edit family alone


@dataclass(frozen=True)
class StudyConfig:
    """Everything the four notebooks do for one profile (training itself: `train` / `sft`, from lemon.train.config)."""

    profile: str
    """smoke | cpu | paper."""
    train: TrainConfig
    """CF-GRPO config of the main run (lemon.train.config.train_preset(profile))."""
    sft: SFTConfig
    """Warm-start config (lemon.train.config.sft_preset(profile))."""
    seed: int = 0
    """Seeds the eval/edit/ablation samples, every worker call and (through train/sft) training."""
    protocol: str = "paper"
    """Train/eval pool protocol (lemon.benchmarks.PROTOCOLS)."""
    benchmarks: tuple[str, ...] = B.BENCHMARKS
    """Benchmarks evaluated in notebook 04 (their EVAL pools)."""
    eval_n: int | None = 2
    """Eval questions per benchmark (a seeded sample of the eval pool; None = the whole pool)."""
    eval_methods: tuple[str, ...] = BASELINES + ORCHESTRATORS
    """Methods of notebook 04: baselines, 'prompted' (untrained orchestrator), 'lemon' (trained policy)."""
    baseline_capacity: str = "medium"
    """Capacity of every baseline agent."""
    n_agents: int = 3
    """Agents (final included) of chain / tree / complete / random."""
    sc_k: int = 3
    """SC-CoT samples."""
    orchestrator_capacity: str = "large"
    """Which worker writes the prompted orchestrator's spec."""
    orchestrator_max_tokens: int = 320
    """Spec length cap of the prompted orchestrator (the trained one keeps train.max_completion_length)."""
    edit_n: int = 1
    """Edit-effect questions per benchmark (a prefix of the eval sample)."""
    edit_specs: int = 1
    """Held-out (mutated baseline) specs per edit-effect question."""
    edit_sites: int = 1
    """Sites per family and spec at which an edit is applied (seeded choice among the eligible ones)."""
    ablation_variants: tuple[str, ...] = ("global", "full", "edge", "role", "capacity")
    """Training variants of notebook 03 (keys of VARIANTS), all started from the same SFT warm start."""
    ablation_steps: int = 1
    """GRPO steps of each variant ('full' reuses notebook 02's run when this equals train.max_steps)."""
    ablation_benchmarks: tuple[str, ...] = ("gsm8k", "mmlu")
    """Benchmarks each variant's adapter is evaluated on."""
    ablation_n: int = 1
    """Eval questions per ablation benchmark (a prefix of the eval sample)."""
    gallery: int = 4
    """Generated specs drawn in notebook 04."""
    policy_server: bool = False
    """Trained policies write their evaluation specs on llama-server (lemon.run.served_policy: the same F32 weights and
    llguidance greedy, token for token the transformers specs; ~9x faster for the 0.5B, bench/served_policy_bench.py)."""

    def __post_init__(self):
        if self.profile not in PROFILES or self.train.profile != self.profile:
            raise ValueError(f"profile={self.profile!r} (train preset {self.train.profile!r}); valid: {', '.join(PROFILES)}")
        if self.protocol not in B.PROTOCOLS:
            raise ValueError(f"protocol={self.protocol!r}; valid: {', '.join(B.PROTOCOLS)}")
        for name in (*self.benchmarks, *self.ablation_benchmarks):
            B.get_benchmark(name)  # raises UnknownBenchmarkError naming the valid ones
        bad = [m for m in self.eval_methods if m not in BASELINES + ORCHESTRATORS]
        if bad:
            raise ValueError(f"unknown eval methods {bad}; valid: {', '.join(BASELINES + ORCHESTRATORS)}")
        bad = [v for v in self.ablation_variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"unknown ablation variants {bad}; valid: {', '.join(VARIANTS)}")
        if self.eval_n is not None and self.eval_n < 1:
            raise ValueError("eval_n must be >= 1 (or None for the whole eval pool)")
        cap = self.eval_n or 10**9
        for k in ("edit_n", "ablation_n"):
            if not 0 <= getattr(self, k) <= cap:
                raise ValueError(f"{k}={getattr(self, k)} must be in 0..eval_n={self.eval_n}: its questions are a prefix of the eval sample")
        if min(self.edit_specs, self.edit_sites, self.ablation_steps, self.sc_k) < 1:
            raise ValueError("edit_specs, edit_sites, ablation_steps and sc_k must be >= 1")
        if {self.baseline_capacity, self.orchestrator_capacity} - set(CAPACITIES):
            raise ValueError(f"capacities {self.baseline_capacity!r} / {self.orchestrator_capacity!r}; valid: {', '.join(CAPACITIES)}")
        EvalConfig("tree", "gsm8k", capacity=self.baseline_capacity, n_agents=self.n_agents, k=self.sc_k)  # same checks as eval
        OrchestratorConfig(capacity=self.orchestrator_capacity, max_tokens=self.orchestrator_max_tokens)
        if self.policy_server and self.train.policy.model not in SHIPPED:
            raise ValueError(f"policy_server=True serves a shipped GGUF policy; {self.train.policy.model!r} is not one "
                             f"({', '.join(SHIPPED)}): set policy_server=False (transformers writes the specs)")

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        """One line per field (train / sft nested one level), for the notebooks' config cell."""
        flat = lambda d, pre="": [f"{pre}{k} = {v!r}" for k, v in d.items()]  # noqa: E731
        d = self.to_dict()
        return "\n".join([*flat({k: v for k, v in d.items() if k not in ("train", "sft")}), *flat(d["train"], "train."),
                          *flat(d["sft"], "sft.")])


def study_preset(profile: str, seed: int = 0, **overrides) -> StudyConfig:
    """The study of a profile; `overrides` replace StudyConfig fields."""
    train, sft = train_preset(profile, seed=seed), sft_preset(profile, seed=seed)
    if profile == "smoke":
        # CI: 135M everywhere, 2 questions per benchmark, 1-step variants (global, full, edge). Measured on 2 lightly loaded
        # cores (2026-11-30): 01 3 s, 02 375 s (SFT ~5 min, CF-GRPO 21 s/step), 03 181 s, 04 498 s; total 17.7 min.
        # Under heavy contention from other jobs (load ~5 on 2 cores) the same study took ~75 min.
        cfg = StudyConfig("smoke", train, sft, seed=seed, orchestrator_max_tokens=256, ablation_variants=("global", "full", "edge"), ablation_benchmarks=("gsm8k",), ablation_n=1)
    elif profile == "cpu":
        # Embedded default on 2 cores. MEASURED (2026-11-30, llama.cpp on both cores, LOG.md; summed over resumes): 01 7 s;
        # 02 ~39 min (SFT corpus on 8 questions 13.4 min, valid-rate probes 2 x 2.3 min, SFT 3 steps ~2 min, 4 CF-GRPO steps
        # 215-333 s each); 03 ~25 min; 04 ~57 min (9 methods x 6 benchmarks x 2 questions). About 2 h in all.
        # policy_server (added 2026-12-02, after the timings above): trained policies' eval specs on llama-server, ~9x faster
        cfg = StudyConfig("cpu", replace(train, max_steps=4), replace(sft, questions=8), seed=seed, policy_server=True)
    elif profile == "paper":  # one GPU + vLLM workers: full eval pools, Table-2 ablation at 300 steps on 200 MMLU / GSM8K questions
        cfg = StudyConfig("paper", train, sft, seed=seed, eval_n=None, n_agents=4, sc_k=5, orchestrator_max_tokens=1024,
                          edit_n=20, edit_specs=2, edit_sites=2,
                          ablation_variants=("sft", "global", "full", "edge", "role", "capacity"), ablation_steps=300,
                          ablation_benchmarks=("mmlu", "gsm8k"), ablation_n=200, gallery=8)
    else:
        raise ValueError(f"unknown profile {profile!r}; valid: {', '.join(PROFILES)}")
    return replace(cfg, **overrides)


# ---- where things go -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StudyPaths:
    """The layout of one study folder."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root).resolve())

    data = property(lambda s: s.root / "data")
    samples = property(lambda s: s.root / "data" / "samples.json")
    sft = property(lambda s: s.root / "train" / "sft")
    grpo = property(lambda s: s.root / "train" / "grpo")
    edits = property(lambda s: s.root / "ablations" / "edit_effects.jsonl")
    plots = property(lambda s: s.root / "plots")
    done = property(lambda s: s.root / ".done")

    def variant(self, name: str) -> Path:
        return self.root / "ablations" / "variants" / name

    def eval_dir(self, method: str, bench: str) -> Path:
        return self.root / "eval" / method / bench

    def require(self, path: Path, notebook: str) -> Path:
        """`path`, or a FileNotFoundError naming the notebook that writes it (nothing is recomputed silently)."""
        if not Path(path).exists():
            raise FileNotFoundError(f"{path} is missing: run notebooks/{notebook}.ipynb first with out_dir={str(self.root)!r} "
                                    f"(or the whole study: scripts/main.sh --out {self.root})")
        return Path(path)


def resolve_out_dir(profile: str, out_dir: str | Path | None = None, resume: bool = False, *, root: Path = ROOT,
                    newest_ok: bool = False) -> Path:
    """`out_dir` when given; with `resume` (or `newest_ok` and one exists) the newest outputs/<profile>-<timestamp>; else a
    new timestamped folder (not created here)."""
    if out_dir:
        return Path(out_dir).resolve()
    runs = sorted(p for p in (root / "outputs").glob(f"{profile}-*") if re.fullmatch(rf"{profile}-\d{{8}}-\d{{6}}", p.name))
    if runs and (resume or newest_ok):
        return runs[-1].resolve()
    if resume:
        raise FileNotFoundError(f"--resume: no earlier {profile} study under {root / 'outputs'}; run without --resume")
    return (root / "outputs" / f"{profile}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def setup(profile: str, out_dir: str, seed: int) -> tuple[StudyConfig, StudyPaths]:
    """What every notebook's second cell calls: the config, the paths (out_dir '' = the newest study of this profile, or a
    new one), with the config checked against the one the study folder was started with."""
    cfg = study_preset(profile, seed=seed)
    paths = StudyPaths(resolve_out_dir(profile, out_dir or None, newest_ok=True))
    write_config(cfg, paths)
    return cfg, paths


def write_config(cfg: StudyConfig, paths: StudyPaths) -> None:
    """config.json; a folder started with another config is refused (one folder = one experiment)."""
    paths.root.mkdir(parents=True, exist_ok=True)
    new = json.loads(json.dumps(cfg.to_dict(), default=str))
    p = paths.root / "config.json"
    old = json.loads(p.read_text()) if p.exists() else new
    if old != new:
        diff = sorted(_diff(old, new))
        raise ValueError(f"{paths.root} holds a study with a different config ({'; '.join(diff[:6])}); resume it with the "
                         f"same profile, seed and code, or choose another --out")
    if not p.exists():
        write_json(p, new)


def _diff(a, b, pre=""):
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in a.keys() | b.keys() for d in _diff(a.get(k), b.get(k), f"{pre}{k}.")]
    return [] if a == b else [f"{pre[:-1]}: {a!r} -> {b!r}"]


# ---- samples (notebook 01 writes them, the others read them) ---------------------------------------------------------
def load_samples(cfg: StudyConfig, paths: StudyPaths, which: str = "eval") -> dict[str, list]:
    """{benchmark: [Example]} of the eval sample written by notebook 01 ('eval', 'edit' or 'ablation')."""
    ids = json.loads(paths.require(paths.samples, "01_prepare_data").read_text())[which]
    out = {}
    for b, want in ids.items():
        by_id = {e.id: e for e in B.pool(b, "eval", cfg.protocol)}
        out[b] = [by_id[i] for i in want]
    return out


# ---- the runner ------------------------------------------------------------------------------------------------------
def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def study_manifest(cfg: StudyConfig) -> dict:
    """Git sha, config, data files' and models' sha256, seeds (what produced every number of the study)."""
    from lemon.prompts import default_prompts
    workers = cfg.train.workers or {c: {"backend": "llama_cpp", "model": m} for c, m in DEFAULT_LADDER.items()}
    workers = {c: {k: v for k, v in w.items() if k in ("backend", "model", "base_url")} for c, w in workers.items()}
    root = B.resolve_data_dir()
    files = sorted({root / b / f"{B.POOL_SPLITS[w][b]}.jsonl" for b in B.BENCHMARKS for w in ("train", "eval")})
    pol = cfg.train.policy.model
    return build_manifest(cfg.to_dict(), prompts_sha256=default_prompts().sha256, workers=workers, data_files=files,
                          seeds={"study": cfg.seed, "train": cfg.train.seed, "sft": cfg.sft.seed, "eval": cfg.seed},
                          extra={"policy": {"model": pol, **({"sha256": SHIPPED[pol].sha256} if pol in SHIPPED else {})},
                                 "protocol": cfg.protocol, "data_dir": str(root)})


def _record_time(paths: StudyPaths, timings: dict, nb: str, t0: float, stopped: str | None = None) -> float:
    """Append one execution of `nb` to timings.json: seconds for a finished one, {"s", "stopped"} for one that failed or
    was interrupted, so a study's total wall time counts the work that was lost too (a SIGKILLed runner records nothing)."""
    wall = round(time.perf_counter() - t0, 1)
    prev = timings.get(nb) or []
    timings[nb] = [*(prev if isinstance(prev, list) else [prev]), wall if stopped is None else {"s": wall, "stopped": stopped}]
    write_json(paths.root / "timings.json", timings)
    return wall


def run_study(profile: str, out_dir: str | Path | None = None, resume: bool = False, *, seed: int = 0,
              notebooks: tuple[str, ...] = NOTEBOOKS, log_output: bool = True) -> Path:
    """Execute the notebooks in order with papermill into the study folder; a notebook that finished with the same source
    and config is skipped. A failing cell stops the study: the notebook, cell and error are printed, exit status 1."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError
    from nbclient.exceptions import DeadKernelError
    from lemon.study.plots import write_summary
    paths = StudyPaths(resolve_out_dir(profile, out_dir, resume))
    cfg = study_preset(profile, seed=seed)
    print(f"LEMON study, profile {profile}, seed {seed}: {paths.root}", flush=True)
    write_config(cfg, paths)
    mp = paths.root / "manifest.json"
    man = json.loads(mp.read_text()) if mp.exists() else study_manifest(cfg)
    if mp.exists():
        man.setdefault("resumed", []).append({"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_sha(), "argv": sys.argv})
    write_json(mp, man)
    paths.done.mkdir(exist_ok=True)
    if log_output:  # the kernels inherit it: text progress bars on the console (see lemon.progress)
        os.environ[TEXT_ENV] = "1"
    timings = json.loads((paths.root / "timings.json").read_text()) if (paths.root / "timings.json").exists() else {}
    ran = False
    for nb in notebooks:
        src = ROOT / "notebooks" / f"{nb}.ipynb"
        key = _digest(src.read_text(), cfg.to_dict())
        marker = paths.done / f"{nb}.json"
        if not ran and marker.exists() and json.loads(marker.read_text()).get("key") == key:
            print(f"[{nb}] finished earlier; skipped", flush=True)
            continue
        ran = True  # what a notebook (re)writes may change its successors' inputs: they run again too (and resume)
        print(f"[{nb}] running ...", flush=True)
        t0 = time.perf_counter()
        try:
            pm.execute_notebook(str(src), str(paths.root / f"{nb}.ipynb"), kernel_name="python3", cwd=str(ROOT),
                                parameters={"profile": profile, "out_dir": str(paths.root), "seed": seed},
                                progress_bar=False, stdout_file=sys.stdout if log_output else None,
                                stderr_file=sys.stderr if log_output else None)
        except PapermillExecutionError as e:
            _record_time(paths, timings, nb, t0, f"failed in cell {e.cell_index}")
            print(f"\nstudy FAILED in notebook {nb}.ipynb, cell {e.cell_index} (execution count {e.exec_count}): "
                  f"{e.ename}: {e.evalue}\n  executed notebook with the traceback: {paths.root / (nb + '.ipynb')}\n"
                  f"  fix it and resume with: scripts/main.sh --profile {profile} --out {paths.root}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through main()'s handler
            _record_time(paths, timings, nb, t0, "interrupted")
            print(f"\nstudy INTERRUPTED in notebook {nb}.ipynb (finished work is kept)\n  resume with: "
                  f"scripts/main.sh --profile {profile} --out {paths.root}", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        except DeadKernelError:
            _record_time(paths, timings, nb, t0, "kernel died")
            # no Python traceback exists: the kernel process itself was killed (most often by the kernel's OOM killer;
            # the cpu profile peaks at ~14 GB RSS during CF-GRPO)
            print(f"\nstudy FAILED in notebook {nb}.ipynb: its kernel died (killed from outside: out of memory? see "
                  f"`dmesg | grep -i oom`)\n  partial notebook: {paths.root / (nb + '.ipynb')}\n  free memory and resume with: "
                  f"scripts/main.sh --profile {profile} --out {paths.root}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        wall = _record_time(paths, timings, nb, t0)
        write_json(marker, {"key": key, "wall_s": wall, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")})
        print(f"[{nb}] done in {wall:.0f} s", flush=True)
    if set(NOTEBOOKS) <= {p.stem for p in paths.done.glob("*.json")}:
        write_summary(cfg, paths)
        print(f"summary: {paths.root / 'summary.md'}", flush=True)
    return paths.root


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lemon.study", description="Run the LEMON study (notebooks 01-04) with papermill; resumable.")
    p.add_argument("--profile", default="cpu", choices=PROFILES, help="smoke (CI, minutes) | cpu (2 cores, ~2 h) | paper (GPU)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--out", help="study folder (an existing one is resumed; default: a new outputs/<profile>-<timestamp>)")
    g.add_argument("--resume", action="store_true", help="resume the newest outputs/<profile>-* study")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="do not stream cell outputs to the console")
    a = p.parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    # `kill <pid>` (SIGTERM) stops the study like Ctrl-C: the notebook and the resume command are printed, and the
    # kernel is shut down by papermill's cleanup instead of being orphaned.
    old = signal.signal(signal.SIGTERM, _raise_interrupt) if main_thread else None
    try:
        run_study(a.profile, a.out, a.resume, seed=a.seed, log_output=not a.quiet)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
