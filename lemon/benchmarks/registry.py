"""The benchmarks (one record each in records.py): domain, final-answer convention, extraction and scoring."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .answers import extract_letter, extract_number, numbers_match
from .data import Example, check_name, load
from .humaneval import extract_code, score_humaneval
from .records import RECORDS, BenchmarkRecord

NUMBER_CONVENTION = (
    "End your reply with a final line of the form 'Answer: <number>' "
    "(just the number: no units, no commas).")
LETTER_CONVENTION = (
    "End your reply with a final line of the form 'Answer: <letter>', where <letter> "
    "is one of {letters}.")
CODE_CONVENTION = (
    "Reply with the complete Python function (its signature, any imports and helper "
    "functions it needs, and its body) in a single ```python code block.")


def _letters_phrase(letters: str) -> str:
    return ", ".join(letters[:-1]) + f" or {letters[-1]}"


@dataclass(frozen=True)
class Benchmark:
    """A benchmark: ``kind`` is ``"number"``, ``"letter"`` or ``"code"``."""

    name: str
    domain: str
    kind: str
    answer_convention: str
    splits: tuple[str, ...]
    hub_id: tuple[str, str | None]
    letters: str = ""

    def extract_answer(self, text: str | None, example: Example | None = None) -> str | None:
        """The final answer in ``text`` as a normalised string, or ``None``.

        numbers: canonical number string ("1000", "0.75"); letters: "A".."E" (pass the
        ``example`` to also map an option's text to its letter); code: the extracted code.
        """
        if self.kind == "number":
            return extract_number(text)
        if self.kind == "letter":
            options = example.meta.get("options", ()) if example is not None else ()
            return extract_letter(text, options, self.letters)
        if self.kind == "code":
            if not text or not str(text).strip():
                return None
            entry = example.meta.get("entry_point") if example is not None else None
            return extract_code(str(text), entry)
        raise AssertionError(self.kind)

    def score(self, example: Example, text: str | None, **kw: Any) -> float:
        """1.0 if ``text`` answers ``example`` correctly, else 0.0.

        For ``humaneval`` this runs code in :mod:`lemon.run.sandbox` (``limits=`` may be
        passed through as a keyword).
        """
        if example.benchmark != self.name:
            raise ValueError(f"example {example.id!r} belongs to {example.benchmark!r}, "
                             f"not {self.name!r}")
        if self.kind == "code":
            return score_humaneval(example, text or "", kw.get("limits"))
        pred = self.extract_answer(text, example)
        if pred is None:
            return 0.0
        if self.kind == "number":
            return 1.0 if numbers_match(pred, example.gold) else 0.0
        return 1.0 if pred == example.gold.strip().upper() else 0.0

    def load(self, split: str, limit: int | None = None, seed: int = 0,
             data_dir: str | os.PathLike | None = None) -> list[Example]:
        return load(self.name, split, limit=limit, seed=seed, data_dir=data_dir)


def _make(r: BenchmarkRecord) -> Benchmark:
    if r.kind == "number":
        conv = NUMBER_CONVENTION
    elif r.kind == "letter":
        conv = LETTER_CONVENTION.format(letters=_letters_phrase(r.letters))
    elif r.kind == "code":
        conv = CODE_CONVENTION
    else:
        raise ValueError(f"benchmark {r.name!r}: unknown answer kind {r.kind!r} (number, letter or code; a "
                         "new kind needs code here and in answers.py)")
    return Benchmark(r.name, r.domain, r.kind, conv, r.splits, r.hub_id, r.letters)


REGISTRY: dict[str, Benchmark] = {n: _make(r) for n, r in RECORDS.items()}  # one record per benchmark: records.py


def get_benchmark(name: str) -> Benchmark:
    """The :class:`Benchmark` called ``name``; raises ``UnknownBenchmarkError``."""
    return REGISTRY[check_name(name)]


def score(example: Example, text: str | None, **kw: Any) -> float:
    """Score ``text`` against ``example`` with its own benchmark's rules."""
    return get_benchmark(example.benchmark).score(example, text, **kw)


def extract_answer(benchmark: str, text: str | None,
                   example: Example | None = None) -> str | None:
    return get_benchmark(benchmark).extract_answer(text, example)
