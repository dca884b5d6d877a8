"""Run profiles as data: configs/profiles.yaml, one namespace for `scripts/main.sh` / `python -m lemon.study`, the
notebooks and `python -m lemon train`. A profile names a base preset (lemon.train.config: smoke, cpu, paper) and field
overrides of TrainConfig / SFTConfig / StudyConfig; `--set FIELD=VALUE` adds per-run overrides on top (dotted names reach
the nested configs: `train.max_steps=8`, `sft.questions=4`).

Here: reading and checking that file, parsing `--set` items, and applying overrides to frozen dataclasses with errors
that name the valid fields. Building the StudyConfig itself is lemon.study.config.study_preset."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import yaml

from lemon.train.config import PROFILES as BASES

PROFILES_FILE = Path(__file__).resolve().parents[2] / "configs" / "profiles.yaml"
_KEYS = {"base", "answers", "models", "measured", "train", "sft", "study"}


class ProfileError(ValueError):
    """A profiles file, profile name or --set item that cannot be used; the message says what would work."""


@dataclass(frozen=True)
class Profile:
    """One entry of configs/profiles.yaml."""

    name: str
    """Its key in the file (what --profile takes)."""
    base: str
    """Trainer / warm-start preset it starts from (lemon.train.config.PROFILES)."""
    answers: str = ""
    """The question the profile answers (README's profiles table)."""
    models: str = ""
    """Policy and workers, in words."""
    measured: str = ""
    """What a run took, where and when (or 'not run')."""
    train: dict = field(default_factory=dict)
    """TrainConfig field overrides."""
    sft: dict = field(default_factory=dict)
    """SFTConfig field overrides."""
    study: dict = field(default_factory=dict)
    """StudyConfig field overrides."""


def load_profiles(path: str | Path = PROFILES_FILE) -> dict[str, Profile]:
    """Every profile of the file, checked: known keys, a known base, mappings where overrides go."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(raw, dict) or not raw:
        raise ProfileError(f"{path}: expected a mapping of profile name -> profile")
    out = {}
    for name, entry in raw.items():
        if not isinstance(entry, dict):
            raise ProfileError(f"{path}: profile {name!r} must be a mapping with keys {sorted(_KEYS)}")
        bad = set(entry) - _KEYS
        if bad:
            raise ProfileError(f"{path}: profile {name!r} has unknown keys {sorted(bad)}; valid: {sorted(_KEYS)}")
        if entry.get("base") not in BASES:
            raise ProfileError(f"{path}: profile {name!r} needs base: one of {', '.join(BASES)} (got {entry.get('base')!r})")
        for k in ("train", "sft", "study"):
            if not isinstance(entry.get(k) or {}, dict):
                raise ProfileError(f"{path}: profile {name!r}: {k} must be a mapping of field -> value")
        out[str(name)] = Profile(name=str(name), **{k: (v or {}) if k in ("train", "sft", "study") else v
                                                     for k, v in entry.items()})
    return out


def get_profile(name: str, path: str | Path = PROFILES_FILE) -> Profile:
    profiles = load_profiles(path)
    if name not in profiles:
        raise ProfileError(f"unknown profile {name!r}; valid: {', '.join(profiles)} ({path})")
    return profiles[name]


def parse_value(text: str):
    """A --set value: JSON first (numbers, true/false, null, [lists], {maps}), then YAML (bare words, `[a, b]`), then
    float() (YAML 1.1 reads '1e-4' as a string)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    try:
        v = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return v
    return v


def parse_sets(items: Iterable[str]) -> dict:
    """['train.max_steps=8', 'eval_n=30'] -> {'train.max_steps': 8, 'eval_n': 30}."""
    out = {}
    for item in items or ():
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            raise ProfileError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set train.max_steps=8 or --set eval_n=30")
        out[key.strip()] = parse_value(val.strip())
    return out


def _coerce(current, value):
    """YAML / JSON lists become tuples where the field holds a tuple (every sequence field of the configs does)."""
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    return value


def apply_overrides(obj, overrides: dict, what: str = "config"):
    """`obj` (a frozen dataclass) with `overrides` ({field or 'nested.field': value}) applied through dataclasses.replace,
    so each config's __post_init__ checks the result. An unknown field is an error naming the valid ones."""
    if not overrides:
        return obj
    names = {f.name for f in dataclasses.fields(obj)}
    flat, nested = {}, {}
    for key, value in overrides.items():
        head, dot, rest = key.partition(".")
        if head not in names:
            raise ProfileError(f"{what} has no field {head!r} (from {key!r}); valid: {', '.join(sorted(names))}")
        if dot:
            if not dataclasses.is_dataclass(getattr(obj, head)):
                raise ProfileError(f"{what}.{head} is not a nested config: set it as {head}=VALUE, not {key!r}")
            nested.setdefault(head, {})[rest] = value
        else:
            flat[head] = _coerce(getattr(obj, head), value)
    for head, sub in nested.items():
        flat[head] = apply_overrides(flat.get(head, getattr(obj, head)), sub, f"{what}.{head}")
    return dataclasses.replace(obj, **flat)
