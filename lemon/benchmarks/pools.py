"""Disjoint training / evaluation pools.

Protocol ``"paper"``:

* train: GSM8K train, MultiArith train, SVAMP train, AQuA validation, MMLU dev, and 40
  fixed HumanEval problems;
* eval: GSM8K / MultiArith / SVAMP / AQuA test, MMLU validation (all 1531, as in the
  paper) and the other 124 HumanEval problems.

The 40 HumanEval training problems: task ids in natural (numeric) order
``HumanEval/0 .. HumanEval/163``, shuffled with ``random.Random(0).shuffle``; the first
40 are train, the remaining 124 eval.

Protocol ``"peers"``: as ``"paper"`` except that MMLU eval is 153 validation items,
``random.Random(888).sample(<the 1531 validation examples in file order>, 153)`` (in
that sample order), as used by the peer methods we compare against.

Disjointness: ids never collide (they carry the split; HumanEval task ids are
partitioned). Text: upstream MultiArith has 6 question strings in both its train and
test split, so train items whose normalised question (lower-case, whitespace collapsed)
also occurs in the same benchmark's eval pool are dropped; :func:`dropped_counts`
reports how many per benchmark.
"""

from __future__ import annotations

import os
import random
import re

from .data import BENCHMARKS, Example, check_name, load
from .records import RECORDS

PROTOCOLS: tuple[str, ...] = ("paper", "peers")
WHICH: tuple[str, ...] = ("train", "eval")

POOL_SPLITS: dict[str, dict[str, str]] = {  # from the one record per benchmark (records.py)
    "train": {n: r.train_split for n, r in RECORDS.items()},
    "eval": {n: r.eval_split for n, r in RECORDS.items()},
}

HUMANEVAL_TRAIN_SIZE = 40
HUMANEVAL_SPLIT_SEED = 0
PEERS_MMLU_SIZE = 153
PEERS_MMLU_SEED = 888


def normalize_question(text: str) -> str:
    """Lower-case and collapse whitespace (the key used for text-level disjointness)."""
    return " ".join(str(text).lower().split())


def _check(which: str, protocol: str) -> None:
    if which not in WHICH:
        raise ValueError(f"unknown pool {which!r}; valid: {', '.join(WHICH)}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; valid: {', '.join(PROTOCOLS)}")


def _humaneval_index(task_id: str) -> int:
    m = re.search(r"(\d+)$", task_id)
    return int(m.group(1)) if m else -1


def humaneval_train_ids(data_dir: str | os.PathLike | None = None) -> tuple[str, ...]:
    """The 40 HumanEval task ids used for training (see module docstring)."""
    ids = sorted((ex.id for ex in load("humaneval", "test", data_dir=data_dir)),
                 key=lambda t: (_humaneval_index(t), t))
    random.Random(HUMANEVAL_SPLIT_SEED).shuffle(ids)
    return tuple(ids[:HUMANEVAL_TRAIN_SIZE])


def _raw_pool(name: str, which: str, protocol: str,
              data_dir: str | os.PathLike | None) -> list[Example]:
    examples = load(name, POOL_SPLITS[which][name], data_dir=data_dir)
    if name == "humaneval":
        train_ids = set(humaneval_train_ids(data_dir))
        keep = (lambda ex: ex.id in train_ids) if which == "train" else \
            (lambda ex: ex.id not in train_ids)
        return [ex for ex in examples if keep(ex)]
    if name == "mmlu" and which == "eval" and protocol == "peers":
        return random.Random(PEERS_MMLU_SEED).sample(examples, PEERS_MMLU_SIZE)
    return examples


def _dedupe(name: str, protocol: str, data_dir: str | os.PathLike | None
            ) -> tuple[list[Example], list[Example]]:
    train = _raw_pool(name, "train", protocol, data_dir)
    eval_texts = {normalize_question(ex.question)
                  for ex in _raw_pool(name, "eval", protocol, data_dir)}
    kept = [ex for ex in train if normalize_question(ex.question) not in eval_texts]
    dropped = [ex for ex in train if normalize_question(ex.question) in eval_texts]
    return kept, dropped


def pool(name: str, which: str, protocol: str = "paper",
         data_dir: str | os.PathLike | None = None) -> list[Example]:
    """The ``which`` (``"train"``/``"eval"``) pool of one benchmark under ``protocol``.

    Train pools exclude items whose normalised text occurs in the eval pool.
    """
    name = check_name(name)
    _check(which, protocol)
    if which == "eval":
        return _raw_pool(name, "eval", protocol, data_dir)
    return _dedupe(name, protocol, data_dir)[0]


def train_pool(protocol: str = "paper", benchmarks: tuple[str, ...] | list[str] = BENCHMARKS,
               data_dir: str | os.PathLike | None = None) -> dict[str, list[Example]]:
    """``{benchmark: train examples}`` for ``benchmarks``."""
    return {check_name(b): pool(b, "train", protocol, data_dir) for b in benchmarks}


def eval_pool(protocol: str = "paper", benchmarks: tuple[str, ...] | list[str] = BENCHMARKS,
              data_dir: str | os.PathLike | None = None) -> dict[str, list[Example]]:
    """``{benchmark: evaluation examples}`` for ``benchmarks``."""
    return {check_name(b): pool(b, "eval", protocol, data_dir) for b in benchmarks}


def dropped_counts(protocol: str = "paper",
                   benchmarks: tuple[str, ...] | list[str] = BENCHMARKS,
                   data_dir: str | os.PathLike | None = None) -> dict[str, int]:
    """How many train items were dropped per benchmark for overlapping eval text."""
    _check("train", protocol)
    return {check_name(b): len(_dedupe(check_name(b), protocol, data_dir)[1])
            for b in benchmarks}


def dropped_examples(name: str, protocol: str = "paper",
                     data_dir: str | os.PathLike | None = None) -> list[Example]:
    """The train examples of ``name`` dropped for overlapping eval text."""
    _check("train", protocol)
    return _dedupe(check_name(name), protocol, data_dir)[1]
