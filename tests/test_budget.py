"""The test-time budget hook of tests/conftest.py, run on an inner pytest session (pytester) with its limits shrunk so a
test of a few tenths of a second trips them: a fast test over its limit fails, a slow-marked one is summed, and a run
whose slow tests exceed their budget exits non-zero."""
from pathlib import Path

pytest_plugins = ["pytester"]
CONFTEST = (Path(__file__).parent / "conftest.py").read_text()


def _session(pytester, monkeypatch, fast_limit: float, slow_budget: float, env: str = "on"):
    for constant in ("FAST_LIMIT_S = 90.0", "SLOW_BUDGET_S = 15 * 60.0"):
        assert constant in CONFTEST  # the constants this test rewrites are still spelled as above
    src = CONFTEST.replace("FAST_LIMIT_S = 90.0", f"FAST_LIMIT_S = {fast_limit}").replace(
        "SLOW_BUDGET_S = 15 * 60.0", f"SLOW_BUDGET_S = {slow_budget}")
    pytester.makeconftest(src)
    pytester.makeini("[pytest]\nmarkers =\n  slow: budgeted long test\n")
    pytester.makepyfile(test_inner="""
        import time, pytest
        def test_quick():
            pass
        def test_sluggish():
            time.sleep(0.4)
        @pytest.mark.slow
        def test_long():
            time.sleep(0.4)
    """)
    monkeypatch.setenv("LEMON_TEST_BUDGET", env)
    return pytester.runpytest("-p", "no:cacheprovider", "-q")


def test_a_fast_test_over_its_limit_fails_and_slow_ones_are_summed(pytester, monkeypatch):
    res = _session(pytester, monkeypatch, fast_limit=0.2, slow_budget=60.0)
    res.assert_outcomes(passed=2, failed=1)
    res.stdout.fnmatch_lines(["*test_sluggish took 0 s (> 0 s) without the `slow` marker*",
                              "*slow tests: 1, 0 s in all (budget 60 s)*"])


def test_slow_tests_over_their_budget_fail_the_run(pytester, monkeypatch):
    res = _session(pytester, monkeypatch, fast_limit=30.0, slow_budget=0.1, env="on")
    res.assert_outcomes(passed=3)
    assert res.ret == 1
    res.stdout.fnmatch_lines(["*FAILED: the slow tests took 0 s, over their 0 s budget*"])


def test_slow_budget_off_only_warns(pytester, monkeypatch):
    res = _session(pytester, monkeypatch, fast_limit=30.0, slow_budget=0.1, env="off")
    res.assert_outcomes(passed=3)
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*WARNING (LEMON_TEST_BUDGET=off): the slow tests took*"])


def test_budget_off_warns_instead(pytester, monkeypatch):
    res = _session(pytester, monkeypatch, fast_limit=0.2, slow_budget=0.1, env="off")
    res.assert_outcomes(passed=3)
    assert res.ret == 0
    res.stdout.fnmatch_lines(["*WARNING (LEMON_TEST_BUDGET=off): *test_sluggish took*"])
