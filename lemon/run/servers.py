"""llama.cpp's `llama-server` processes that lemon starts and owns: the embedded default's workers.

One server per shipped model (capacity ladder small / medium / large, paper §3 — here SmolLM2-135M / Qwen2.5-Coder-0.5B
/ -1.5B), each with several slots and continuous batching, so the agents of a DAG level, the questions of an eval and
the rollouts of a GRPO group decode in one batch instead of one sequence at a time. The manager picks free ports, waits
for `/health` before first use, logs each server to `<log_dir>/<alias>.log`, restarts a crashed server (the OpenAI
backend then retries its in-flight requests: `ServerManager.backend`), and stops everything on close(), on interpreter
exit, and — via PR_SET_PDEATHSIG — even when its own process is SIGKILLed. Servers run in their own process group, so a
terminal Ctrl-C reaches lemon, which then shuts them down in order, instead of killing them mid-request.

Sizing (ServerConfig): `ctx_per_slot` = 8192 holds the spec schema's worst prompt (MAX_AGENTS = 8: a final agent sees 7
parents x max_context_chars 2400 + the task + the templates, ~6k tokens) plus a 1k-token reply; `-c` = slots x
ctx_per_slot (one private KV range per slot: `--no-kv-unified`). KV at f16 for 4 slots: 135M ~0.75 GB, 0.5B ~0.4 GB,
1.5B ~0.9 GB. Threads: every usable core per server, OpenMP waiters passive (ServerConfig.threads has the measurement).
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lemon.run.backends import BackendUnavailableError, ModelUnavailableError, OpenAIBackend, usable_cores
from lemon.run.models import ModelNotInstalledError, get_model

SETUP_HINT = ("run `bash scripts/setup.sh` (it builds llama-server into .venv/bin) or set "
              "LEMON_LLAMA_SERVER=/path/to/llama-server")


class ServerError(BackendUnavailableError):
    """A managed llama-server cannot serve; a BackendUnavailableError, so the executor stops instead of scoring 0."""


class ServerBinaryNotFoundError(ServerError):
    """No llama-server executable; the message names the fix (scripts/setup.sh or LEMON_LLAMA_SERVER)."""


class PortInUseError(ServerError):
    """A fixed port asked for in ServerConfig.port is taken by another process."""


class ServerStartError(ServerError):
    """A server exited or stayed unhealthy while starting; the message holds the tail of its log."""


class ServerCrashedError(ServerError):
    """A server kept dying: it was restarted ServerConfig.max_restarts times already."""


# Client settings under which a llama-server's greedy reply is reproducible: continuous batching decodes a request
# together with whatever else is in flight, and ggml's CPU kernels do not give bit-identical results for different batch
# shapes, nor for a prompt prefilled in pieces from its cache (llama.cpp issues #7052, #6950); one request at a time
# with the prompt cache off removes both (measured: bench/flip_rate.py, outputs/reference/flip-rate-20261205).
DETERMINISTIC = {"max_concurrency": 1, "extra_body": {"top_k": 0, "min_p": 0.0, "cache_prompt": False}}


@dataclass(frozen=True)
class ServerConfig:
    """How one llama-server is run (the command line is in ServerManager._command)."""

    slots: int = 4
    """Parallel sequences (`--parallel`); continuous batching decodes them together. Also the backend's
    max_concurrency."""
    ctx_per_slot: int = 8192
    """KV tokens per slot (prompt + reply); `-c` = slots * ctx_per_slot. See the module docstring for the sizing."""
    threads: int | None = None
    """Decode threads (`-t`); None = every usable core. With `env`'s OMP_WAIT_POLICY=PASSIVE (this build's barriers are
    OpenMP's) waiting threads sleep instead of spinning: measured here (bench/server_bench.py --only threads, LOG.md)
    -t 2 passive used as little CPU per token as -t 1 and took both cores when they were free, while -t 2 spinning used
    2-4x the CPU per token and collapsed beside other busy processes (2 shared cores)."""
    threads_batch: int | None = None
    """Prompt-processing threads (`-tb`); None = same as `threads`."""
    port: int | None = None
    """A fixed port; None = a free port chosen by the OS (the default: several runs can share a machine)."""
    startup_timeout_s: float = 180.0
    """How long a start (or restart) may take before ServerStartError: model load + first /health."""
    max_restarts: int = 3
    """Crashes tolerated per server before ServerCrashedError."""
    cache_ram_mib: int = 256
    """llama-server's host-RAM prompt cache (`--cache-ram`); its default of 8 GiB per server is too much beside
    training."""
    deterministic: bool = False
    """Replies that do not depend on what else is in flight: lemon's client sends one request at a time to this server
    and turns llama-server's prompt cache off (DETERMINISTIC). Greedy replies otherwise change with the batch they are
    decoded in (bench/flip_rate.py measures it); costs the server's batching throughput."""
    extra_args: tuple[str, ...] = ()
    """Further llama-server flags, appended as given."""
    env: tuple[tuple[str, str], ...] = (("OMP_WAIT_POLICY", "PASSIVE"),)
    """Extra environment variables of the server (see `threads`); a dict is accepted too."""

    def __post_init__(self):
        object.__setattr__(self, "extra_args", tuple(self.extra_args))
        object.__setattr__(self, "env", tuple(tuple(kv) for kv in (self.env.items() if isinstance(self.env, dict)
                                                                    else self.env)))
        checks = [(isinstance(self.slots, int) and 1 <= self.slots <= 64, "slots must be an int in 1..64"),
                  (isinstance(self.ctx_per_slot, int) and self.ctx_per_slot >= 512,
                   "ctx_per_slot must be an int >= 512"),
                  (self.threads is None or (isinstance(self.threads, int) and self.threads >= 1),
                   "threads must be a positive int or None (every usable core)"),
                  (self.threads_batch is None or (isinstance(self.threads_batch, int) and self.threads_batch >= 1),
                   "threads_batch must be a positive int or None"),
                  (self.port is None or (isinstance(self.port, int) and 1024 <= self.port <= 65535),
                   "port must be None (a free port) or an int in 1024..65535"),
                  (self.startup_timeout_s > 0 and self.max_restarts >= 0, "startup_timeout_s > 0, max_restarts >= 0"),
                  (isinstance(self.cache_ram_mib, int) and self.cache_ram_mib >= 0,
                   "cache_ram_mib must be an int >= 0"),
                  (all(isinstance(a, str) for a in self.extra_args), "extra_args must be strings"),
                  (all(len(kv) == 2 and all(isinstance(x, str) for x in kv) for kv in self.env),
                   "env must be (name, value) string pairs or a dict")]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"ServerConfig: {msg}; got {self}")


