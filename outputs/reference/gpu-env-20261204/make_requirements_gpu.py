"""Turn pip's dry-run report of requirements-gpu.in into the hashed requirements-gpu.txt (+ resolved.txt beside this file).

    python3.12 -m venv $TMPDIR/gpuresolve && $TMPDIR/gpuresolve/bin/pip install -U pip
    $TMPDIR/gpuresolve/bin/python outputs/reference/gpu-env-20261204/make_requirements_gpu.py --print-command  # run what it prints
    $TMPDIR/gpuresolve/bin/python outputs/reference/gpu-env-20261204/make_requirements_gpu.py report.json [DATE]

Each package gets the sha256 of EVERY wheel of its resolved version that CPython 3.12 on manylinux x86_64 can install (from
PyPI's JSON simple index), not only the file the dry run picked: pip on a machine with another glibc may pick another wheel
of the same version (cryptography, debugpy, ... publish several), and --require-hashes would refuse it otherwise.
Uses pip's vendored `packaging` (run it with the resolver venv's python). Only PyPI's simple index is queried.
"""
import json
import sys
import time
import urllib.request
from pathlib import Path

from pip._vendor.packaging import tags
from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
PLATS_RESOLVE = [f"manylinux_2_{v}_x86_64" for v in range(35, 16, -1)] + ["manylinux2014_x86_64"]
COMMAND = ("PIP_CONFIG_FILE=/dev/null $TMPDIR/gpuresolve/bin/python -m pip install --isolated --dry-run --ignore-installed "
           "--report report.json --python-version 3.12 --implementation cp --abi cp312 "
           + " ".join(f"--platform {p}" for p in PLATS_RESOLVE)
           + " --only-binary=:all: --use-feature=fast-deps --index-url https://pypi.org/simple -r requirements-gpu.in")
PLATS_HASH = [f"manylinux_2_{v}_x86_64" for v in range(45, 4, -1)] + ["manylinux2014_x86_64", "manylinux2010_x86_64",
                                                                         "manylinux1_x86_64"]
OK_TAGS = set(tags.cpython_tags(python_version=(3, 12), abis=["cp312"], platforms=PLATS_HASH)) | set(
    tags.compatible_tags(python_version=(3, 12), interpreter="cp312", platforms=PLATS_HASH))


def index_files(name: str) -> list[dict]:
    url = f"https://pypi.org/simple/{canonicalize_name(name)}/"
    for attempt in range(4):
        try:
            req = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
            return json.load(urllib.request.urlopen(req, timeout=60))["files"]
        except OSError as e:
            print(f"retry {url}: {e}", file=sys.stderr)
            time.sleep(2 + 3 * attempt)
    raise SystemExit(f"cannot read {url}")


def wheel_hashes(entry: dict) -> list[str]:
    chosen_file = entry["download_info"]["url"].rsplit("/", 1)[-1]
    chosen = entry["download_info"]["archive_info"]["hashes"]["sha256"]
    version = parse_wheel_filename(chosen_file)[1]
    hs = {chosen}
    for f in index_files(entry["metadata"]["name"]):
        fn = f["filename"]
        if not fn.endswith(".whl") or f.get("yanked"):
            continue
        try:
            _, v, _, t = parse_wheel_filename(fn)
        except Exception:  # pre-PEP 427 names on old releases
            continue
        if v == version and t & OK_TAGS:
            hs.add(f["hashes"]["sha256"])
    return sorted(hs)


def main():
    if sys.argv[1:] == ["--print-command"]:
        print(COMMAND)
        return
    report = json.load(open(sys.argv[1]))
    date = sys.argv[2] if len(sys.argv) > 2 else time.strftime("%Y-%m-%d")
    entries = sorted(report["install"], key=lambda e: canonicalize_name(e["metadata"]["name"]))
    not_wheels = [e["download_info"]["url"] for e in entries if not e["download_info"]["url"].endswith(".whl")]
    if not_wheels:
        raise SystemExit(f"sdist-only packages (the dry run used --only-binary=:all:, so this should not happen): {not_wheels}")
    head = [
        f"# GPU / paper-profile environment (.venv-gpu): Linux x86_64, CPython 3.12, glibc >= 2.31, NVIDIA driver for CUDA 13.",
        f"# GENERATED {date} from requirements-gpu.in by pip {report['pip_version']}'s dry-run resolution (metadata only) and",
        "# outputs/reference/gpu-env-20261204/make_requirements_gpu.py (hashes: every cp312 manylinux x86_64 wheel of each version).",
        "# Do not edit by hand: change requirements-gpu.in and regenerate (commands in requirements-gpu.in). Install with",
        "#   bash scripts/setup-gpu.sh      (= pip install --require-hashes --only-binary=:all: -r requirements-gpu.txt; pip install -e . --no-deps)",
        "# Versions that differ from the CPU stack (requirements.txt) and why: requirements-gpu.in. In short, unsloth 2026.10.9 caps",
        "# trl<=1.15.0 / transformers<=5.17.0 / datasets<5.0.0 and vllm 0.33.0 pins torch==2.14.0 and llguidance<1.8.0.",
        f"# {len(entries)} packages, all wheels (no sdist-only package).",
        "",
    ]
    lines, resolved = [], []
    for e in entries:
        name, ver = e["metadata"]["name"], e["metadata"]["version"]
        hs = wheel_hashes(e)
        lines.append(f"{canonicalize_name(name)}=={ver} \\\n" + " \\\n".join(f"    --hash=sha256:{h}" for h in hs)
                     + ("\n    # requested in requirements-gpu.in" if e.get("requested") else ""))
        resolved.append(f"{canonicalize_name(name)}=={ver}")
    (ROOT / "requirements-gpu.txt").write_text("\n".join(head) + "\n".join(lines) + "\n")
    (HERE / "resolved.txt").write_text(
        f"# pip {report['pip_version']} dry-run resolution of requirements-gpu.in, {date} ({len(entries)} packages; "
        f"python {report['environment']['python_full_version']} markers, linux x86_64). Command (from the repo root):\n"
        f"#   {COMMAND}\n" + "\n".join(resolved) + "\n")
    print(f"wrote requirements-gpu.txt and {HERE / 'resolved.txt'}: {len(entries)} packages")


if __name__ == "__main__":
    main()
