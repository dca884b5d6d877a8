"""The repo keeps its promises: README's test command is what CI runs; CPU torch is pinned; big things stay out of git."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (ROOT / "README.md").read_text())


def test_ci_runs_readme_test_command():
    cmds = _readme_commands()
    assert len(cmds) >= 2, "README must open with two commands: setup + main job, then tests"
    assert cmds[0].startswith("bash scripts/setup.sh"), cmds[0]
    assert "scripts/main.sh --profile cpu" in cmds[0], "the first command is the main job on the embedded default"
    ci = (ROOT / ".ci/run").read_text().splitlines()
    assert cmds[1] in ci, f"README's test command {cmds[1]!r} is not a line of .ci/run"


def test_cpu_torch_pinned_and_gpu_pins_apart():
    req = (ROOT / "requirements.txt").read_text()
    pins = [l.split("==")[0].split("[")[0].strip().lower() for l in req.splitlines() if l.strip() and not l.startswith("#")]
    assert "torch==2.13.0" in req and "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    assert "unsloth" not in pins and "vllm" not in pins
    assert "unsloth" in (ROOT / "requirements-gpu.txt").read_text()
    setup = (ROOT / "scripts/setup.sh").read_text()
    assert "-c constraints.txt" in setup


def test_outputs_and_weights_ignored():
    gi = (ROOT / ".gitignore").read_text().splitlines()
    for pat in (".venv/", "outputs/*", "*.gguf"):
        assert pat in gi
