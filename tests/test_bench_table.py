"""bench/table.py on hand-written run folders (no model): the cells it prints, the plot it writes, and its refusal to
put cells side by side when their prompts / weights / question sample differ (cells are filled over sessions,
resumably)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cell(root: Path, name: str, correct: list[bool], tokens: int, prompts: str = "p" * 64, ids: str = "i" * 64):
    d = root / name
    d.mkdir(parents=True)
    rows = [{"id": f"gsm8k/test/{i}", "correct": c, "tokens": tokens, "nominal_tokens": tokens, "latency_s": 1.0}
            for i, c in enumerate(correct)]
    (d / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "manifest.json").write_text(json.dumps({
        "git": "0123456789abcdef+dirty", "prompts_sha256": prompts,
        "workers": {"small": {"model": "smollm2-135m", "sha256": "a"},
                    "large": {"model": "qwen2.5-coder-1.5b", "sha256": "b"}},
        "config": {"eval": {"seed": 0}, "example_ids_sha256": ids}}))


def _table(root: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "table.py"), str(root), *extra], cwd=ROOT,
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_table_cells_order_and_plot(tmp_path):
    _cell(tmp_path, "small-cot", [False] * 4, 300)
    _cell(tmp_path, "large-cot", [True, True, False, False], 400)
    _cell(tmp_path, "large-chain", [True], 1600)
    _cell(tmp_path, "large-sc-cot", [False, False, True, True], 900)
    r = _table(tmp_path, "--plot", str(tmp_path / "p.png"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "| method | small | large |"
    # cot before chain (the issue's order, not the folders' alphabetical one); a missing cell is "-"
    assert lines[2].startswith("| cot | 0.00 [0.00-0.49], 300 tok, n=4 | 0.50 [0.15-0.85], 400 tok, n=4 |")
    assert lines[3] == "| sc-cot | - | 0.50 [0.15-0.85], 900 tok, n=4 |"
    assert lines[4] == "| chain | - | 1.00 [0.21-1.00], 1600 tok, n=1 |"
    assert "same 4 cells" in r.stdout and "0123456+dirty (large-chain, large-cot, large-sc-cot, small-cot)" in r.stdout
    # paired against CoT on the shared question ids: sc-cot right on 2, 3 where CoT was wrong, wrong on 0, 1 where it
    # was right
    assert "sc-cot/large: +2 -2 of 4; chain/large: +0 -0 of 1" in r.stdout
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_table_refuses_incomparable_cells(tmp_path):
    _cell(tmp_path, "small-cot", [False], 300)
    _cell(tmp_path, "large-cot", [True], 400, ids="j" * 64)
    r = _table(tmp_path)
    assert r.returncode != 0
    assert "not comparable: their question sample differ" in r.stderr
