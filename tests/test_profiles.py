"""Profiles as data (configs/profiles.yaml, lemon.study.profiles): one namespace for main.sh, the notebooks and
`lemon train`; --set / --workers overrides; clear errors for bad files and bad items."""
import json
import re
from pathlib import Path

import pytest

from lemon import cli
from lemon.study import runner as study
from lemon.study.config import STUDY_PROFILES, train_sft_preset, study_preset
from lemon.study.profiles import (PROFILES_FILE, ProfileError, apply_overrides, get_profile, load_profiles, parse_sets,
                                  parse_value)
from lemon.train.config import train_preset

ROOT = Path(__file__).resolve().parents[1]


def test_every_profile_builds_and_lemon_train_trains_like_its_study():
    profiles = load_profiles()
    assert set(profiles) == {"smoke", "test", "cpu", "cpu-long", "cpu-wide", "paper"} == set(STUDY_PROFILES)
    for name, p in profiles.items():
        cfg = study_preset(name, seed=2)
        assert cfg.profile == name and cfg.train.profile == p.base and cfg.train.seed == cfg.sft.seed == 2
        assert p.answers and p.models and p.measured, name  # README's profiles table reads these
        # issue 31: `lemon train --profile cpu` was 8 steps at 2e-5 while the cpu study trained 4 at 1e-4
        assert train_sft_preset(name, seed=2) == (cfg.train, cfg.sft), name
    cpu = study_preset("cpu")
    assert (cpu.train.max_steps, cpu.train.learning_rate, cpu.sft.questions) == (6, 1e-4, 8)
    assert cpu.benchmarks == ("multiarith", "svamp", "gsm8k") and isinstance(cpu.eval_methods, tuple)
    assert study_preset("paper").eval_n is None


def test_readme_profiles_table_lists_every_profile():
    text = (ROOT / "README.md").read_text()
    table = text[text.index("## Profiles"):].split("\n## ")[0]
    rows = set(re.findall(r"^\| `([\w-]+)`", table, flags=re.M))
    assert rows == set(load_profiles())


@pytest.mark.parametrize("text, value", [("8", 8), ("1e-4", 1e-4), ("2.0e-5", 2e-5), ("true", True), ("null", None),
                                         ("[gsm8k, mmlu]", ["gsm8k", "mmlu"]), ('["a", "b"]', ["a", "b"]),
                                         ("cot@large", "cot@large"), ("{small: 16}", {"small": 16})])
def test_set_values_parse_as_a_user_means_them(text, value):
    assert parse_value(text) == value


def test_sets_reach_nested_configs_and_are_checked():
    cfg = study_preset("smoke", sets=parse_sets(["eval_n=3", "train.max_steps=5", "sft.epochs=2",
                                                 "benchmarks=[gsm8k]", "train.policy.lora_r=4"]))
    assert (cfg.eval_n, cfg.train.max_steps, cfg.sft.epochs, cfg.benchmarks, cfg.train.policy.lora_r) == (
        3, 5, 2, ("gsm8k",), 4)
    with pytest.raises(ProfileError, match="no field 'eval_m'.*valid: .*eval_n"):
        study_preset("smoke", sets=parse_sets(["eval_m=3"]))
    with pytest.raises(ProfileError, match="no field 'max_step'"):
        study_preset("smoke", sets=parse_sets(["train.max_step=3"]))
    with pytest.raises(ValueError, match="not a multiple of num_generations"):  # TrainConfig's own check runs
        study_preset("cpu", sets=parse_sets(["train.batch_size=6"]))
    with pytest.raises(ProfileError, match="expected FIELD=VALUE"):
        parse_sets(["eval_n"])
    with pytest.raises(ProfileError, match="not a nested config"):
        apply_overrides(study_preset("smoke"), {"eval_n.x": 1})
    with pytest.raises(ProfileError, match="train.FIELD or sft.FIELD"):
        train_sft_preset("smoke", sets={"eval_n": 1})


def test_a_profile_is_one_entry_of_the_file(tmp_path):
    f = tmp_path / "profiles.yaml"
    f.write_text("tiny:\n  base: smoke\n  answers: a toy\n  train: {max_steps: 3}\n  study: {benchmarks: [gsm8k], "
                 "eval_n: 1}\n")
    cfg = study_preset("tiny", profiles_file=f)
    assert (cfg.profile, cfg.train.max_steps, cfg.benchmarks, cfg.eval_n) == ("tiny", 3, ("gsm8k",), 1)
    assert cfg.train == train_preset("smoke", max_steps=3)
    for bad, msg in [("tiny:\n  base: huge\n", "needs base"), ("tiny:\n  base: smoke\n  trian: {}\n", "unknown keys"),
                     ("tiny: [1]\n", "must be a mapping"),
                     ("tiny:\n  base: smoke\n  train: 3\n", "train must be a mapping"),
                     ("tiny: {base: smoke\n", "not valid YAML")]:
        f.write_text(bad)
        with pytest.raises(ProfileError, match=msg):
            load_profiles(f)
    with pytest.raises(ProfileError, match="unknown profile 'nope'; valid: smoke"):
        get_profile("nope", PROFILES_FILE)


def test_workers_file_replaces_the_workers_and_says_what_it_turned_off(tmp_path, capsys):
    f = tmp_path / "w.yaml"
    f.write_text("small: {backend: openai, model: m, base_url: 'http://localhost:1/v1'}\n"
                 "medium: {backend: openai, model: m, base_url: 'http://localhost:1/v1'}\n"
                 "large: {backend: openai, model: m, base_url: 'http://localhost:1/v1'}\n")
    cfg = study_preset("cpu", workers=str(f))
    assert cfg.train.workers["large"]["backend"] == "openai" and cfg.train.deterministic_workers is False
    assert "deterministic_workers is off" in capsys.readouterr().err


