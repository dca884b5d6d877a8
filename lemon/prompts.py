"""The one prompts file (`lemon/prompts.yaml`), loaded into a frozen object that callers pass around explicitly.

Its sha256 is recorded in run manifests: two runs with the same prompts hash saw the same words.
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import yaml

DEFAULT_PATH = Path(__file__).with_name("prompts.yaml")
DOMAINS = ("math", "knowledge", "code")
CAPACITIES = ("small", "medium", "large")  # ordered cheap -> strong; m_L moves one step left


@dataclass(frozen=True)
class Prompts:
    """Parsed prompts file. `base_roles[domain][name] = default duty`; domain "common" is offered in every domain."""

    base_roles: Mapping[str, Mapping[str, str]]
    capacities: Mapping[str, Mapping[str, object]]
    orchestrator: Mapping[str, str]
    worker: Mapping[str, str]
    sha256: str
    path: str = field(default="")
    duty_variants: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def roles_for(self, domain: str | None = None) -> dict[str, str]:
        """name -> default duty of the base roles usable in `domain` (all roles when domain is None)."""
        if domain is not None and domain not in self.base_roles:
            raise ValueError(f"unknown domain {domain!r}; known: {sorted(self.base_roles)}")
        out: dict[str, str] = {}
        for d, roles in self.base_roles.items():
            if domain is None or d in ("common", domain):
                out.update(roles)
        return out

    def default_duty(self, base_role: str) -> str:
        return self.roles_for(None)[base_role]


def _freeze(obj):
    if isinstance(obj, dict):
        return MappingProxyType({k: _freeze(v) for k, v in obj.items()})
    return obj


def load_prompts(path: str | Path | None = None) -> Prompts:
    """Read and check a prompts file (default: the packaged one). Raises ValueError naming what is missing."""
    p = Path(path) if path is not None else DEFAULT_PATH
    raw = p.read_bytes()
    data = yaml.safe_load(raw)
    for key in ("base_roles", "capacities", "orchestrator", "worker"):
        if key not in data:
            raise ValueError(f"prompts file {p} lacks the top-level key {key!r}")
    if tuple(data["capacities"]) != CAPACITIES:
        raise ValueError(f"prompts file {p}: capacities must be {CAPACITIES} in that order, got "
                         f"{tuple(data['capacities'])}")
    seen: dict[str, str] = {}
    for dom, roles in data["base_roles"].items():
        for name in roles:
            if name in seen:
                raise ValueError(f"prompts file {p}: base role {name!r} appears in both {seen[name]!r} and {dom!r}")
            seen[name] = dom
    return Prompts(
        base_roles=_freeze(data["base_roles"]),
        capacities=_freeze(data["capacities"]),
        orchestrator=_freeze(data["orchestrator"]),
        worker=_freeze(data["worker"]),
        sha256=hashlib.sha256(raw).hexdigest(),
        path=str(p),
        duty_variants=MappingProxyType({k: tuple(v) for k, v in (data.get("duty_variants") or {}).items()}),
    )


@functools.lru_cache(maxsize=1)
def default_prompts() -> Prompts:
    """The packaged prompts file, read once (it is immutable package data, not mutable global state)."""
    return load_prompts()
