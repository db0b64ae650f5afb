"""`specd serve`'s process supervisor: restart a worker that dies, never take the gateway down.

Workers are caches (docs/design.md §1): while one restarts, the gateway re-opens its sessions
on it once it is back, or decodes plainly when the draft is the one missing. So a dead
worker is restarted with the same command (same port), after an exponential backoff
that resets once the worker has stayed up a while; the gateway is never restarted behind
the user's back: when it exits, serve stops everything.

However serve itself ends (`kill -9` included), its children end with it: each is told
serve's pid and asks Linux for SIGTERM when its parent dies (elsewhere a thread watches
its parent's pid), so no orphan keeps serve's ports.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

# The environment variable that tells a child the supervisor's pid.
SUPERVISOR_PID = "SPECD_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_supervisor() -> None:
    """In a child of `specd serve`: SIGTERM (a graceful stop) when serve dies, however it dies;
    exit at once if serve is already gone. Nothing outside a supervised child."""
    supervisor = os.environ.pop(SUPERVISOR_PID, None)  # popped: the child's own children are not serve's
    if supervisor is None:
        return
    pid = int(supervisor)
    if sys.platform.startswith("linux"):
        # Asked of the kernel, so it holds through a SIGKILL of serve; checked again after,
        # for a serve that died before the request was made.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    else:
        def watch() -> None:
            while os.getppid() == pid:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="specd-watch-serve", daemon=True).start()
    if os.getppid() != pid:
        sys.exit("specd: `specd serve`, which started this process, has already exited")


@dataclass(frozen=True)
class Backoff:
    """Delay before restart n (0-based): initial_s · 2ⁿ, at most max_s."""

    initial_s: float = 0.5
    max_s: float = 10.0
    stable_s: float = 30.0  # a child up this long has recovered: its next restart waits initial_s again

    def delay(self, restarts_in_row: int) -> float:
        return min(self.initial_s * 2 ** restarts_in_row, self.max_s)


@dataclass
class Child:
    """One supervised process and its restart bookkeeping."""

    name: str
    argv: list[str]  # serve rewrites a worker's --port once it knows the port
    restart: bool  # False: its exit ends the supervisor (the gateway)
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0  # over the supervisor's life
    in_row: int = 0  # restarts since the child last stayed up stable_s
    restart_at: float | None = None  # when a dead child is due to start again
    history: list[int] = field(default_factory=list)  # pids, oldest first


def _describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"code {returncode}"


class Supervisor:
    """Starts children, restarts the restartable ones when they die, stops them all."""

    def __init__(self, env: Mapping[str, str] | None = None, backoff: Backoff = Backoff(),
                 say: Callable[[str], None] = lambda line: print(line, flush=True),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.env = dict(env) if env is not None else None
        self.backoff = backoff
        self.say = say
        self.clock = clock
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str], restart: bool = True) -> Child:
        """Start a child now; `restart` says whether it is brought back when it dies."""
        child = Child(name, list(argv), restart)
        self.children.append(child)
        self._spawn(child)
        return child

    def _spawn(self, child: Child) -> None:
        env = {**(os.environ if self.env is None else self.env), SUPERVISOR_PID: str(os.getpid())}
        child.proc = subprocess.Popen(child.argv, env=env)
        child.started_at = self.clock()
        child.restart_at = None
        child.history.append(child.proc.pid)
        again = f" (restart {child.restarts})" if child.restarts else ""
        self.say(f"specd serve: {child.name} running as pid {child.proc.pid}{again}")

    @property
    def processes(self) -> list[subprocess.Popen]:
        return [c.proc for c in self.children if c.proc is not None]

    def check(self) -> bool:
        """Restart what is due; False once a child that must not be restarted has exited."""
        now = self.clock()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restarts += 1
                    self._spawn(child)
                continue
            proc = child.proc
            assert proc is not None  # spawned when started
            code = proc.poll()
            if code is None:
                continue
            if not child.restart:
                self.say(f"specd serve: {child.name} (pid {proc.pid}) exited with {_describe(code)}; "
                         f"stopping")
                return False
            if now - child.started_at >= self.backoff.stable_s:
                child.in_row = 0
            delay = self.backoff.delay(child.in_row)
            child.in_row += 1
            child.restart_at = now + delay
            self.say(f"specd serve: {child.name} (pid {proc.pid}) exited with {_describe(code)}; "
                     f"restarting it in {delay:g} s")
        return True

    def stop(self, grace_s: float) -> None:
        """SIGTERM every live child, then SIGKILL what is left after grace_s."""
        stop_all(self.processes, grace_s)


def stop_all(procs: Sequence[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every live process, then SIGKILL what is left after grace_s."""
    live = [proc for proc in procs if proc.poll() is None]
    for proc in live:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in live:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
