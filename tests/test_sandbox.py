"""Adversarial tests for lemon.run.sandbox: every hostile program must be contained and cleaned up.

Most containment guarantees only exist when the evaluator runs as root (as in CI); those tests
are skipped otherwise.
"""
from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lemon.run import sandbox
from lemon.run.sandbox import SandboxLimits, SandboxResult, run_python

ROOT = sys.platform.startswith("linux") and os.geteuid() == 0
root_only = pytest.mark.skipif(not ROOT, reason="uid switch / netns / NPROC need root on Linux")
SANDBOX_UIDS = range(sandbox._UID_BASE, sandbox._UID_BASE + sandbox._UID_SPAN)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def live_pids(uids) -> list[int]:
    """Non-zombie processes whose real uid is in ``uids`` (independent of the module's scan)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields["Uid"].split()[0]) in uids and "Z" not in fields["State"]:
            found.append(int(entry))
    return found


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "Z" not in dict(line.split(":", 1) for line in f if ":" in line)["State"]
    except OSError:
        return False


def tag(result: SandboxResult, key: str) -> str:
    """Value of a 'KEY=value' line the program printed to stdout or stderr."""
    for line in (result.stderr + "\n" + result.stdout).splitlines():
        if line.startswith(key + "="):
            return line.split("=", 1)[1]
    raise AssertionError(f"{key}= not found in {result!r}"[:2000])


# Prefix for hostile programs: reports its uid and working directory on stderr first.
REPORT = "import os, sys\nprint(f'UID={os.getuid()}\\nCWD={os.getcwd()}', file=sys.stderr, flush=True)\n"

FORK_BOMB = REPORT + textwrap.dedent("""
    while True:
        try:
            os.fork()
        except OSError:
            pass
""")
MEMORY_BOMB = REPORT + "x = bytearray(10 * 1024**3)\nprint('allocated')\n"
GROWING_MEMORY = REPORT + "chunks = []\nwhile True:\n    chunks.append(b'x' * (1 << 24))\n"
INFINITE_LOOP = REPORT + "while True:\n    pass\n"
DAEMON_ESCAPE = REPORT + textwrap.dedent("""
    import time
    if os.fork() == 0:          # double fork + setsid: leaves the process group and session
        os.setsid()
        if os.fork() == 0:
            print(f"DAEMON={os.getpid()}", flush=True)
            os.close(1); os.close(2)
            time.sleep(300)
        os._exit(0)
    time.sleep(0.3)
    print("parent done")
""")
FLOOD = "import os, sys\n" + textwrap.dedent("""
    chunk = "x" * (1 << 20)
    for _ in range(100):
        sys.stdout.write(chunk)
    sys.stderr.write("e" * (20 << 20))
    print(f"\\nUID={os.getuid()}\\nCWD={os.getcwd()}", file=sys.stderr)  # after the flood
    print("END")
