"""Run profiles as data: configs/profiles.yaml, one namespace for `scripts/main.sh` / `python -m lemon.study`, the
notebooks and `python -m lemon train`. A profile names a base preset (the file's `presets`, read by lemon.train.config)
and field overrides of TrainConfig / SFTConfig / StudyConfig; `--set FIELD=VALUE` adds per-run overrides on top (dotted
names reach the nested configs: `train.max_steps=8`, `sft.questions=4`).

Here: reading and checking the profiles of that file and parsing `--set` items (applying overrides to frozen dataclasses
is lemon.train.config.apply_overrides). Building the StudyConfig itself is lemon.study.config.study_preset."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import yaml

from lemon.train.config import PROFILES as BASES
# ProfileError and apply_overrides are re-exported for the study's callers
from lemon.train.config import PROFILES_FILE, ProfileError, apply_overrides, read_profiles_file  # noqa: F401

_KEYS = {"base", "answers", "models", "measured", "train", "sft", "study"}
PRESETS_KEY = "presets"  # the file's trainer / warm-start presets (lemon.train.config), not a profile


@dataclass(frozen=True)
class Profile:
    """One entry of configs/profiles.yaml."""

    name: str
    """Its key in the file (what --profile takes)."""
    base: str
    """Trainer / warm-start preset it starts from (a key of the file's `presets`, lemon.train.config.PROFILES)."""
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
    """Every profile of the file (each top-level key but `presets`, which lemon.train.config always reads from
    configs/profiles.yaml), checked: known keys, a known base, mappings where overrides go."""
    out = {}
    for name, entry in read_profiles_file(path).items():
        if name == PRESETS_KEY:
            continue
        if not isinstance(entry, dict):
            raise ProfileError(f"{path}: profile {name!r} must be a mapping with keys {sorted(_KEYS)}")
        bad = set(entry) - _KEYS
        if bad:
            raise ProfileError(f"{path}: profile {name!r} has unknown keys {sorted(bad)}; valid: {sorted(_KEYS)}")
        if entry.get("base") not in BASES:
            raise ProfileError(f"{path}: profile {name!r} needs base: one of {', '.join(BASES)} (got "
                               f"{entry.get('base')!r})")
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
