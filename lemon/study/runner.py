"""The user-facing study: notebooks 01 (data) -> 02 (SFT + CF-GRPO) -> 03 (ablations) -> 04 (evaluation), executed with
papermill into outputs/<profile>-<timestamp>/ by ONE command
(`scripts/main.sh --profile test|smoke|cpu|cpu-long|cpu-wide|paper [--out DIR | --resume]`).
Here: the folder layout and the runner (the config of each profile: lemon.study.config); what each notebook computes is
in lemon.study.stages, the plots and summary tables in lemon.study.plots; the notebooks orchestrate and display. Every
step resumes: notebooks that finished are skipped (a marker under .done/), and inside a notebook training resumes from
checkpoints and evaluation from results.jsonl.
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
from pathlib import Path

from lemon import benchmarks as B
from lemon.manifest import build_manifest, git_sha, write_json
from lemon.report import portable
from lemon.progress import TEXT_ENV
from lemon.prompts import default_prompts
from lemon.run.models import DEFAULT_LADDER, SHIPPED
from lemon.study.profiles import load_profiles, parse_sets
from lemon.study.paths import StudyPaths  # noqa: F401  (re-exported: notebooks import it from here)
from lemon.study.plots import write_summary
from lemon.study.config import (MATH, NOTEBOOKS, ORCHESTRATORS, STUDY_PROFILES, VARIANTS,  # noqa: F401  (re-exported)
                                StudyConfig, split_method, study_preset)

ROOT = Path(__file__).resolve().parents[2]


def resolve_out_dir(profile: str, out_dir: str | Path | None = None, resume: bool = False, *, root: Path = ROOT,
                    newest_ok: bool = False) -> Path:
    """`out_dir` when given; with `resume` (or `newest_ok` and one exists) the newest outputs/<profile>-<timestamp>;
    else a new timestamped folder (not created here)."""
    if out_dir:
        return Path(out_dir).resolve()
    runs = sorted(p for p in (root / "outputs").glob(f"{profile}-*")
                  if re.fullmatch(rf"{profile}-\d{{8}}-\d{{6}}", p.name))
    if runs and (resume or newest_ok):
        return runs[-1].resolve()
    if resume:
        raise FileNotFoundError(f"--resume: no earlier {profile} study under {root / 'outputs'}; run without --resume")
    return (root / "outputs" / f"{profile}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def setup(profile: str, out_dir: str, seed: int, sets: list[str] | tuple = (),
          workers: str = "") -> tuple[StudyConfig, StudyPaths]:
    """What every notebook's second cell calls: the config (profile, then `sets` = --set FIELD=VALUE items and
    `workers` = a --workers file, see study_preset), the paths (out_dir '' = the newest study of this profile, or a new
    one), with the config checked against the one the study folder was started with."""
    cfg = study_preset(profile, seed=seed, sets=parse_sets(sets), workers=workers or None)
    paths = StudyPaths(resolve_out_dir(profile, out_dir or None, newest_ok=True))
    write_config(cfg, paths)
    return cfg, paths


def write_config(cfg: StudyConfig, paths: StudyPaths) -> None:
    """config.json; a folder started with another config is refused (one folder = one experiment)."""
    guard_config(paths.root, cfg.to_dict(), "study",
                 "resume it with the same profile, seed and code, or choose another --out")


def guard_config(root: Path, config: dict, what: str, remedy: str) -> None:
    """<root>/config.json is written by the first run in a folder; a later run with another config is refused with the
    fields that differ and `remedy` (one folder = one experiment: never two configs' results mixed in one record)."""
    root.mkdir(parents=True, exist_ok=True)
    new = json.loads(json.dumps(config, default=str))
    p = root / "config.json"
    old = json.loads(p.read_text()) if p.exists() else new
    if old != new:
        diff = sorted(_diff(old, new))
        raise ValueError(f"{root} holds a {what} with a different config ({'; '.join(diff[:6])}); {remedy}")
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
    workers = cfg.train.workers or {c: {"backend": "llama_cpp", "model": m} for c, m in DEFAULT_LADDER.items()}
    workers = {c: {k: v for k, v in w.items() if k in ("backend", "model", "base_url")} for c, w in workers.items()}
    root = B.resolve_data_dir()
    files = sorted({root / b / f"{B.POOL_SPLITS[w][b]}.jsonl" for b in B.BENCHMARKS for w in ("train", "eval")})
    pol = cfg.train.policy.model
    return build_manifest(cfg.to_dict(), prompts_sha256=default_prompts().sha256, workers=workers, data_files=files,
                          seeds={"study": cfg.seed, "train": cfg.train.seed, "sft": cfg.sft.seed, "eval": cfg.seed},
                          extra={"policy": {"model": pol,
                                            **({"sha256": SHIPPED[pol].sha256} if pol in SHIPPED else {})},
                                 "protocol": cfg.protocol, "data_dir": str(root)})


def _record_time(paths: StudyPaths, timings: dict, nb: str, t0: float, stopped: str | None = None) -> float:
    """Append one execution of `nb` to timings.json: seconds for a finished one, {"s", "stopped"} for one that failed or
    was interrupted, so a study's total wall time counts the work that was lost too (a SIGKILLed runner records
    nothing)."""
    wall = round(time.perf_counter() - t0, 1)
    prev = timings.get(nb) or []
    timings[nb] = [*(prev if isinstance(prev, list) else [prev]),
                   wall if stopped is None else {"s": wall, "stopped": stopped}]
    write_json(paths.root / "timings.json", timings)
    return wall


def run_study(profile: str, out_dir: str | Path | None = None, resume: bool = False, *, seed: int = 0,
              sets: list[str] | tuple = (), workers: str = "", notebooks: tuple[str, ...] = NOTEBOOKS,
              log_output: bool = True) -> Path:
    """Execute the notebooks in order with papermill into the study folder; a notebook that finished with the same
    source and config is skipped. A failing cell stops the study: the notebook, cell and error are printed, exit status
    1."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError
    from nbclient.exceptions import DeadKernelError
    paths = StudyPaths(resolve_out_dir(profile, out_dir, resume))
    cfg = study_preset(profile, seed=seed, sets=parse_sets(sets), workers=workers or None)
    print(f"LEMON study, profile {profile}, seed {seed}{''.join(f', --set {x}' for x in sets)}"
          f"{f', --workers {workers}' if workers else ''}: {paths.root}", flush=True)
    write_config(cfg, paths)
    # the resume command repeats every option that shaped the config (a folder refuses another config)
    again = (f"scripts/main.sh --profile {profile} --out {paths.root} --seed {seed}"
             + "".join(f" --set {x}" for x in sets)
             + (f" --workers {workers}" if workers else ""))
    mp = paths.root / "manifest.json"
    man = json.loads(mp.read_text()) if mp.exists() else study_manifest(cfg)
    if mp.exists():
        man.setdefault("resumed", []).append({"at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_sha(),
                                              "argv": portable(sys.argv)})
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
                                parameters={"profile": profile, "out_dir": str(paths.root), "seed": seed,
                                            "sets": list(sets), "workers": str(workers or "")},
                                progress_bar=False, stdout_file=sys.stdout if log_output else None,
                                stderr_file=sys.stderr if log_output else None)
        except PapermillExecutionError as e:
            _record_time(paths, timings, nb, t0, f"failed in cell {e.cell_index}")
            print(f"\nstudy FAILED in notebook {nb}.ipynb, cell {e.cell_index} (execution count {e.exec_count}): "
                  f"{e.ename}: {e.evalue}\n  executed notebook with the traceback: {paths.root / (nb + '.ipynb')}\n"
                  f"  fix it and resume with: {again}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through main()'s handler
            _record_time(paths, timings, nb, t0, "interrupted")
            print(f"\nstudy INTERRUPTED in notebook {nb}.ipynb (finished work is kept)\n  resume with: "
                  f"{again}", file=sys.stderr, flush=True)
            raise SystemExit(130) from None
        except DeadKernelError:
            _record_time(paths, timings, nb, t0, "kernel died")
            # no Python traceback exists: the kernel process itself was killed (most often by the kernel's OOM killer;
            # the cpu profile peaks at ~14 GB RSS during CF-GRPO)
            print(f"\nstudy FAILED in notebook {nb}.ipynb: its kernel died (killed from outside: out of memory? see "
                  f"`dmesg | grep -i oom`)\n  partial notebook: {paths.root / (nb + '.ipynb')}\n  free memory and "
                  f"resume with: {again}", file=sys.stderr, flush=True)
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
    p = argparse.ArgumentParser(prog="python -m lemon.study",
                                description="Run the LEMON study (notebooks 01-04) with papermill; resumable.")
    p.add_argument("--profile", default="cpu", choices=list(STUDY_PROFILES),
                   help="; ".join(f"{n}: {pr.answers}" for n, pr in load_profiles().items())
                   + " (configs/profiles.yaml)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--out", help="study folder (an existing one is resumed; default: a new "
                                 "outputs/<profile>-<timestamp>)")
    g.add_argument("--resume", action="store_true", help="resume the newest outputs/<profile>-* study")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a StudyConfig field (train.FIELD / sft.FIELD: the trainer's / warm start's), e.g. "
                        "--set eval_n=30 --set train.max_steps=8; repeatable (configs/profiles.yaml lists "
                        "each profile's)")
    p.add_argument("--workers", default="", help="YAML/JSON worker-pool file replacing the profile's workers, e.g. "
                                                 "configs/workers-paper.yaml")
    p.add_argument("--quiet", action="store_true", help="do not stream cell outputs to the console")
    a = p.parse_args(argv)
    main_thread = threading.current_thread() is threading.main_thread()
    # `kill <pid>` (SIGTERM) stops the study like Ctrl-C: the notebook and the resume command are printed, and the
    # kernel is shut down by papermill's cleanup instead of being orphaned.
    old = signal.signal(signal.SIGTERM, _raise_interrupt) if main_thread else None
    try:
        run_study(a.profile, a.out, a.resume, seed=a.seed, sets=a.set, workers=a.workers, log_output=not a.quiet)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, old)
    return 0


if __name__ == "__main__":
    sys.exit(main())
