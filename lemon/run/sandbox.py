"""Run untrusted generated Python (e.g. HumanEval completions) in a contained child process.

``run_python`` writes the code to ``main.py`` in a fresh temporary directory and runs
``python -I main.py`` in a new session; the code never runs in the evaluating process.

Contained (Linux, evaluator running as root, as in CI):
  * wall-clock timeout; RLIMIT_CPU, RLIMIT_AS (per process), RLIMIT_NPROC, RLIMIT_FSIZE,
    RLIMIT_NOFILE, RLIMIT_CORE=0;
  * a fresh unprivileged uid=gid per run (61000-64999, no supplementary groups, no_new_privs):
    it cannot write/delete root-owned files, signal other users' processes, read the
    evaluator's /proc/<pid>/environ or gain privileges via setuid binaries; RLIMIT_NPROC
    applies (the kernel ignores it for root).  Afterwards every process of that uid is
    SIGKILLed by scanning /proc, which also catches setsid()/double-fork escapes;
  * scrubbed environment (PATH, LANG, LC_ALL, HOME=TMPDIR=temp dir; nothing inherited, so API
    keys are invisible), stdin=/dev/null, temp dir removed afterwards;
  * network=False: an empty network namespace (loopback down: no TCP/UDP, not even to
    127.0.0.1; abstract unix sockets isolated) and a new IPC namespace.  If unshare() is
    refused the run fails closed with status "error"; network=True creates no namespaces;
  * stdout/stderr are read incrementally, only the last max_output_bytes of each are kept.

NOT contained:
  * any world-readable file can be read (repo sources, world-readable .env files); files
    written to world-writable dirs (/tmp, /dev/shm) persist; path-based unix sockets with
    permissive modes stay reachable;
  * no seccomp (all syscalls; kernel exploits are out of scope) and no cgroup: limits are per
    process, so the worst case is max_processes * memory_mb of RAM (32 GiB by default) and
    all CPUs; no disk quota beyond max_file_mb per file;
  * same PID namespace: other processes and their world-readable cmdlines are visible;
  * if sys.executable is not reachable by an unprivileged uid (e.g. pyenv/venv under /root), a
    system python of the same version is used, without the evaluator's venv packages.
  * When NOT root: no uid switch and no network namespace.  The code runs as the caller: it
    can read/modify the caller's files, read secrets from /proc/<evaluator>/environ, signal
    the evaluator and use the network; RLIMIT_NPROC counts all the caller's threads; only the
    process group is killed, so setsid() escapes survive; a temp dir the code made
    unremovable (chmod 000) may be left behind.

Exit status 0 means "passed", so a completion calling ``os._exit(0)`` before the tests would
pass: harnesses should print a sentinel after their asserts and pass ``require_sentinel``.  The
code can read its own file, so this guards against early exits, not deliberate cheating.
"""
from __future__ import annotations

import json, math, os, pwd, random, selectors, shutil, signal, stat, subprocess, sys
import tempfile, threading, time
from dataclasses import dataclass
from functools import cache
from typing import Literal

__all__ = ["SandboxLimits", "SandboxResult", "run_python"]


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    """Wall-clock limit for the whole run, in seconds."""
    cpu_s: int | None = None
    """CPU-time limit per process (RLIMIT_CPU) in seconds; None means ceil(timeout_s)."""
    memory_mb: int = 1024
    """Address-space limit per process (RLIMIT_AS), in MiB."""
    max_processes: int = 32
    """Maximum processes+threads of the sandbox uid (RLIMIT_NPROC)."""
    max_output_bytes: int = 64 * 1024
    """Bytes kept from the end of stdout and of stderr each; the rest is read and dropped."""
    max_file_mb: int = 16
    """Largest file the code may write (RLIMIT_FSIZE), in MiB."""
    network: bool = False
    """Allow network access (no network/IPC namespaces, e.g. where unshare is not permitted)."""

    def __post_init__(self) -> None:
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
            raise ValueError(f"SandboxLimits.timeout_s must be a finite number > 0, got {t!r}")
        for name, low in (("cpu_s", 1), ("memory_mb", 64), ("max_processes", 1),
                          ("max_output_bytes", 1), ("max_file_mb", 0)):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, int) or v < low) and not (
                    name == "cpu_s" and v is None):
                raise ValueError(f"SandboxLimits.{name} must be an int >= {low}, got {v!r}")
        if not isinstance(self.network, bool):
            raise ValueError(f"SandboxLimits.network must be a bool, got {self.network!r}")


