"""The repo keeps its promises: README's test command is what CI runs; CPU torch is pinned; big things stay out of git;
imports point down the stages (spec, run, benchmarks, policy, eval, train, study, testbed) with no cycle, and lemon's
own imports sit at the top of a module unless one is marked `# lazy: <why>` (a heavy optional dependency)."""
import re
from pathlib import Path

import pytest

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
    pins = [l.split("==")[0].split("[")[0].strip().lower() for l in req.splitlines()
            if l.strip() and not l.startswith("#")]
    assert "torch==2.13.0" in req and "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    assert "unsloth" not in pins and "vllm" not in pins
    assert "unsloth" in (ROOT / "requirements-gpu.txt").read_text()
    setup = (ROOT / "scripts/setup.sh").read_text()
    assert "-c constraints.txt" in setup


def test_outputs_and_weights_ignored():
    gi = (ROOT / ".gitignore").read_text().splitlines()
    for pat in (".venv/", "outputs/*", "*.gguf"):
        assert pat in gi


# ---- the import graph (issue 31): imports point down the stages and form no cycle ------------------------------------
# lemon's stages, lowest first; a module may import its own stage and any lower one. Every import counts, at the top of
# a module or inside a function (a lazy import is still a dependency).
STAGES = [("prompts", "progress", "report"), ("spec",), ("run",), ("benchmarks",), ("manifest",), ("policy",),
          ("eval",), ("train",), ("study",), ("testbed",), ("cli", "__main__")]
RANK = {name: i for i, names in enumerate(STAGES) for name in names}


def _import_graph() -> dict[str, set[str]]:
    """module -> the lemon modules it imports (a `from lemon.x import y` names lemon.x.y when that is a module)."""
    import ast
    mods = {}
    for f in (ROOT / "lemon").rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for m, f in mods.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module.split(".")[0] == "lemon"):
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "lemon"]
            out |= {n for n in names if n in mods and n != m}
        graph[m] = out
    return graph


def _stage(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "<lemon>"


def test_no_import_points_up_a_stage_and_no_cycle():
    graph = _import_graph()
    unknown = sorted({_stage(m) for m in graph} - set(RANK) - {"<lemon>"})
    assert not unknown, f"stages {unknown} are not in tests/test_repo.py STAGES: place them"
    up = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                if _stage(a) in RANK and _stage(b) in RANK and RANK[_stage(b)] > RANK[_stage(a)])
    assert not up, "imports that point up a stage:\n" + "\n".join(up)
    # cycles: a module that can reach itself (depth-first search with colours)
    colour, stack, cycles = {}, [], []

    def visit(v):
        colour[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if colour.get(w) == 1:
                cycles.append(stack[stack.index(w):] + [w])
            elif w not in colour:
                visit(w)
        stack.pop()
        colour[v] = 2
    for v in sorted(graph):
        if v not in colour:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_import_graph_checker_sees_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    """The checker itself, on a toy package: run -> train points up; a <-> b is a cycle."""
    pkg = tmp_path / "lemon"
    for rel, text in {"run/__init__.py": "", "run/x.py": "from lemon.train import y\n", "train/__init__.py": "",
                      "train/y.py": "", "train/a.py": "def f():\n    from lemon.train import b\n",
                      "train/b.py": "import lemon.train.a\n"}.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)  # the checker reads the module-level ROOT
    with pytest.raises(AssertionError, match=r"lemon\.run\.x -> lemon\.train\.y"):
        test_no_import_points_up_a_stage_and_no_cycle()
    (pkg / "run/x.py").write_text("")
    with pytest.raises(AssertionError,
                       match=r"import cycles:\n\s*lemon\.train\.a -> lemon\.train\.b -> lemon\.train\.a"):
        test_no_import_points_up_a_stage_and_no_cycle()


