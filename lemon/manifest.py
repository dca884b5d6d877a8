"""Run manifests: everything needed to say what produced a number (git sha, config, data and model digests, prompts
hash, seeds, package versions). Written as `manifest.json` next to every results file."""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from lemon.report import portable
from lemon.run.models import SHIPPED, file_sha256
from lemon.run.servers import build_info, find_binary

PACKAGES = ("torch", "transformers", "trl", "peft", "llguidance", "openai", "PyYAML")


def git_sha(repo: Path | None = None) -> str:
    """HEAD's sha, with '+dirty' when the work tree has uncommitted changes to tracked files; 'unknown' outside git."""
    cwd = repo or Path(__file__).resolve().parents[1]
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha or "unknown") + ("+dirty" if dirty else "")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "not installed"
    try:  # the workers' llama-server: setup.sh's build record (source sha256 + cmake flags), not a pip package
        out["llama_server"] = build_info(find_binary()).get("key", "foreign binary (no setup.sh build record)")
    except Exception as e:  # noqa: BLE001 - a manifest must never fail for a missing optional binary
        out["llama_server"] = f"not found ({type(e).__name__})"
    return out


def build_manifest(config: dict, *, prompts_sha256: str, workers: dict, data_files: list[Path] = (),
                   seeds: dict | None = None, extra: dict | None = None) -> dict:
    """A JSON-able record of one run. Shipped models are named with the sha256 recorded in lemon.run.models. Paths are
    written without the machine's prefix (lemon.report.portable: repo-relative, `../`, `~/`), except in `config`, which
    stays exactly what the run compares on resume."""
    models = {}
    for cap, w in workers.items():
        name = w.get("model", "")
        models[cap] = {**w, **({"sha256": SHIPPED[name].sha256, "hf_id": SHIPPED[name].hf_id}
                               if name in SHIPPED else {})}
    record = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_sha(),
        "argv": sys.argv,
        "config": config,
        "prompts_sha256": prompts_sha256,
        "workers": models,
        "data": {str(Path(p).resolve()): file_sha256(Path(p)) for p in data_files if Path(p).is_file()},
        "seeds": seeds or {},
        "versions": versions(),
        **(extra or {}),
    }
    return {k: v if k == "config" else portable(v) for k, v in record.items()}


def write_json(path: Path, obj) -> None:
    """Write atomically (temp + rename) so a kill never leaves half a manifest."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    tmp.replace(path)