@dataclass(frozen=True)
class SandboxResult:
    status: Literal["passed", "failed", "timeout", "memory", "error"]
    """passed | failed (nonzero exit) | timeout (wall/CPU) | memory | error (sandbox failure)."""
    returncode: int | None
    """Exit code (negative: killed by that signal); None if the program never ran."""
    duration_s: float
    """Wall-clock seconds including spawn and cleanup."""
    stdout: str
    """Last max_output_bytes of stdout."""
    stderr: str
    """Last max_output_bytes of stderr."""
    truncated: bool
    """True if stdout or stderr was longer than the cap."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


# A small trusted launcher configures the child and then execs the untrusted program.  It
# replaces Popen(preexec_fn=...), which can deadlock when the caller has other threads.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
cfg = json.loads(sys.argv[1])
try:
    libc = ctypes.CDLL(None, use_errno=True)
    if cfg["unshare"] and libc.unshare(cfg["unshare"]) != 0:  # fail closed, never run unisolated
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET|CLONE_NEWIPC) failed; "
                      "network=True skips it")
    for name, soft, hard in cfg["rlimits"]:
        cap = resource.getrlimit(getattr(resource, name))[1]  # non-root cannot exceed its hard cap
        if cap != resource.RLIM_INFINITY:
            soft, hard = min(soft, cap), min(hard, cap)
        resource.setrlimit(getattr(resource, name), (soft, hard))
    os.umask(0o077)
    if cfg["uid"] is not None:
        os.setgroups([]); os.setgid(cfg["uid"]); os.setuid(cfg["uid"])
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: setuid binaries stay unprivileged
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    os.execve(cfg["python"], [cfg["python"], "-I", "main.py"], dict(os.environ))
except BaseException as exc:
    os.write(2, f"lemon-sandbox: launcher failed: {exc!r}\n".encode()); os._exit(125)
"""
_CLONE_NEWIPC, _CLONE_NEWNET = 0x08000000, 0x40000000
_UID_BASE, _UID_SPAN = 61000, 4000
_uid_lock = threading.Lock()
_uid_next = random.randrange(_UID_SPAN)  # random start: separate evaluator processes rarely collide
_uids_in_use: set[int] = set()


