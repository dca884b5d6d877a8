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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import DataNotFoundError, UnknownBenchmarkError, UnknownSplitError
from .example import LETTERS, Example, FrozenMeta, _thaw, format_number, render_options  # noqa: F401  (re-exported)
from .records import HUMANEVAL_INSTRUCTION, RECORDS  # noqa: F401  (re-exported)

# every table below is derived from the one record per benchmark in records.py
BENCHMARKS: tuple[str, ...] = tuple(RECORDS)

#: Valid splits per benchmark (the canonical HF split names).
SPLITS: dict[str, tuple[str, ...]] = {n: r.splits for n, r in RECORDS.items()}

#: Canonical hub ids (and config) used by the ``datasets`` fallback.
HUB_IDS: dict[str, tuple[str, str | None]] = {n: r.hub_id for n, r in RECORDS.items()}


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

def row_to_example(name: str, split: str, index: int, row: Mapping[str, Any]) -> Example:
    if name not in RECORDS:
        raise UnknownBenchmarkError(name)
    return RECORDS[name].to_example(name, split, index, row)


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