def test_setup_and_cli_take_the_same_overrides(tmp_path, capsys):
    cfg, paths = study.setup("test", str(tmp_path / "s"), 0, ["eval_n=1", "train.learning_rate=3e-4"])
    saved = json.loads((paths.root / "config.json").read_text())
    assert saved["train"]["learning_rate"] == 3e-4 == cfg.train.learning_rate
    with pytest.raises(ValueError, match="different config.*learning_rate"):  # one folder = one experiment
        study.setup("test", str(tmp_path / "s"), 0, ["train.learning_rate=1e-3"])
    assert cli.main(["train", "--profile", "nope", "--out", str(tmp_path / "t")]) == 2
    assert "unknown profile 'nope'" in capsys.readouterr().err
    assert cli.main(["train", "--profile", "smoke", "--set", "batch_size=3", "--out", str(tmp_path / "t")]) == 2
    assert "not a multiple" in capsys.readouterr().err


CONFIG_CODE = ("lemon/train/config.py", "lemon/study/config.py", "lemon/study/profiles.py")


def _literal(node, types) -> bool:
    """A literal number (of `types`) or a non-empty mapping literal."""
    import ast
    if isinstance(node, ast.Dict):
        return bool(node.keys)
    return isinstance(node, ast.Constant) and type(node.value) in types


def _values_in_code(path: Path, names: set[str]) -> list[str]:
    """Profile values written in a module's functions: a comparison with a profile or preset name (`profile == "cpu"`)
    or a literal number / bool / mapping passed to a call (`TrainConfig(max_steps=8)`). Dataclass field defaults (class
    bodies) are defaults, not profile values, and are not looked at."""
    import ast
    tree = ast.parse(path.read_text())
    found = []
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                found += [f"{path.name}:{node.lineno}: compares with {v!r}" for v in consts if v in names]
            if isinstance(node, ast.Call):
                found += [f"{path.name}:{node.lineno}: {kw.arg}={ast.unparse(kw.value)}" for kw in node.keywords
                          if _literal(kw.value, (int, float, bool))]
                found += [f"{path.name}:{node.lineno}: positional {ast.unparse(a)}" for a in node.args
                          if _literal(a, (int, float))]
    return found


def test_no_profile_value_is_written_in_code(tmp_path):
    """configs/profiles.yaml is the only place a preset or profile value lives: the modules that build configs compare
    no profile name and pass no literal value to a config, and every value of the file's presets is what
    train_preset / sft_preset return (the derived budgets are computed from the file's max_agents and reply caps)."""
    import dataclasses
    from lemon.train import config as C
    from lemon.train.config import read_presets, size_budgets, sft_preset
    names = set(load_profiles()) | set(read_presets())
    found = [f for p in CONFIG_CODE for f in _values_in_code(ROOT / p, names)]
    assert not found, "profile values in code (move them to configs/profiles.yaml):\n" + "\n".join(found)
    old = tmp_path / "old.py"  # the checker sees the old shape of a preset
    old.write_text('def train_preset(profile):\n    if profile == "cpu":\n        return TrainConfig(max_steps=8)\n')
    assert len(_values_in_code(old, names)) == 2
    for name, preset in read_presets().items():
        cfg, sft = train_preset(name), sft_preset(name)
        for k, v in preset["train"].items():
            got = getattr(cfg, k)
            if dataclasses.is_dataclass(got):  # a nested config (policy): the file sets some of its fields
                assert all(getattr(got, sk) == sv for sk, sv in v.items()), (name, k)
            else:
                assert got == (tuple(v) if isinstance(v, list) else v), (name, k)
        assert all(getattr(sft, k) == v for k, v in (preset.get("sft") or {}).items()), name
        b = size_budgets(cfg.max_agents, cfg.worker_max_tokens)
        assert (cfg.max_completion_length, cfg.task_token_budget, cfg.reward.token_budget) == (
            b["completion"], b["task"], b["efficiency"]) and cfg.reward.max_agents == cfg.max_agents
    assert train_preset("cpu").max_steps != study_preset("cpu").train.max_steps  # the testbed's preset vs the study's
    assert C.PROFILES == tuple(read_presets())


def test_a_preset_is_read_from_the_file(tmp_path, monkeypatch):
    """Changing a value in the file changes the preset (nothing in code shadows it); the study of a profile over that
    preset follows."""
    import yaml
    from lemon.train import config as C
    raw = yaml.safe_load(PROFILES_FILE.read_text())
    raw["presets"]["cpu"]["train"]["max_steps"] = 5
    raw["presets"]["cpu"]["train"]["worker_max_tokens"]["large"] = 400
    raw["presets"]["cpu"]["sft"]["questions"] = 3
    f = tmp_path / "profiles.yaml"
    f.write_text(yaml.safe_dump(raw, sort_keys=False))
    monkeypatch.setattr(C, "PROFILES_FILE", f)
    cfg = train_preset("cpu")
    assert cfg.max_steps == 5 and cfg.worker_max_tokens["large"] == 400 and C.sft_preset("cpu").questions == 3
    monkeypatch.undo()
    budget = C.size_budgets(4, cfg.worker_max_tokens)["task"]
    assert cfg.task_token_budget == budget > train_preset("cpu").task_token_budget
    monkeypatch.setattr(C, "PROFILES_FILE", f)
    assert study_preset("cpu-wide", profiles_file=f).train.worker_max_tokens["large"] == 400
    del raw["presets"]["cpu"]["train"]["max_agents"]
    f.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(ProfileError, match="preset 'cpu' must be a mapping with train"):
        train_preset("cpu")
