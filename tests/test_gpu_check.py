"""The device check (bench/gpu_check.py, scripts/gpu_check.sh; issue 29) kept alive on the CPU: the same five checks on
the tiny random policy with the real tokenizer, at its --quick size (~50 s on 2 idle AVX2 cores). On a GPU machine the
same script ran the CUDA branch (outputs/reference/gpu-check-20261204/)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)  # not `slow`: 54 s on an idle fresh clone (2026-12-04), under the 90-s limit of fast tests
def test_gpu_check_runs_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(tmp_path), "--device",
                          "cpu", "--quick"], capture_output=True, text=True, timeout=380, cwd=ROOT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    assert list(rep) == ["env", "cf_loss", "probe", "rollouts", "trainer"] and all(r["ok"] for r in rep.values())
    assert rep["cf_loss"]["grad_rel_diff"] < 1e-3 and rep["rollouts"]["parsed"] == rep["rollouts"]["specs"] > 0
    t = rep["trainer"]
    assert t["steps"] == t["resumed_steps"] == 3 and t["lora_moved"] and len(t["losses"]) == 3
    assert [r["gradient_checkpointing"] for r in rep["probe"]["runs"]] == [False, True]
    assert "5/5 passed" in out.stdout
