"""Benchmark examples and loading.

Rows come from the JSONL mirrors described in ``shared/data/README.md``
(``<data_dir>/<name>/<split>.jsonl``, field names as in the canonical Hugging Face
datasets). When no mirror file is found, the canonical hub dataset is loaded with
``datasets.load_dataset`` (imported lazily); if that fails too, :class:`DataNotFoundError`
names both places tried.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from .errors import DataNotFoundError, UnknownBenchmarkError, UnknownSplitError

BENCHMARKS: tuple[str, ...] = ("gsm8k", "multiarith", "svamp", "aqua", "mmlu", "humaneval")

#: Valid splits per benchmark (the canonical HF split names). ``aqua/train`` exists on
#: the hub but is not mirrored locally (see the data README), so it needs ``datasets``.
SPLITS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("train", "test"),
    "multiarith": ("train", "test"),
    "svamp": ("train", "test"),
    "aqua": ("train", "validation", "test"),
    "mmlu": ("dev", "validation", "test"),
    "humaneval": ("test",),
}

#: Canonical hub ids (and config) used by the ``datasets`` fallback.
HUB_IDS: dict[str, tuple[str, str | None]] = {
    "gsm8k": ("openai/gsm8k", "main"),
    "multiarith": ("ChilleD/MultiArith", None),
    "svamp": ("ChilleD/SVAMP", None),
    "aqua": ("deepmind/aqua_rat", "raw"),
    "mmlu": ("cais/mmlu", "all"),
    "humaneval": ("openai/openai_humaneval", None),
}

LETTERS = "ABCDE"

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function so that it satisfies its docstring. "
    "Keep the given signature.\n\n"
)


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return FrozenMeta(value)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(_freeze(v) for v in value)
    return value


class FrozenMeta(Mapping):
    """Immutable, hashable, picklable mapping (lists are stored as tuples)."""

    __slots__ = ("_d",)

    def __init__(self, data: Mapping | None = None, **kw: Any) -> None:
        d = dict(data or {}, **kw)
        object.__setattr__(self, "_d", {k: _freeze(v) for k, v in d.items()})

    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._d.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self._d) == dict(other)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("FrozenMeta is immutable")

    def __reduce__(self):
        return (FrozenMeta, (dict(self._d),))

    def __repr__(self) -> str:
        return f"FrozenMeta({self._d!r})"


@dataclass(frozen=True)
class Example:
    """One benchmark item.

    ``question`` is the worker-facing task text; ``gold`` is the reference answer as a
    string (canonical number, option letter, or for HumanEval the canonical solution
    body); ``meta`` holds benchmark-specific fields (options, subject, prompt/test/...).
    """

    id: str
    benchmark: str
    split: str
    question: str
    gold: str
    meta: FrozenMeta = field(default_factory=FrozenMeta)

    def __post_init__(self) -> None:
        if not isinstance(self.meta, FrozenMeta):
            object.__setattr__(self, "meta", FrozenMeta(self.meta))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "benchmark": self.benchmark, "split": self.split,
                "question": self.question, "gold": self.gold, "meta": _thaw(self.meta)}


def _thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


# --------------------------------------------------------------------------- names

def check_name(name: str) -> str:
    key = str(name).strip().lower()
    if key not in SPLITS:
        raise UnknownBenchmarkError(
            f"unknown benchmark {name!r}; valid benchmarks: {', '.join(BENCHMARKS)}")
    return key


def check_split(name: str, split: str) -> str:
    name = check_name(name)
    if split not in SPLITS[name]:
        raise UnknownSplitError(
            f"unknown split {split!r} for benchmark {name!r}; valid splits: "
            f"{', '.join(SPLITS[name])}")
    return split


# --------------------------------------------------------------------------- rows -> Example

def format_number(value: float | int | str) -> str:
    """Canonical string for a numeric gold: ``145.0 -> '145'``, ``'1,080' -> '1080'``."""
    text = str(value).replace(",", "").strip()
    num = float(text)
    if num.is_integer():
        return str(int(num))
    return repr(num)


def render_options(question: str, options: tuple[str, ...]) -> str:
    lines = [f"{LETTERS[i]}) {opt}" for i, opt in enumerate(options)]
    return question.strip() + "\n\n" + "\n".join(lines)


_AQUA_OPTION = re.compile(r"^\s*([A-E])\s*\)\s*(.*?)\s*$", re.S)


def row_to_example(name: str, split: str, index: int, row: Mapping[str, Any]) -> Example:
    ex_id = f"{name}/{split}/{index}"
    if name == "gsm8k":
        gold = format_number(row["answer"].split("####")[-1])
        return Example(ex_id, name, split, row["question"].strip(), gold,
                       {"solution": row["answer"]})
    if name == "multiarith":
        return Example(ex_id, name, split, row["question"].strip(),
                       format_number(row["final_ans"]), {})
    if name == "svamp":
        question = f"{row['Body'].strip()} {row['Question'].strip()}"
        return Example(ex_id, name, split, question, format_number(row["Answer"]),
                       {"svamp_id": row["ID"], "equation": row["Equation"],
                        "type": row["Type"]})
    if name == "aqua":
        opts = []
        for i, raw in enumerate(row["options"]):
            m = _AQUA_OPTION.match(raw)
            if not m or m.group(1) != LETTERS[i]:
                raise ValueError(f"{ex_id}: unparseable AQuA option {raw!r}")
            opts.append(m.group(2))
        options = tuple(opts)
        return Example(ex_id, name, split, render_options(row["question"], options),
                       row["correct"].strip().upper(),
                       {"options": options, "stem": row["question"],
                        "rationale": row.get("rationale", "")})
    if name == "mmlu":
        options = tuple(str(c) for c in row["choices"])
        return Example(ex_id, name, split, render_options(row["question"], options),
                       LETTERS[int(row["answer"])],
                       {"options": options, "stem": row["question"],
                        "subject": row["subject"]})
    if name == "humaneval":
        return Example(row["task_id"], name, split,
                       HUMANEVAL_INSTRUCTION + row["prompt"], row["canonical_solution"],
                       {"task_id": row["task_id"], "prompt": row["prompt"],
                        "test": row["test"], "entry_point": row["entry_point"]})
    raise UnknownBenchmarkError(name)


# --------------------------------------------------------------------------- loading

def default_data_dir() -> Path:
    """``$LEMON_DATA_DIR`` if set, else ``<repo root>/../shared/data`` (resolved)."""
    env = os.environ.get("LEMON_DATA_DIR")
    if env:
        return Path(env).expanduser().resolve()
    return (Path(__file__).resolve().parents[2] / ".." / "shared" / "data").resolve()


def resolve_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    if data_dir is not None:
        return Path(data_dir).expanduser().resolve()
    return default_data_dir()


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _read_hub(name: str, split: str) -> list[dict]:
    import datasets  # lazy: optional dependency

    hub_id, config = HUB_IDS[name]
    ds = datasets.load_dataset(hub_id, config, split=split) if config else \
        datasets.load_dataset(hub_id, split=split)
    return [dict(r) for r in ds]


@functools.lru_cache(maxsize=64)
def _load_cached(name: str, split: str, data_dir: str) -> tuple[Example, ...]:
    path = Path(data_dir) / name / f"{split}.jsonl"
    if path.is_file():
        rows = _read_jsonl(path)
    else:
        try:
            rows = _read_hub(name, split)
        except Exception as exc:  # ImportError, network/hub errors, missing split...
            hub_id, config = HUB_IDS[name]
            where = f"{hub_id}" + (f" (config {config!r})" if config else "")
            raise DataNotFoundError(
                f"no data for {name}/{split}: local file {path} does not exist and the "
                f"Hugging Face fallback datasets.load_dataset({where}, split={split!r}) "
                f"failed: {type(exc).__name__}: {exc}. Set LEMON_DATA_DIR or pass "
                f"data_dir=...") from exc
    return tuple(row_to_example(name, split, i, r) for i, r in enumerate(rows))


def load(name: str, split: str, limit: int | None = None, seed: int = 0,
         data_dir: str | os.PathLike | None = None) -> list[Example]:
    """Load ``name``/``split`` as a list of :class:`Example`.

    ``limit=None`` returns every row in file order. With ``limit=N`` the rows are
    shuffled with ``random.Random(seed).shuffle`` (on a copy, in file order) and the
    first ``N`` are returned, so a smaller limit is always a prefix of a larger one
    for the same seed.
    """
    name = check_name(name)
    check_split(name, split)
    examples = list(_load_cached(name, split, str(resolve_data_dir(data_dir))))
    if limit is None:
        return examples
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    random.Random(seed).shuffle(examples)
    return examples[:limit]


def available_splits(name: str, data_dir: str | os.PathLike | None = None) -> list[str]:
    """Splits of ``name`` that have a local JSONL mirror file."""
    name = check_name(name)
    root = resolve_data_dir(data_dir)
    return [s for s in SPLITS[name] if (root / name / f"{s}.jsonl").is_file()]


def clear_cache() -> None:
    _load_cached.cache_clear()