def _uid_pids(uid: int, zombies: bool = False) -> dict[int, int]:
    """{pid: thread count} of processes whose real or effective uid is ``uid`` (scans /proc)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # exited while we looked
            continue
        # Zombies are already dead (init reaps orphans) and cannot be killed.
        if str(uid) in fields["Uid"].split()[:2] and (zombies or "Z" not in fields["State"]):
            found[int(entry)] = int(fields.get("Threads", "1"))
    return found


def _allocate_uid() -> int:
    global _uid_next
    with _uid_lock:
        for _ in range(_UID_SPAN):
            uid, _uid_next = _UID_BASE + _uid_next, (_uid_next + 1) % _UID_SPAN
            try:
                pwd.getpwuid(uid)  # a real account: never borrow it
            except KeyError:
                if uid not in _uids_in_use and not _uid_pids(uid, zombies=True):
                    _uids_in_use.add(uid)
                    return uid
    raise RuntimeError("no free sandbox uid")


def _kill_tree(proc: subprocess.Popen, uid: int | None) -> None:
    # proc is not reaped yet (see _exited), so its pid (= process group id) cannot be recycled.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    # Loop until a full scan finds no live process: a fork bomb may fork while we kill.
    deadline = time.monotonic() + 10
    while uid is not None and (pids := _uid_pids(uid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def _exited(proc: subprocess.Popen) -> bool:
    # Assumes nothing else in the process reaps arbitrary children (os.wait(), SIGCHLD handlers).
    try:  # WNOWAIT peeks without reaping
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


@cache
def _child_python(drop_privileges: bool) -> str | None:
    """An interpreter the sandbox uid can execute: every directory on the way must be o+x."""
    def reachable(path: str) -> bool:
        for p in {os.path.abspath(path), os.path.realpath(path)}:
            while True:
                try:
                    if not os.stat(p).st_mode & stat.S_IXOTH:
                        return False
                except OSError:
                    return False
                if p == os.path.dirname(p):
                    break
                p = os.path.dirname(p)
        return True
    if not drop_privileges or (reachable(sys.executable) and reachable(sys.base_prefix)):
        return sys.executable
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    return next((c for c in (f"/usr/bin/python{v}", f"/usr/local/bin/python{v}",
                             "/usr/bin/python3") if reachable(c)), None)


class _Capture:
    """Keeps the last ``cap`` bytes of a stream and whether ``needle`` ever appeared in it."""

    def __init__(self, cap: int, needle: bytes | None = None) -> None:
        self.cap, self.needle, self.buf, self.total, self.found = cap, needle, bytearray(), 0, False
        self._overlap = b""

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        if self.needle and not self.found:  # search the whole stream, not just the kept tail
            window = self._overlap + data
            self.found = self.needle in window
            self._overlap = window[max(0, len(window) - len(self.needle) + 1):]
        self.buf += data
        if len(self.buf) > 2 * self.cap:  # trim lazily so feeding stays linear
            del self.buf[:-self.cap]

    def text(self) -> str:
        return bytes(self.buf[-self.cap:]).decode("utf-8", "replace")


def _pump(proc: subprocess.Popen, out: _Capture, err: _Capture, deadline: float,
          uid: int | None) -> bool:
    """Read both pipes while the program runs; kill everything when it exits or at the
    deadline, then drain until EOF.  Returns True if the deadline was hit."""
    timed_out, killed_at = False, None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while True:
            now = time.monotonic()
            if killed_at is None and (_exited(proc) or now >= deadline):
                timed_out = not _exited(proc)
                _kill_tree(proc, uid)  # descendants may hold the pipes open; they die here
                killed_at = now
            if killed_at is not None and (not sel.get_map() or now > killed_at + 2):
                return timed_out
            for key, _ in sel.select(timeout=0.05 if sel.get_map() else 0.005):
                if data := os.read(key.fd, 1 << 16):
                    key.data.feed(data)
                else:
                    sel.unregister(key.fileobj)


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *,
               require_sentinel: str | None = None) -> SandboxResult:
    """Run ``code`` as a script in a sandboxed child process (thread-safe).

    With ``require_sentinel`` a zero exit is only "passed" if that string occurred in stdout.
    """
    if not isinstance(code, str) or not isinstance(limits, SandboxLimits):
        raise TypeError("run_python(code: str, limits: SandboxLimits)")
    start = time.monotonic()
    linux = sys.platform.startswith("linux")
    root = linux and os.geteuid() == 0
    uid = proc = workdir = None
    try:
        python = _child_python(root)
        if python is None:
            return SandboxResult("error", None, 0.0, "", "lemon-sandbox: no Python interpreter "
                                 "executable by an unprivileged uid", False)
        uid = _allocate_uid() if root else None
        workdir = tempfile.mkdtemp(prefix="lemon-sandbox-")
        script = os.path.join(workdir, "main.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        nproc = limits.max_processes
        if root:
            os.chown(workdir, uid, uid)
            os.chown(script, uid, uid)
        elif linux:  # RLIMIT_NPROC counts every thread of our own uid
            nproc += sum(_uid_pids(os.getuid(), zombies=True).values())
        cpu = limits.cpu_s or math.ceil(limits.timeout_s)
        mem, fsize = limits.memory_mb << 20, limits.max_file_mb << 20
        cfg = {"uid": uid, "python": python,
               "unshare": _CLONE_NEWNET | _CLONE_NEWIPC if root and not limits.network else 0,
               "rlimits": [("RLIMIT_CPU", cpu, cpu + 1),  # SIGXCPU, then SIGKILL 1 s later
                           ("RLIMIT_AS", mem, mem), ("RLIMIT_NPROC", nproc, nproc),
                           ("RLIMIT_FSIZE", fsize, fsize), ("RLIMIT_CORE", 0, 0),
                           ("RLIMIT_NOFILE", 256, 256)]}
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
               "HOME": workdir, "TMPDIR": workdir}
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(cfg)], cwd=workdir,
                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            return SandboxResult("error", None, time.monotonic() - start, "",
                                 f"lemon-sandbox: spawn failed: {exc!r}", False)
        out = _Capture(limits.max_output_bytes, require_sentinel and require_sentinel.encode())
        err = _Capture(limits.max_output_bytes)
        timed_out = _pump(proc, out, err, start + limits.timeout_s, uid)
        rc = proc.wait()
        stderr = err.text()
        if timed_out:
            status = "timeout"
        elif rc == 125 and stderr.startswith("lemon-sandbox:"):
            status = "error"
        elif rc == 0:
            status = "passed" if not require_sentinel or out.found else "failed"
        elif "MemoryError" in stderr:
            status = "memory"
        elif rc == -signal.SIGXCPU:
            status = "timeout"
        elif rc == -signal.SIGKILL:  # not us: CPU hard limit (SIGXCPU ignored) or OOM killer
            status = "timeout" if time.monotonic() - start >= cpu else "memory"
        else:
            status = "failed"
        return SandboxResult(status, rc, time.monotonic() - start, out.text(), stderr,
                             out.total > out.cap or err.total > err.cap)
    finally:
        if proc is not None:
            if proc.returncode is None:  # an unexpected exception above
                _kill_tree(proc, uid)
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        if uid is not None:
            with _uid_lock:
                _uids_in_use.discard(uid)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
