"""Records carry no machine paths (lemon.report): manifests, eval summaries and summary.md name the repo's files
relative to it, the shared data as ../shared/data and the model cache as ~/.cache, so a committed record reads the same
on any machine."""
import json
import re
import sys
from pathlib import Path

import pytest

from lemon import report
from lemon.manifest import build_manifest
from lemon.report import portable, portable_text, shown_path

ROOT, HOME = Path("/srv/x/lemon"), Path("/home/me")


@pytest.mark.parametrize("text, want", [
    ("/srv/x/lemon/outputs/cpu-1/train", "outputs/cpu-1/train"), ("/srv/x/lemon", "."),
    ("--out /srv/x/lemon/outputs/a --seed 0", "--out outputs/a --seed 0"), ("`/srv/x/lemon/.venv/bin/llama-server`",
                                                                          "`.venv/bin/llama-server`"),
    ("/srv/x/shared/data/gsm8k/test.jsonl", "../shared/data/gsm8k/test.jsonl"),
    ("/home/me/.cache/lemon/models/q.gguf", "~/.cache/lemon/models/q.gguf"),
    ("/srv/x/lemonade/a", "../lemonade/a"), ("/tmp/run/x.log", "$TMPDIR/run/x.log"), ("/opt/run", "/opt/run"),
    ("a/srv/x/lemon/b", "a/srv/x/lemon/b")])
def test_portable_text(text, want):
    assert portable_text(text, ROOT, HOME, Path("/tmp")) == want


def _absolute(obj) -> list[str]:
    """Strings of a JSON-able object that hold an absolute path under the repo, beside it or under the home folder."""
    text = json.dumps(obj)
    pat = "|".join(re.escape(str(p)) for p in (report.ROOT, report.ROOT.parent, Path.home()) if len(p.parts) > 1)
    return re.findall(rf"(?:{pat})[^\"]*", text)


def test_manifest_names_no_machine_path(monkeypatch):
    home = Path.home()
    monkeypatch.setattr(sys, "argv", [str(report.ROOT / "lemon" / "study" / "__main__.py"), "--out",
                                      str(report.ROOT / "outputs" / "x")])
    workers = {"small": {"backend": "llama_server", "model": "m", "server": {
        "binary": str(report.ROOT / ".venv" / "bin" / "llama-server"), "model_path": str(home / ".cache" / "m.gguf")}}}
    data = report.ROOT / "configs" / "profiles.yaml"
    config = {"init_adapter": str(report.ROOT / "outputs" / "a")}
    m = build_manifest(config, prompts_sha256="0", workers=workers, data_files=[data],
                       extra={"data_dir": str(report.ROOT.parent / "shared" / "data")})
    assert _absolute({k: v for k, v in m.items() if k != "config"}) == []
    assert m["config"] == config  # what a resume compares stays exact
    assert m["argv"] == ["lemon/study/__main__.py", "--out", "outputs/x"]
    assert list(m["data"]) == ["configs/profiles.yaml"]
    assert m["workers"]["small"]["server"]["binary"] == ".venv/bin/llama-server"
    assert m["data_dir"] == "../shared/data"
    assert _absolute(portable(workers)) == [] and _absolute(workers)  # the check sees what it should


def test_summary_md_names_the_folder_not_the_machine(tmp_path, monkeypatch):
    from lemon.study.config import study_preset
    from lemon.study.paths import StudyPaths
    from lemon.study.plots import write_summary
    monkeypatch.setattr(report, "ROOT", tmp_path / "repo")
    paths = StudyPaths(tmp_path / "repo" / "outputs" / "test-1")
    paths.root.mkdir(parents=True)
    text = Path(write_summary(study_preset("test"), paths)).read_text()
    assert "Folder `outputs/test-1`" in text and "--out outputs/test-1`" in text and str(tmp_path) not in text
    monkeypatch.undo()
    assert shown_path("/opt/nowhere/run") == "run"  # outside the repo, its folder, home and temp: the name only
    if not {report.ROOT.parent, Path.home()} & set(tmp_path.parents):
        assert shown_path(tmp_path / "run").startswith("$TMPDIR/")  # the temp folder: named by its variable