def test_own_imports_are_at_the_top_unless_marked_lazy():
    """Issue 31: an import of a lemon module inside a function needs a reason on its line, `# lazy: <why>` (it would
    pull torch, transformers or matplotlib into every importer); otherwise it belongs at the top of the module."""
    import ast
    unmarked = []
    for f in sorted((ROOT / "lemon").rglob("*.py")):
        text = f.read_text()
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                own = (isinstance(node, ast.ImportFrom)
                       and (node.level > 0 or (node.module or "").split(".")[0] == "lemon")
                       or isinstance(node, ast.Import) and any(a.name.split(".")[0] == "lemon" for a in node.names))
                if own and not any("# lazy:" in line for line in lines[node.lineno - 1:node.end_lineno]):
                    unmarked.append(f"{f.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    unmarked = list(dict.fromkeys(unmarked))  # a nested function's import is seen from each enclosing function
    assert not unmarked, ("imports of lemon modules inside functions: move them to the top of the module, or "
                          "say why one must stay lazy with `# lazy: <why>` on its line:\n" + "\n".join(unmarked))

def test_readme_is_short_and_its_links_resolve():
    """Issue 31: README stays scannable (<= 1,100 words, its algorithm section included) and every relative link in it
    (records, LOG, docs, source files) exists."""
    text = (ROOT / "README.md").read_text()
    n = len(text.split())
    assert n <= 1100, f"README.md has {n} words (> 1,100): move detail to outputs/reference/"
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+://", link) and link.split("#")[0]]
    missing = sorted({p for p in local if not (ROOT / p).exists()})
    assert local and not missing, f"README links to missing paths: {missing}"


def test_testbed_imports_nothing_from_the_study():
    """The testbed (simulated worlds, many-seed studies) builds on the trainer, not on the papermill study: shared
    report helpers live below both (lemon.report)."""
    graph = _import_graph()
    bad = sorted(f"{a} -> {b}" for a, bs in graph.items() for b in bs
                 if _stage(a) == "testbed" and _stage(b) == "study")
    assert not bad, "lemon/testbed imports lemon/study:\n" + "\n".join(bad)
    assert any(_stage(a) == "testbed" and b == "lemon.report" for a, bs in graph.items() for b in bs)


def test_committed_records_name_no_machine_path():
    """Tracked text files under outputs/reference name the repo's files relative to it (lemon.report): no '/work/',
    '/root/', '/tmp/' or this checkout's own path. Compressed and binary files are not read."""
    import subprocess
    files = subprocess.run(["git", "ls-files", "-z", "outputs/reference"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    marks = ("/work/", "/root/", "/tmp/", f"{ROOT}/")
    bad = []
    for rel in filter(None, files):
        data = (ROOT / rel).read_bytes() if (ROOT / rel).is_file() else b""
        if rel.endswith((".gz", ".png", ".zip", ".safetensors", ".bin")) or b"\0" in data[:8192]:
            continue
        text = data.decode("utf-8", "replace")
        bad += [f"{rel}: {m}" for m in marks if m in text]
    assert len(files) > 100 and not bad, "records with machine paths:\n" + "\n".join(bad[:20])


# ---- the linter (issue 42): README's test command runs ruff through these tests, so CI lints -------------------------
LINTED = ("lemon", "tests", "experiments", "bench", "scripts", "notebooks")


def _ruff(*args: str, stdin: str | None = None):
    import subprocess
    import sys
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=ROOT, input=stdin, capture_output=True, text=True,
                          timeout=120)


def test_ruff_is_the_pinned_version():
    pin = re.search(r"^ruff==(\S+)", (ROOT / "requirements.txt").read_text(), re.M)
    assert pin, "requirements.txt pins no ruff"
    got = _ruff("--version")
    assert got.returncode == 0, f"no ruff: .venv/bin/pip install -c constraints.txt ruff=={pin[1]}\n{got.stderr}"
    assert got.stdout.split() == ["ruff", pin[1]], f"{got.stdout.strip()} installed, requirements.txt pins {pin[1]}"


def test_ruff_is_clean():
    """`ruff check` (settings: pyproject.toml [tool.ruff]) reports nothing in the Python folders and the notebooks."""
    out = _ruff("check", "--no-cache", "--output-format", "concise", *[d for d in LINTED if (ROOT / d).is_dir()])
    assert out.returncode == 0, f"ruff found problems (wrap lines by hand, no formatter):\n{out.stdout}{out.stderr}"


def test_ruff_settings_are_the_repos():
    """The check above uses pyproject.toml's settings: 120 columns (not ruff's 88) and pyflakes."""
    ok = "x = 1  # " + "a" * 110 + "\n"  # 119 columns
    assert _ruff("check", "--no-cache", "--stdin-filename", "lemon/x.py", "-", stdin=ok).returncode == 0
    for bad, code in (("x = 1  # " + "a" * 112 + "\n", "E501"), ("import os\n", "F401")):
        out = _ruff("check", "--no-cache", "--stdin-filename", "lemon/x.py", "-", stdin=bad)
        assert out.returncode == 1 and code in out.stdout, out.stdout + out.stderr