""")


# ---------------------------------------------------------------- basic outcomes

def test_passing_code_passes():
    r = run_python("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\nprint('ok')\n")
    assert r.status == "passed" and r.passed
    assert r.returncode == 0 and r.stdout == "ok\n" and r.stderr == "" and not r.truncated
    assert r.duration_s < 5


def test_assert_failure_fails():
    r = run_python("assert 1 + 1 == 3, 'wrong'\n")
    assert r.status == "failed" and not r.passed
    assert r.returncode == 1 and "AssertionError: wrong" in r.stderr


def test_syntax_error_and_exit_code_fail():
    assert run_python("def f(:\n").status == "failed"
    assert run_python("import sys; sys.exit(3)").returncode == 3


def test_stdin_is_closed():
    r = run_python("input()")
    assert r.status == "failed" and "EOFError" in r.stderr


def test_file_size_limit():
    r = run_python("open('big', 'wb').write(b'x' * (5 << 20))", SandboxLimits(max_file_mb=1))
    assert r.status == "failed" and "File too large" in r.stderr


# ---------------------------------------------------------------- time and memory

def test_infinite_loop_times_out_within_bound():
    t0 = time.monotonic()
    r = run_python(INFINITE_LOOP, SandboxLimits(timeout_s=1.5))
    assert r.status == "timeout" and r.returncode == -signal.SIGKILL
    assert 1.4 < r.duration_s < 4 and time.monotonic() - t0 < 4


def test_sleeping_program_hits_wall_clock():
    r = run_python("import time; time.sleep(60)", SandboxLimits(timeout_s=1))
    assert r.status == "timeout" and r.duration_s < 3


def test_cpu_limit_is_enforced_before_wall_clock():
    r = run_python(INFINITE_LOOP, SandboxLimits(timeout_s=20, cpu_s=1))
    assert r.status == "timeout" and r.returncode == -signal.SIGXCPU and r.duration_s < 6


@pytest.mark.parametrize("program", [MEMORY_BOMB, GROWING_MEMORY], ids=["10GB", "growing"])
def test_memory_bomb_is_contained(program):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_python(program, SandboxLimits(memory_mb=512, timeout_s=10))
    assert r.status == "memory" and "MemoryError" in r.stderr and "allocated" not in r.stdout
    # the evaluating process survives and never held the allocation itself
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 50 * 1024  # KiB


# ---------------------------------------------------------------- processes

@root_only
def test_fork_bomb_is_contained_and_fully_killed():
    before = time.monotonic()
    r = run_python(FORK_BOMB, SandboxLimits(timeout_s=2))
    assert r.status == "timeout" and not r.passed
    assert time.monotonic() - before < 6
    uid = int(tag(r, "UID"))
    assert uid in SANDBOX_UIDS
    assert live_pids({uid}) == []
    # the host is healthy: we can still spawn processes promptly
    t0 = time.monotonic()
    assert subprocess.run(["true"], timeout=10).returncode == 0
    assert time.monotonic() - t0 < 2


@root_only
def test_setsid_daemon_is_killed_after_run():
    r = run_python(DAEMON_ESCAPE)
    assert r.status == "passed" and "parent done" in r.stdout
    daemon = int(tag(r, "DAEMON"))
    assert not pid_alive(daemon)
    assert live_pids({int(tag(r, "UID"))}) == []


@root_only
def test_runs_as_unprivileged_uid_without_groups_or_new_privs():
    code = textwrap.dedent("""
        import os
        print(f"UID={os.getuid()} {os.geteuid()} {os.getgid()}")
        print(f"GROUPS={os.getgroups()}")
        print("NNP=" + [l for l in open("/proc/self/status") if l.startswith("NoNewPrivs")][0].split()[1])
        try:
            os.kill(os.getppid(), 0)   # signal 0: permission check only
            print("SIGNAL=allowed")
        except PermissionError:
            print("SIGNAL=denied")
    """)
    r = run_python(code)
    uid, euid, gid = map(int, tag(r, "UID").split())
    assert uid == euid == gid and uid in SANDBOX_UIDS
    assert tag(r, "GROUPS") == "[]" and tag(r, "NNP") == "1" and tag(r, "SIGNAL") == "denied"


# ---------------------------------------------------------------- filesystem, env, network

@pytest.fixture
def world_readable_dir():
    # pytest's tmp_path sits under a 0700 directory, which alone would stop the sandbox uid; use
    # a world-traversable root-owned directory so only the file permissions protect the canary.
    d = tempfile.mkdtemp(prefix="lemon-canary-")
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d)


@root_only
def test_cannot_delete_or_modify_root_owned_canary(world_readable_dir, tmp_path):
    canary = os.path.join(world_readable_dir, "canary.txt")
    hidden = tmp_path / "canary.txt"
    for path in (canary, hidden):
        with open(path, "w") as f:
            f.write("precious")
        os.chmod(path, 0o644)
    code = textwrap.dedent(f"""
        import os, shutil
        print("READ=" + open({canary!r}).read())
        for name, action in [("REMOVE", lambda: os.remove({canary!r})),
                             ("WRITE", lambda: open({canary!r}, "w").write("gone")),
                             ("CHMOD", lambda: os.chmod({canary!r}, 0o777)),
                             ("RMTREE", lambda: shutil.rmtree({world_readable_dir!r})),
                             ("HIDDEN", lambda: os.remove({str(hidden)!r})),
                             ("REPO", lambda: open({os.path.join(REPO, "sandbox_was_here")!r}, "w"))]:
            try:
                action()
                print(name + "=done")
            except OSError as exc:
                print(name + "=denied " + type(exc).__name__)
    """)
    r = run_python(code)
    assert r.status == "passed", r
    assert tag(r, "READ") == "precious"  # documented: world-readable files can be read
    for name in ("REMOVE", "WRITE", "CHMOD", "RMTREE", "HIDDEN", "REPO"):
        assert tag(r, name).startswith("denied"), (name, r.stdout)
    for path in (canary, hidden):
        with open(path) as f:
            assert f.read() == "precious"
    assert not os.path.exists(os.path.join(REPO, "sandbox_was_here"))


def test_environment_is_scrubbed(monkeypatch):
    secret = f"sk-lemon-{os.getpid()}-{time.time_ns()}"
    monkeypatch.setenv("LEMON_TEST_SECRET", secret)
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    code = textwrap.dedent(f"""
        import glob, os
        print("KEYS=" + ",".join(sorted(os.environ)))
        print("DIRECT=" + str(os.environ.get("LEMON_TEST_SECRET")))
        if {ROOT!r}:  # as root the evaluator's /proc/<pid>/environ must be unreadable too
            for path in glob.glob("/proc/[0-9]*/environ"):
                try:
                    data = open(path, "rb").read()
                except OSError:
                    continue
                if b"LEMON_TEST_SECRET" in data or b"OPENAI_API_KEY" in data:
                    print("LEAK=" + path)
    """)
    r = run_python(code)
    assert r.status == "passed", r
    assert tag(r, "KEYS") == "HOME,LANG,LC_ALL,PATH,TMPDIR"
    assert tag(r, "DIRECT") == "None"
    assert "LEAK=" not in r.stdout and secret not in r.stdout + r.stderr


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()


NET_PROBE = textwrap.dedent("""
    import socket
    print("IFACES=" + ",".join(name for _, name in socket.if_nameindex()))
    for host in ("127.0.0.1", "10.255.255.1"):
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect((host, {port}))
            print(f"{{host}}=connected")
        except OSError as exc:
            print(f"{{host}}=blocked {{exc!r}}")
