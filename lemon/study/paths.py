"""The layout of one study folder (its own module so runner, plots and compare all read it without importing each
other)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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

    def variant_eval_dir(self, name: str, bench: str) -> Path:
        return self.variant(name) / "eval" / bench

    def eval_dir(self, method: str, bench: str) -> Path:
        return self.root / "eval" / method / bench

    def require(self, path: Path, notebook: str) -> Path:
        """`path`, or a FileNotFoundError naming the notebook that writes it (nothing is recomputed silently)."""
        if not Path(path).exists():
            raise FileNotFoundError(f"{path} is missing: run notebooks/{notebook}.ipynb first with "
                                    f"out_dir={str(self.root)!r} (or the whole study: scripts/main.sh --out "
                                    f"{self.root})")
        return Path(path)
