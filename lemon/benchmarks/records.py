"""One record per benchmark: its domain, answer kind, splits, hub id, which splits feed the training and the
evaluation pools, and how a data row becomes an Example. Adding a benchmark = one BenchmarkRecord in RECORDS (plus its
row converter and its data at <data dir>/<name>/<split>.jsonl); data.py, registry.py and pools.py derive every table
from RECORDS (tests/test_benchmarks.py adds a toy one). A new answer kind needs code in answers.py / registry.py; a new
domain, its base roles in lemon/prompts.yaml. Pool rules beyond a split (HumanEval's 40 training problems, the peers'
MMLU sample) stay in pools.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

from .example import LETTERS, Example, format_number, render_options

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function so that it satisfies its docstring. "
    "Keep the given signature.\n\n"
)
_AQUA_OPTION = re.compile(r"^\s*([A-E])\s*\)\s*(.*?)\s*$", re.S)


@dataclass(frozen=True)
class BenchmarkRecord:
    """Everything LEMON knows of one benchmark."""

    name: str
    """Its key everywhere (configs, ids `<name>/<split>/<index>`, data folder)."""
    domain: str
    """math | knowledge | code: picks the base roles and reply caps (lemon/prompts.yaml, lemon.run.executor)."""
    kind: str
    """number | letter | code: how a final answer is extracted and scored (registry.Benchmark)."""
    splits: tuple[str, ...]
    """Valid splits (the canonical hub split names)."""
    hub_id: tuple[str, str | None]
    """(hub dataset id, config) for the `datasets` fallback when no local mirror exists."""
    train_split: str
    """The split its TRAINING pool comes from (lemon.benchmarks.pools)."""
    eval_split: str
    """The split its EVALUATION pool comes from."""
    to_example: Callable[[str, str, int, Mapping[str, Any]], Example]
    """(name, split, index in file order, row) -> Example."""
    letters: str = ""
    """Option letters of a letter-kind benchmark."""


def _id(name: str, split: str, index: int) -> str:
    return f"{name}/{split}/{index}"


def _gsm8k(name, split, index, row) -> Example:
    return Example(_id(name, split, index), name, split, row["question"].strip(),
                   format_number(row["answer"].split("####")[-1]), {"solution": row["answer"]})


def _multiarith(name, split, index, row) -> Example:
    return Example(_id(name, split, index), name, split, row["question"].strip(), format_number(row["final_ans"]), {})


def _svamp(name, split, index, row) -> Example:
    question = f"{row['Body'].strip()} {row['Question'].strip()}"
    return Example(_id(name, split, index), name, split, question, format_number(row["Answer"]),
                   {"svamp_id": row["ID"], "equation": row["Equation"], "type": row["Type"]})


def _aqua(name, split, index, row) -> Example:
    ex_id, opts = _id(name, split, index), []
    for i, raw in enumerate(row["options"]):
        m = _AQUA_OPTION.match(raw)
        if not m or m.group(1) != LETTERS[i]:
            raise ValueError(f"{ex_id}: unparseable AQuA option {raw!r}")
        opts.append(m.group(2))
    options = tuple(opts)
    return Example(ex_id, name, split, render_options(row["question"], options), row["correct"].strip().upper(),
                   {"options": options, "stem": row["question"], "rationale": row.get("rationale", "")})


def _mmlu(name, split, index, row) -> Example:
    options = tuple(str(c) for c in row["choices"])
    return Example(_id(name, split, index), name, split, render_options(row["question"], options),
                   LETTERS[int(row["answer"])],
                   {"options": options, "stem": row["question"], "subject": row["subject"]})


def _humaneval(name, split, index, row) -> Example:
    return Example(row["task_id"], name, split, HUMANEVAL_INSTRUCTION + row["prompt"], row["canonical_solution"],
                   {"task_id": row["task_id"], "prompt": row["prompt"], "test": row["test"],
                    "entry_point": row["entry_point"]})


# AQuA's train split exists on the hub but is not mirrored locally (shared/data/README.md), so it needs `datasets`.
RECORDS: dict[str, BenchmarkRecord] = {r.name: r for r in (
    BenchmarkRecord("gsm8k", "math", "number", ("train", "test"), ("openai/gsm8k", "main"), "train", "test", _gsm8k),
    BenchmarkRecord("multiarith", "math", "number", ("train", "test"), ("ChilleD/MultiArith", None), "train", "test",
                    _multiarith),
    BenchmarkRecord("svamp", "math", "number", ("train", "test"), ("ChilleD/SVAMP", None), "train", "test", _svamp),
    BenchmarkRecord("aqua", "math", "letter", ("train", "validation", "test"), ("deepmind/aqua_rat", "raw"),
                    "validation", "test", _aqua, "ABCDE"),
    BenchmarkRecord("mmlu", "knowledge", "letter", ("dev", "validation", "test"), ("cais/mmlu", "all"), "dev",
                    "validation", _mmlu, "ABCD"),
    # HumanEval has one split: pools.py cuts it into 40 training and 124 evaluation problems
    BenchmarkRecord("humaneval", "code", "code", ("test",), ("openai/openai_humaneval", None), "test", "test",
                    _humaneval),
)}