""")


@root_only
def test_network_is_blocked(listener):
    r = run_python(NET_PROBE.format(port=listener))
    assert r.status == "passed", r
    assert tag(r, "IFACES") == "lo"  # only the (down) loopback of an empty namespace
    assert tag(r, "127.0.0.1").startswith("blocked")
    assert tag(r, "10.255.255.1").startswith("blocked")


@root_only
def test_network_flag_allows_loopback(listener):
    # control for the test above: the probe does work when the namespace is not created
    r = run_python(NET_PROBE.format(port=listener), SandboxLimits(network=True, timeout_s=10))
    assert tag(r, "127.0.0.1") == "connected"


# ---------------------------------------------------------------- output and sentinel

def test_100mb_of_output_is_truncated_without_hanging():
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = run_python(FLOOD, SandboxLimits(timeout_s=30))
    assert r.status == "passed" and r.truncated
    assert r.stdout.endswith("xxxxEND\n") and len(r.stdout) == 64 * 1024
    assert len(r.stderr) == 64 * 1024 and r.stderr.startswith("eeee")
    assert not os.path.exists(tag(r, "CWD"))
    assert r.duration_s < 15
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
    assert grown_kib < 50 * 1024  # the parent never held the 120 MB


def test_endless_output_times_out_with_capped_output():
    r = run_python("while True:\n    print('y' * 1000)\n",
                   SandboxLimits(timeout_s=1.5, max_output_bytes=1000))
    assert r.status == "timeout" and r.truncated and len(r.stdout) <= 1000


def test_os_exit_zero_passes_without_sentinel_but_not_with_one():
    harness = "{body}\nassert candidate(1) == 2\nprint('__LEMON_DONE_7f3a__')\n"
    early_exit = harness.format(body="import os\nos._exit(0)\ndef candidate(x):\n    return x + 1")
    honest = harness.format(body="def candidate(x):\n    return x + 1")
    # Documented limitation: exit status 0 alone cannot tell an early exit from success.
    assert run_python(early_exit).status == "passed"
    r = run_python(early_exit, require_sentinel="__LEMON_DONE_7f3a__")
    assert r.status == "failed" and r.returncode == 0
    assert run_python(honest, require_sentinel="__LEMON_DONE_7f3a__").status == "passed"


def test_sentinel_found_even_when_output_tail_is_truncated():
    code = "print('__SENTINEL__', flush=True)\nprint('z' * (1 << 20))\n"
    r = run_python(code, SandboxLimits(max_output_bytes=100), require_sentinel="__SENTINEL__")
    assert r.status == "passed" and r.truncated and "__SENTINEL__" not in r.stdout


def test_capture_finds_needle_split_across_chunks():
    cap = sandbox._Capture(4, b"NEEDLE")
    for byte in b"xxNEEDLEyy":
        cap.feed(bytes([byte]))
    assert cap.found and cap.text() == "LEyy" and cap.total == 10


# ---------------------------------------------------------------- cleanup and concurrency

def test_temp_dir_is_removed_even_with_unremovable_looking_content():
    code = REPORT + textwrap.dedent("""
        os.makedirs("a/b/c")
        open("a/b/c/f", "w").write("data")
        os.chmod("a/b", 0o000)
        open("locked", "w").close(); os.chmod("locked", 0o000)
    """)
    r = run_python(code)
    assert r.status == "passed", r
    cwd = tag(r, "CWD")
    assert os.path.basename(cwd).startswith("lemon-sandbox-") and not os.path.exists(cwd)


@root_only
def test_twenty_hostile_runs_in_parallel_are_contained():
    short = SandboxLimits(timeout_s=2)
    mem = SandboxLimits(timeout_s=20, memory_mb=512)  # must not time out under CPU contention
    jobs = ([(REPORT + "print('fine')\n", SandboxLimits(timeout_s=30), "passed")] * 6
            + [(REPORT + "assert False\n", SandboxLimits(timeout_s=30), "failed")] * 2
            + [(FORK_BOMB, short, "timeout")] * 2
            + [(MEMORY_BOMB, mem, "memory"), (GROWING_MEMORY, mem, "memory")]
            + [(MEMORY_BOMB, mem, "memory")]
            + [(INFINITE_LOOP, short, "timeout")] * 3
            + [(DAEMON_ESCAPE, SandboxLimits(timeout_s=30), "passed")] * 2
            + [(FLOOD, SandboxLimits(timeout_s=30), "passed")] * 2)
    assert len(jobs) == 20
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=20) as pool:
        results = list(pool.map(lambda job: run_python(job[0], job[1]), jobs))
    assert time.monotonic() - t0 < 40
    uids = set()
    for (code, _, expected), r in zip(jobs, results):
        assert r.status == expected, (expected, r.status, r.stderr[-500:])
        uids.add(int(tag(r, "UID")))
        assert not os.path.exists(tag(r, "CWD"))
        if code is DAEMON_ESCAPE:
            assert not pid_alive(int(tag(r, "DAEMON")))
    assert len(uids) == 20  # every concurrent run had its own uid (and NPROC budget)
    assert live_pids(uids) == []


@root_only
def test_non_root_fallback_still_runs_and_limits(tmp_path):
    # Run the module as 'nobody' to exercise the documented non-root fallback path.
    python = sandbox._child_python(True)
    assert python is not None
    path = REPO
    while path != "/":  # 'nobody' must be able to import the repo checkout
        if not os.stat(path).st_mode & 0o001:
            pytest.skip(f"{path} is not world-traversable")
        path = os.path.dirname(path)
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {REPO!r})
        from lemon.run.sandbox import SandboxLimits, run_python
        print(run_python("print('hi')").status)
        print(run_python("while True: pass", SandboxLimits(timeout_s=1)).status)
        print(run_python("x = bytearray(4 << 30)").status)
        print(run_python("import os; print(sorted(os.environ))").stdout.strip())
    """)
    proc = subprocess.run([python, "-I", "-c", script], user=65534, group=65534,
                          extra_groups=[], cwd="/", env={"PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "passed", "timeout", "memory", "['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']"]


# ---------------------------------------------------------------- API validation and errors

@pytest.mark.parametrize("kwargs", [
    {"timeout_s": 0}, {"timeout_s": -1}, {"timeout_s": float("nan")}, {"timeout_s": float("inf")},
    {"timeout_s": True}, {"cpu_s": 0}, {"cpu_s": 1.5}, {"memory_mb": 10}, {"max_processes": 0},
    {"max_output_bytes": 0}, {"max_file_mb": -1}, {"network": "no"},
])
def test_bad_limits_raise_value_error(kwargs):
    (field,) = kwargs
    with pytest.raises(ValueError, match=f"SandboxLimits.{field}"):
        SandboxLimits(**kwargs)


def test_limits_are_frozen_and_types_checked():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SandboxLimits().timeout_s = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        run_python("print(1)", {"timeout_s": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        run_python(b"print(1)")  # type: ignore[arg-type]


def test_sandbox_failures_are_reported_as_error(monkeypatch):
    def broken_popen(*args, **kwargs):
        raise OSError("spawn refused")
    monkeypatch.setattr(sandbox.subprocess, "Popen", broken_popen)
    r = run_python("print(1)")
    assert r.status == "error" and "spawn refused" in r.stderr and r.returncode is None
    monkeypatch.undo()
    monkeypatch.setattr(sandbox, "_child_python", lambda drop_privileges: None)
    r = run_python("print(1)")
    assert r.status == "error" and "no Python interpreter" in r.stderr


@root_only
def test_namespace_failure_fails_closed(monkeypatch):
    monkeypatch.setattr(sandbox, "_CLONE_NEWIPC", 0x1)  # an invalid unshare() flag: EINVAL
    r = run_python("print('should not run')")
    assert r.status == "error" and r.returncode == 125 and r.stdout == ""
    assert "unshare" in r.stderr
    # network=True does not unshare at all, so it still runs
    assert run_python("print(1)", SandboxLimits(network=True)).status == "passed"
