"""A benchmark item (Example, with its immutable meta) and the formatting the row converters share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator

LETTERS = "ABCDE"


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
