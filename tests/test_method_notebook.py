"""notebooks/00_method.ipynb: its shape (title first, literal papermill parameters next, outputs cleared, logic in
lemon.testbed.walkthrough) and a headless papermill run with a short loop whose key numbers are sane."""
import ast
import json
import math

import nbformat
import pytest

from lemon.study import runner as study

NB = study.ROOT / "notebooks" / "00_method.ipynb"


def test_method_notebook_shape():
    nb = nbformat.read(NB, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    params = nb.cells[1]
    assert params.cell_type == "code" and "parameters" in params.metadata.get("tags", [])
    names = set()
    for stmt in ast.parse(params.source).body:  # literals only, so papermill can override them
        assert isinstance(stmt, ast.Assign), ast.dump(stmt)
        ast.literal_eval(stmt.value)
        names |= {t.id for t in stmt.targets}
    assert names == {"world", "seed", "group", "cf_lambda", "learning_rate", "steps"}
    for c in nb.cells:
        if c.cell_type == "code":
            assert not c.outputs and c.execution_count is None, "commit the notebook with its outputs cleared"
            tree = ast.parse("\n".join(l for l in c.source.splitlines() if not l.lstrip().startswith(("%", "!"))))
            assert not [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))], c.source


@pytest.mark.timeout(600)  # ~45 s with steps=6 on one busy core (most of it the policy load, sampling and the kernel)
def test_method_notebook_runs(tmp_path):
    import papermill as pm
    out = tmp_path / "00_method.ipynb"
    pm.execute_notebook(str(NB), str(out), parameters={"steps": 6}, kernel_name="python3", cwd=str(study.ROOT),
                        progress_bar=False)
    nb = nbformat.read(out, as_version=4)
    assert not [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    cell = next(c for c in nb.cells if "summary" in c.metadata.get("tags", []))
    text = "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")
    s = json.loads(text.strip().splitlines()[-1])
    assert s["forced_adv_max_abs"] == 0.0  # forced tokens carry no advantage
    assert s["lora_finite"] and s["losses_finite"] and math.isfinite(s["first_step"]["loss"])
    assert s["first_step"]["tokens"] > 0 and s["first_step"]["grad_norm"] >= 0
    assert 0.0 <= s["mean_reward_last5"] <= 1.2 and set(s["greedy_regret"]) == {"hard"}
    pngs = sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))
    assert pngs >= 3, pngs  # the spec drawing, the advantage heat map, the training curve