def find_binary(binary: str | Path | None = None) -> Path:
    """The llama-server to run: `binary`, else $LEMON_LLAMA_SERVER, else this environment's bin/ (where setup.sh puts
    it)."""
    cand = binary or os.environ.get("LEMON_LLAMA_SERVER") or Path(sys.prefix) / "bin" / "llama-server"
    p = Path(cand)
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise ServerBinaryNotFoundError(f"llama-server not found at {p}; {SETUP_HINT}")
    return p


def build_info(binary: Path) -> dict:
    """What setup.sh recorded about the build beside the binary (source sha256, cmake flags); {} for a foreign
    binary."""
    stamp = binary.with_name(binary.name + ".build")
    if not stamp.is_file():
        return {}
    return dict(line.split("=", 1) for line in stamp.read_text().splitlines() if "=" in line)


def free_port(host: str = "127.0.0.1", port: int = 0) -> int:
    """`port` when it can be bound now (0: any port the OS picks), else 0."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return 0
        return s.getsockname()[1]


_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _die_with_parent(parent_pid: int):
    """preexec_fn: the kernel SIGKILLs the server when the thread that forked it dies (we fork from a thread that lives
    as long as the manager, see ServerManager._spawner), so no server outlives lemon, SIGKILL of lemon included."""
    def fn():
        if _LIBC is not None:
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died between fork and prctl
            os._exit(1)
    return fn


@dataclass
class ManagedServer:
    """One running (or restartable) llama-server."""

    alias: str
    model_path: Path
    cfg: ServerConfig
    log_path: Path
    port: int = 0
    proc: subprocess.Popen | None = None
    restarts: int = 0
    startup_s: float | None = None  # seconds from spawn to healthy, last start
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class ServerManager:
    """Starts, health-checks, restarts and stops llama-servers; `backend(alias)` gives an OpenAIBackend bound to one.

        with ServerManager(log_dir) as m:
            m.add("qwen2.5-coder-0.5b", get_model("qwen2.5-coder-0.5b"), ServerConfig(slots=4))
            m.start()
            b = m.backend("qwen2.5-coder-0.5b")
    """

    def __init__(self, log_dir: str | Path | None = None, *, binary: str | Path | None = None, host: str = "127.0.0.1"):
        self.binary = find_binary(binary)
        self.build = build_info(self.binary)
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="lemon-servers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.host, self.servers = host, {}
        self._closed = False
        self._spawner = _Spawner()
        self._atexit = weakref.WeakMethod(self.close)
        atexit.register(_close_ref, self._atexit)

    # ---- lifecycle -------------------------------------------------------------------------------------------------
    def add(self, alias: str, model_path: str | Path, cfg: ServerConfig = ServerConfig()) -> ManagedServer:
        if alias in self.servers:
            raise ValueError(f"a server named {alias!r} is already managed; aliases: {list(self.servers)}")
        path = Path(model_path)
        if not path.is_file():
            raise ModelUnavailableError(f"llama-server {alias!r}: model file {path} does not exist")
        if cfg.port is not None and not free_port(self.host, cfg.port):
            raise PortInUseError(f"port {cfg.port} for llama-server {alias!r} is in use by another process; "
                                 "pick another ServerConfig.port or leave it None to let lemon choose a free one")
        s = self.servers[alias] = ManagedServer(alias, path, cfg, self.log_dir / f"{_safe(alias)}.log")
        return s

    def add_shipped(self, name: str, cfg: ServerConfig = ServerConfig(), alias: str | None = None) -> ManagedServer:
        try:
            path = get_model(name)
        except ModelNotInstalledError as e:
            raise ModelUnavailableError(f"llama-server {name!r}: {e}") from e
        return self.add(alias or name, path, cfg)

    def start(self) -> "ServerManager":
        """Spawn every server not running yet, then wait until all are healthy (they load their weights in parallel)."""
        todo = [s for s in self.servers.values() if not s.alive()]
        for s in todo:
            with s.lock:
                self._spawn(s)
        for s in todo:
            with s.lock:
                self._wait_healthy(s)
        return self

    def ensure(self, alias: str) -> str:
        """The server's base URL once it is healthy, restarting it if it died (or hangs past startup_timeout_s).
        Called by the backend on a connection error; concurrent callers share one restart (the per-server lock)."""
        s = self.server(alias)
        with s.lock:
            if self._closed:
                raise ServerError(f"llama-server {alias!r}: the manager is closed")
            deadline = time.monotonic() + s.cfg.startup_timeout_s
            while True:
                if not s.alive():
                    self._restart(s, "exited" if s.proc is not None else "never started")
                    return s.url
                if self._healthy(s):
                    return s.url
                if time.monotonic() > deadline:
                    self._restart(s, f"unhealthy for {s.cfg.startup_timeout_s:.0f}s")
                    return s.url
                time.sleep(0.2)

    def close(self) -> None:
        """Stop every server: SIGTERM to its process group, SIGKILL after 10 s. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for s in self.servers.values():
            with s.lock:
                _stop(s.proc)
        self._spawner.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- backends and reporting --------------------------------------------------------------------------------------
    def backend(self, alias: str, **kw) -> OpenAIBackend:
        """An OpenAIBackend for one managed server: max_concurrency = its slots (the backend queues beyond them, so a
        request's timeout covers decoding, not waiting), connection errors restart a dead server and retry."""
        s = self.server(alias)
        if not s.alive():
            self.start()
        # top_k=0 / min_p=0 switch off llama.cpp's extra default samplers: temperature / top_p then mean what they mean
        # on an OpenAI server (and in the in-process backend this replaces)
        kw = {"timeout_s": 1800.0, "max_retries": 3, "backoff_s": 0.2, "max_concurrency": s.cfg.slots,
              "extra_body": {"top_k": 0, "min_p": 0.0}, **(DETERMINISTIC if s.cfg.deterministic else {}), **kw}
        return OpenAIBackend(s.url, alias, recover=lambda: self.ensure(alias), kind="llama_server",
                             info=lambda: self.describe_server(alias), **kw)

    def describe_server(self, alias: str) -> dict:
        s = self.server(alias)
        return {"binary": str(self.binary), "build": self.build.get("key", "unknown (not built by scripts/setup.sh)"),
                "config": asdict(s.cfg), "threads": self.threads(s), "model_path": str(s.model_path),
                "log": str(s.log_path), "port": s.port, "restarts": s.restarts, "startup_s": s.startup_s}

    def describe(self) -> dict:
        return {a: self.describe_server(a) for a in self.servers}

    def server(self, alias: str) -> ManagedServer:
        if alias not in self.servers:
            raise KeyError(f"no managed llama-server {alias!r}; managed: {list(self.servers)}")
        return self.servers[alias]

    @staticmethod
    def threads(s: ManagedServer) -> int:
        return s.cfg.threads or usable_cores()

    def _command(self, s: ManagedServer) -> list[str]:
        c = s.cfg
        return [str(self.binary), "-m", str(s.model_path), "--alias", s.alias, "--host", self.host,
                "--port", str(s.port), "--parallel", str(c.slots), "--cont-batching", "--no-kv-unified",
                "-c", str(c.slots * c.ctx_per_slot), "-t", str(self.threads(s)),
                "-tb", str(c.threads_batch or self.threads(s)), "--cache-ram", str(c.cache_ram_mib),
                "--no-webui", "--jinja", *c.extra_args]

    def _spawn(self, s: ManagedServer) -> None:
        if self._closed:
            raise ServerError(f"llama-server {s.alias!r}: the manager is closed")
        if not s.port:
            s.port = s.cfg.port or free_port(self.host)
        log = open(s.log_path, "ab")
        log.write(f"\n===== lemon: starting {' '.join(self._command(s))} at {time.strftime('%FT%T')}\n".encode())
        log.flush()
        try:
            s.proc = self._spawner.run(
                subprocess.Popen, self._command(s), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent(os.getpid()),
                env={**os.environ, **dict(s.cfg.env)})
            log.write(f"===== lemon: pid {s.proc.pid}\n".encode())
        finally:
            log.close()

    def _wait_healthy(self, s: ManagedServer, retries_left: int = 2) -> None:
        t0, deadline = time.monotonic(), time.monotonic() + s.cfg.startup_timeout_s
        while not self._healthy(s):
            if not s.alive():
                tail = _tail(s.log_path)
                if retries_left and s.cfg.port is None and "couldn't bind" in tail.rsplit("===== lemon:", 1)[-1]:
                    s.port = free_port(self.host)  # lost the race for the free port: take another
                    self._spawn(s)
                    return self._wait_healthy(s, retries_left - 1)
                raise ServerStartError(f"llama-server {s.alias!r} exited with code {s.proc.returncode} while starting; "
                                       f"log {s.log_path}:\n{tail}")
            if time.monotonic() > deadline:
                _stop(s.proc)
                raise ServerStartError(f"llama-server {s.alias!r} not healthy after {s.cfg.startup_timeout_s:.0f}s "
                                       f"(ServerConfig.startup_timeout_s); log {s.log_path}:\n{_tail(s.log_path)}")
            time.sleep(0.1)
        s.startup_s = round(time.monotonic() - t0, 2)

    def _restart(self, s: ManagedServer, why: str) -> None:
        if s.restarts >= s.cfg.max_restarts:
            raise ServerCrashedError(f"llama-server {s.alias!r} {why} after {s.restarts} restarts "
                                     f"(ServerConfig.max_restarts); log {s.log_path}:\n{_tail(s.log_path)}")
        s.restarts += 1
        _stop(s.proc)
        with open(s.log_path, "ab") as f:
            f.write(f"\n===== lemon: server {why} (code {s.proc.returncode if s.proc else None}); restart "
                    f"{s.restarts}\n"
                    .encode())
        if s.cfg.port is None and not free_port(self.host, s.port):
            # the old port was taken meanwhile: the backend gets the new URL from ensure()
            s.port = free_port(self.host)
        self._spawn(s)
        self._wait_healthy(s)

    def _healthy(self, s: ManagedServer) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/health", timeout=5) as r:
                return r.status == 200 and json.loads(r.read() or b"{}").get("status", "ok") == "ok"
        except (OSError, ValueError):  # refused, reset, 503 while loading, timeout
            return False


class _Spawner:
    """Runs every fork on one long-lived daemon thread. PR_SET_PDEATHSIG fires when the *forking thread* exits, so a
    restart triggered from a short-lived executor thread must not fork there; a daemon thread (unlike a
    ThreadPoolExecutor's) is not joined before atexit handlers run, so close() still stops the servers gently at
    interpreter exit."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._loop, name="lemon-server-spawn", daemon=True)
        self._t.start()

    def _loop(self):
        while (job := self._q.get()) is not None:
            fut, fn, args, kw = job
            try:
                fut.set_result(fn(*args, **kw))
            except BaseException as e:  # handed to the caller
                fut.set_exception(e)

    def run(self, fn, *args, **kw):
        fut = Future()
        self._q.put((fut, fn, args, kw))
        return fut.result()

    def stop(self):
        self._q.put(None)


def _close_ref(ref) -> None:
    close = ref()
    if close is not None:
        close()


def _stop(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 30.0)):
        try:
            os.killpg(proc.pid, sig)  # the server's own process group (start_new_session)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def _safe(alias: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in alias)
