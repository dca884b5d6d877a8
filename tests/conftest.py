"""Test-time budget of README's suite (issue 28), enforced so the suite cannot creep back past CI's limit:

- a test NOT marked `slow` that takes more than FAST_LIMIT_S (setup + call + teardown) fails, naming its time;
- the `slow`-marked tests together may take SLOW_BUDGET_S: their sum is printed at the end of every run, and a run over
  it exits non-zero. The same 26 slow tests took 528 s on an idle 2-core AVX2 AMD EPYC (fresh clone of 7bf40c0, LOG.md
  session 22) and 774 s on CI's 2-core Intel Xeon (AVX-512/AMX, 2026-12-06: the notebook study 307 s vs 208 s), so the
  budget is 15 min: with the ~5 min of fast tests the suite stays under README's ~25-min goal on the slower machine.

Both limits are for an idle 2-core machine of the slowest kind CI runs on (the Xeon above, not the EPYC). A machine busy
with other jobs can push a test over them: `LEMON_TEST_BUDGET=off` turns both checks into warnings for such a run (never
set in .ci/run).
Long runs belong in bench/ or experiments/ (README names them), with a small expected-number version here.
"""
import os

import pytest

FAST_LIMIT_S = 90.0
SLOW_BUDGET_S = 15 * 60.0
ENFORCE = os.environ.get("LEMON_TEST_BUDGET", "on").lower() not in ("off", "0", "no", "false")

_slow_total: dict[str, float] = {}


def _is_slow(item) -> bool:
    return item.get_closest_marker("slow") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    spent = item.stash.setdefault(_SPENT, {})
    spent[rep.when] = rep.duration
    total = sum(spent.values())
    if _is_slow(item):
        if rep.when == "teardown":
            _slow_total[item.nodeid] = total
        return
    # judge at the last phase that ran without failing already (call, or teardown for the setup+call+teardown sum)
    if rep.when in ("call", "teardown") and rep.passed and total > FAST_LIMIT_S and not item.stash.get(_FLAGGED, False):
        item.stash[_FLAGGED] = True
        msg = (f"{item.nodeid} took {total:.0f} s (> {FAST_LIMIT_S:.0f} s) without the `slow` marker: make "
               f"it faster, or mark it slow if it is worth a share of the {SLOW_BUDGET_S / 60:.0f}-minute slow budget "
               "(tests/conftest.py)")
        if ENFORCE:
            rep.outcome, rep.longrepr = "failed", msg
        else:
            item.config.stash.setdefault(_WARNINGS, []).append(msg)


_SPENT = pytest.StashKey[dict]()
_FLAGGED = pytest.StashKey[bool]()
_WARNINGS = pytest.StashKey[list]()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    total = sum(_slow_total.values())
    tr.write_sep("-", "test-time budget (tests/conftest.py)")
    for nodeid, s in sorted(_slow_total.items(), key=lambda kv: -kv[1]):
        tr.write_line(f"  slow {s:7.1f} s  {nodeid}")
    tr.write_line(f"slow tests: {len(_slow_total)}, {total:.0f} s in all (budget {SLOW_BUDGET_S:.0f} s); "
                  f"every other test must stay under {FAST_LIMIT_S:.0f} s")
    for msg in config.stash.get(_WARNINGS, []):
        tr.write_line(f"WARNING (LEMON_TEST_BUDGET=off): {msg}")
    if total > SLOW_BUDGET_S:
        word = "FAILED" if ENFORCE else "WARNING (LEMON_TEST_BUDGET=off)"
        tr.write_line(f"{word}: the slow tests took {total:.0f} s, over their {SLOW_BUDGET_S:.0f} s budget")


def pytest_sessionfinish(session, exitstatus):
    if ENFORCE and sum(_slow_total.values()) > SLOW_BUDGET_S and session.exitstatus == 0:
        session.exitstatus = 1
