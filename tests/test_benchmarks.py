"""Tests for lemon.benchmarks: loading, answer extraction, scoring and pools.

Needs the JSONL mirrors (``shared/data`` or ``$LEMON_DATA_DIR``); data-dependent tests
are skipped when they are absent. The HumanEval test runs all 164 canonical solutions in
the real sandbox (``lemon.run.sandbox``) and is marked ``slow``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import pickle
import re
import sys
from fractions import Fraction
from pathlib import Path

import pytest

import lemon.benchmarks as B
from lemon.benchmarks import (BENCHMARKS, SPLITS, DataNotFoundError, Example,
                              UnknownBenchmarkError, UnknownSplitError, extract_letter,
                              extract_number, get_benchmark, load, normalize_question, score)
from lemon.benchmarks.answers import normalize_text

HAVE_DATA = all(B.available_splits(n) for n in BENCHMARKS)
needs_data = pytest.mark.skipif(not HAVE_DATA, reason="benchmark JSONL mirrors not found")

LOCAL_SPLITS = [(n, s) for n in BENCHMARKS for s in SPLITS[n]
                if s in B.available_splits(n)] if HAVE_DATA else []
TEXT_SPLITS = [(n, s) for n, s in LOCAL_SPLITS if n != "humaneval"]


# ----------------------------------------------------------------------------- registry

def test_registry_domains_and_conventions():
    assert BENCHMARKS == ("gsm8k", "multiarith", "svamp", "aqua", "mmlu", "humaneval")
    domains = {n: get_benchmark(n).domain for n in BENCHMARKS}
    assert domains == {"gsm8k": "math", "multiarith": "math", "svamp": "math",
                       "aqua": "math", "mmlu": "knowledge", "humaneval": "code"}
    assert "Answer: <number>" in get_benchmark("gsm8k").answer_convention
    assert "Answer: <letter>" in get_benchmark("aqua").answer_convention
    assert "A, B, C, D or E" in get_benchmark("aqua").answer_convention
    assert "A, B, C or D" in get_benchmark("mmlu").answer_convention
    assert "```python" in get_benchmark("humaneval").answer_convention
    assert get_benchmark(" GSM8K ") is get_benchmark("gsm8k")


def test_unknown_benchmark_lists_valid_names():
    with pytest.raises(UnknownBenchmarkError) as err:
        get_benchmark("gsm9k")
    assert isinstance(err.value, ValueError) and isinstance(err.value, KeyError)
    for name in BENCHMARKS:
        assert name in str(err.value)
    with pytest.raises(ValueError):
        load("nope", "test")


def test_unknown_split_lists_valid_splits():
    with pytest.raises(UnknownSplitError) as err:
        load("mmlu", "train")
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert all(s in msg for s in ("dev", "validation", "test"))


def test_data_not_found(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    monkeypatch.delenv("LEMON_DATA_DIR", raising=False)
    B.clear_cache()
    with pytest.raises(DataNotFoundError) as err:
        load("gsm8k", "test", data_dir=tmp_path)
    msg = str(err.value)
    assert str(tmp_path) in msg and "openai/gsm8k" in msg
    monkeypatch.setenv("LEMON_DATA_DIR", str(tmp_path / "missing"))
    with pytest.raises(DataNotFoundError):
        load("humaneval", "test")
    assert isinstance(err.value, FileNotFoundError)


def test_env_data_dir(tmp_path, monkeypatch):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(
        '{"question": "1+1?", "answer": "1+1=2\\n#### 2"}\n'
        '{"question": "2+2?", "answer": "so\\n#### 1,004"}\n', encoding="utf-8")
    monkeypatch.setenv("LEMON_DATA_DIR", str(tmp_path))
    rows = load("gsm8k", "test")
    assert [r.gold for r in rows] == ["2", "1004"]
    assert rows[1].id == "gsm8k/test/1" and rows[1].question == "2+2?"


# ----------------------------------------------------------------------------- extraction

@pytest.mark.parametrize("text,expected", [
    (r"so the total is \boxed{72}", "72"),
    ("48 + 24 = 72\n#### 72", "72"),
    ("She paid $1,000", "1000"),
    ("72.0", "72"),
    ("72 apples.", "72"),
    ("There are 3 boxes and 72 apples.", "72"),
    ("Answer: $1,000.00", "1000"),
    ("3 * 4 = 12 ... Answer: 72\nHope that helps, 5 stars", "72"),
    ("The answer is 18.", "18"),
    ("**Answer:** 18", "18"),
    ("Answer:\n\n42", "42"),
    ("Answer: -10", "-10"),
    ("Answer: 3/4", "0.75"),
    (r"\boxed{\frac{1}{3}}", "1/3"),
    ("It costs 0.5 dollars", "0.5"),
    ("50%", "50"),
    ("", None),
    ("I don't know", None),
    (None, None),
])
def test_extract_number(text, expected):
    assert extract_number(text) == expected


def test_numeric_tolerance():
    ex = Example("t/0", "gsm8k", "test", "q", "72")
    for text in ("72", "72.0", "72.00", "Answer: 72.0000001", "$72", "#### 72",
                 r"\boxed{72}"):
        assert score(ex, text) == 1.0, text
    big = Example("t/1", "gsm8k", "test", "q", "1000")
    assert score(big, "Answer: 1,000") == 1.0 and score(big, "1000.") == 1.0
    for text in ("Answer: 73", "Answer: 72.1", "", "I don't know", "Answer: 7 2"):
        assert score(ex, text) == 0.0, text
    assert B.numbers_match("0.3", 0.1 + 0.2) and not B.numbers_match("10", "10.00001")
    assert B.numbers_match("0.75", "3/4") and B.canonical_number(Fraction(5, 2)) == "2.5"


OPTS = ("21", "32400", "A cat", "10", "None of these")


@pytest.mark.parametrize("text,expected", [
    ("(B)", "B"),
    ("B)", "B"),
    ("Answer: B", "B"),
    ("answer: b", "B"),
    ("The answer is (C).", "C"),
    ("Reasoning...\nThe correct answer is option D", "D"),
    ("**Answer:** (C) 10", "C"),
    ("So we pick **E**", "E"),
    (r"\boxed{A}", "A"),
    ("So the answer is B) 32400.", "B"),
    ("32400", "B"),                  # bare option text
    ("Answer: 32400", "B"),
    ("Answer: 32,400", "B"),          # numerically equal option
    ("Answer: A cat", "C"),           # option text starting with an article
    ("Answer: none of these.", "E"),
    ("After all that, I pick C.", "C"),
    ("A farmer has 3 cows.", None),   # article, not a choice
    ("To answer this question, A farmer would ...", None),
    ("P(A) = 0.3 and P(B) = 0.5", None),
    ("I don't know", None),
    ("", None),
])
def test_extract_letter(text, expected):
    assert extract_letter(text, OPTS) == expected


def test_letter_range_and_ambiguous_options():
    assert extract_letter("Answer: E", ("1", "2", "3", "4"), "ABCD") is None
    assert extract_letter("Answer: 5", ("5", "6", "5", "7", "8")) is None  # ambiguous
    assert extract_letter("Answer: 6", ("5", "6", "5", "7", "8")) == "B"


# ----------------------------------------------------------------------------- gold checks

def _wrong_number(gold: str) -> str:
    return B.canonical_number(Fraction(gold) + 1)


def _letter_ambiguous(ex: Example, text: str) -> bool:
    """Option text that can't identify its letter: shared by several options, or itself
    letter-like (e.g. MMLU choice "B")."""
    norm = normalize_text(text)
    same = sum(normalize_text(o) == norm for o in ex.meta["options"])
    return same != 1 or re.fullmatch(r"\W*[a-e]\W*", norm) is not None


@needs_data
@pytest.mark.parametrize("name,split", TEXT_SPLITS)
def test_every_gold_scores(name, split):
    bench = get_benchmark(name)
    examples = load(name, split)
    assert len({ex.id for ex in examples}) == len(examples)
    skipped = 0
    for ex in examples:
        gold = ex.gold
        if bench.kind == "number":
            assert B.parse_number(gold) is not None, ex.id
            right = [f"Reasoning...\nAnswer: {gold}", f"The answer is {gold}.",
                     f"so\n#### {gold}", rf"\boxed{{{gold}}}", f"{gold} items.",
                     f"Answer: {float(gold):.2f}"]
            if Fraction(gold).denominator == 1 and abs(int(Fraction(gold))) >= 1000:
                right.append(f"Answer: ${int(Fraction(gold)):,}")
            wrong = [f"Answer: {_wrong_number(gold)}", _wrong_number(gold), "",
                     "I don't know"]
        else:
            options = ex.meta["options"]
            idx = bench.letters.index(gold)
            opt = options[idx]
            right = [f"Reasoning...\nAnswer: {gold}", f"The answer is ({gold}).",
                     f"{gold}) {opt}", f"**Answer:** {gold}"]
            wrong = ["", "I don't know"]
            for other in bench.letters[: len(options)]:
                if other != gold:
                    wrong.append(f"Reasoning...\nAnswer: {other}")
                    other_opt = options[bench.letters.index(other)]
                    if not _letter_ambiguous(ex, other_opt) and \
                            normalize_text(other_opt) != normalize_text(opt):
                        wrong.append(other_opt)
            if _letter_ambiguous(ex, opt):
                skipped += 1
            else:
                right += [opt, f"Answer: {opt}"]
        for text in right:
            assert bench.score(ex, text) == 1.0, (ex.id, gold, text)
        for text in wrong:
            assert bench.score(ex, text) == 0.0, (ex.id, gold, text)
    # only a handful of items have duplicated or letter-like option texts
    assert skipped <= max(5, len(examples) // 500), skipped


@needs_data
@pytest.mark.parametrize("split", ["train", "test"])
def test_gsm8k_reference_solutions_score(split):
    # Upstream solutions end in "#### n". Two train rows are exceptions: 356's worked
    # solution disagrees with its own "#### 66"; 7157 says "The final answer is 15 gallons
    # * 8 pints / gallon = 120" and we follow Kojima's first-number-after-trigger rule.
    known = {"gsm8k/train/356", "gsm8k/train/7157"}
    bad = {ex.id for ex in load("gsm8k", split) if score(ex, ex.meta["solution"]) != 1.0}
    assert bad <= known


@needs_data
def test_example_fields_and_questions():
    ex = load("svamp", "train")[0]
    assert ex.question.startswith("There are 87 oranges") and ex.question.endswith(
        "How big is each group of bananas?") and ex.gold == "145"
    aq = load("aqua", "validation")[0]
    assert "\nA) 32400\n" in aq.question and aq.meta["options"][0] == "32400"
    mm = load("mmlu", "validation")[0]
    assert mm.meta["subject"] == "abstract_algebra" and "\nD) 6" in mm.question
    he = load("humaneval", "test")[0]
    assert he.id == "HumanEval/0" and he.meta["prompt"] in he.question
    assert he.meta["entry_point"] == "has_close_elements"
    ma = load("multiarith", "test")[0]
    assert ma.question == ma.question.strip() and ma.gold == "10"
    # frozen, hashable, picklable
    with pytest.raises(Exception):
        ex.gold = "1"  # type: ignore[misc]
    assert hash(mm) == hash(pickle.loads(pickle.dumps(mm)))
    assert len({ex, ex, mm}) == 2 and mm.to_dict()["meta"]["options"][3] == "6"


@needs_data
def test_load_limit_seed():
    full = load("gsm8k", "test")
    a = load("gsm8k", "test", limit=50, seed=3)
    assert a == load("gsm8k", "test", limit=50, seed=3)
    assert a[:20] == load("gsm8k", "test", limit=20, seed=3)  # prefix-consistent
    assert a != load("gsm8k", "test", limit=50, seed=4)
    assert len(set(a)) == 50 and set(a) <= set(full)
    assert load("gsm8k", "test", limit=10_000) != full and \
        sorted(x.id for x in load("gsm8k", "test", limit=10_000)) == sorted(x.id for x in full)
    assert load("gsm8k", "test", limit=0) == []


# ----------------------------------------------------------------------------- pools

@needs_data
@pytest.mark.parametrize("protocol", ["paper", "peers"])
def test_pools_disjoint(protocol):
    train, ev = B.train_pool(protocol), B.eval_pool(protocol)
    train_all = [ex for exs in train.values() for ex in exs]
    eval_all = [ex for exs in ev.values() for ex in exs]
    assert not {ex.id for ex in train_all} & {ex.id for ex in eval_all}
    assert not {normalize_question(ex.question) for ex in train_all} & \
        {normalize_question(ex.question) for ex in eval_all}
    assert len({ex.id for ex in eval_all}) == len(eval_all)
    dropped = B.dropped_counts(protocol)
    assert dropped["multiarith"] == 6
    expected_train = {"gsm8k": 7473, "multiarith": 420, "svamp": 700, "aqua": 254,
                      "mmlu": 285, "humaneval": 40}
    assert {k: len(v) for k, v in train.items()} == \
        {k: n - dropped[k] for k, n in expected_train.items()}
    expected_eval = {"gsm8k": 1319, "multiarith": 180, "svamp": 300, "aqua": 254,
                     "mmlu": 1531 if protocol == "paper" else 153, "humaneval": 124}
    assert {k: len(v) for k, v in ev.items()} == expected_eval
    assert {ex.split for ex in train["aqua"]} == {"validation"}
    assert {ex.split for ex in train["mmlu"]} == {"dev"}


@needs_data
def test_pool_splits_and_humaneval_rule():
    ids = [ex.id for ex in load("humaneval", "test")]
    import random
    shuffled = list(ids)
    random.Random(0).shuffle(shuffled)
    assert B.humaneval_train_ids() == tuple(shuffled[:40])
    assert [ex.id for ex in B.pool("humaneval", "train")] == \
        [i for i in ids if i in set(shuffled[:40])]
    assert len(B.pool("humaneval", "eval")) == 124
    assert B.dropped_counts("paper")["gsm8k"] == 0
    with pytest.raises(ValueError):
        B.pool("gsm8k", "dev")
    with pytest.raises(ValueError):
        B.pool("gsm8k", "eval", protocol="nope")


@needs_data
def test_peers_mmlu_deterministic():
    import random
    a = B.pool("mmlu", "eval", protocol="peers")
    assert a == B.pool("mmlu", "eval", protocol="peers") and len(set(a)) == 153
    assert a == random.Random(888).sample(load("mmlu", "validation"), 153)
    assert set(a) <= set(B.pool("mmlu", "eval"))


# ----------------------------------------------------------------------------- humaneval

def test_extract_code_prefers_entry_point_block():
    text = ("Helper:\n```python\nx = 1\n```\nSolution:\n```python\ndef f(a):\n"
            "    return a\n```\nthen\n```\nprint(1)\n```")
    assert B.extract_code(text, "f").startswith("def f(a):")
    assert B.extract_code("```py\ny = 2\n```", None) == "y = 2\n"
    assert B.extract_code("    return 1\n", "f") == "    return 1\n"
    prompt = 'def f(a):\n    """doc"""\n'
    assert "def f" in B.build_solution(prompt, "```python\nreturn a + 1\n```", "f")
    compile(B.build_solution(prompt, "```python\nreturn a + 1\n```", "f"), "x", "exec")


@pytest.mark.slow
@needs_data
def test_humaneval_canonical_solutions_pass_in_sandbox():
    sandbox = pytest.importorskip("lemon.run.sandbox")
    bench = get_benchmark("humaneval")
    exs = load("humaneval", "test")
    limits = sandbox.SandboxLimits(timeout_s=20)

    def fenced(ex):  # full function in a fence, as the answer convention asks
        return "Here you go:\n```python\n" + ex.meta["prompt"] + ex.gold + "```\n"

    with cf.ThreadPoolExecutor(4) as pool:
        gold = list(pool.map(lambda e: bench.score(e, e.gold, limits=limits), exs))
        full = list(pool.map(lambda e: bench.score(e, fenced(e), limits=limits), exs[:20]))
        wrong = list(pool.map(lambda e: bench.score(e, "    return None\n"), exs[:20]))
    assert [e.id for e, s in zip(exs, gold) if s != 1.0] == []
    assert all(s == 1.0 for s in full)
    assert all(s == 0.0 for s in wrong)
    # faking success by exiting early must not pass
    ex = exs[0]
    assert bench.score(ex, "    import os; os._exit(0)\n") == 0.0
    assert bench.score(ex, "") == 0.0
    # the entry function alone still sees the prompt's helpers (HumanEval/10)
    he10 = next(e for e in exs if e.id == "HumanEval/10")
    only_entry = "```python\ndef make_palindrome(string: str) -> str:\n" + he10.gold + "```"
    assert bench.score(he10, only_entry) == 1.0


TOY_RECORD = '''

def _toyarith(name, split, index, row):
    return Example(f"{name}/{split}/{index}", name, split, row["q"], format_number(row["a"]), {})


RECORDS["toyarith"] = BenchmarkRecord("toyarith", "math", "number", ("train", "test"), ("nobody/toyarith", None),
                                      "train", "test", _toyarith)
'''

TOY_CHECK = r'''
import json
from lemon import benchmarks as B
from lemon.train.config import train_preset
ex = B.load("toyarith", "test")
print(json.dumps({"file": B.__file__, "listed": "toyarith" in B.BENCHMARKS,
                  "domain": B.get_benchmark("toyarith").domain,
                  "ids": [e.id for e in ex], "score": [B.score(e, "so... Answer: " + e.gold) for e in ex],
                  "wrong": B.score(ex[0], "Answer: 999"), "train": [e.id for e in B.pool("toyarith", "train")],
                  "eval": len(B.pool("toyarith", "eval")), "pool_splits": B.POOL_SPLITS["train"]["toyarith"],
                  "config": train_preset("smoke", benchmarks=("toyarith",)).benchmarks}))
'''


def test_a_new_benchmark_is_one_record(tmp_path):
    """Issue 31: a copy of the package with ONE record (and its row converter) appended to records.py, and data at
    <data dir>/toyarith/<split>.jsonl, is all it takes: loading, scoring, both pools, the train config know the
    benchmark."""
    import shutil
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "lemon", tmp_path / "lemon", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(root / "configs", tmp_path / "configs")  # the package reads its profiles from <repo>/configs
    with open(tmp_path / "lemon" / "benchmarks" / "records.py", "a") as f:
        f.write(TOY_RECORD)
    data = tmp_path / "data" / "toyarith"
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text('{"q": "What is 1 + 1?", "a": 2}\n{"q": "What is 2 + 5?", "a": 7}\n')
    (data / "test.jsonl").write_text('{"q": "What is 2 + 2?", "a": 4}\n{"q": "What is 3 * 3?", "a": "9.0"}\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "LEMON_DATA_DIR": str(tmp_path / "data")}
    out = subprocess.run([sys.executable, "-c", TOY_CHECK], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["file"].startswith(str(tmp_path))  # the copy was imported, not the repo's package
    assert r["listed"] and r["domain"] == "math" and r["ids"] == ["toyarith/test/0", "toyarith/test/1"]
    assert r["score"] == [1.0, 1.0] and r["wrong"] == 0.0 and r["eval"] == 2
    assert r["train"] == ["toyarith/train/0", "toyarith/train/1"] and r["pool_splits"] == "train"
    assert r["config"] == ["toyarith"]
