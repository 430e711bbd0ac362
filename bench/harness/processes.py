"""The processes the harness starts, and their end, whatever way the harness ends.

Every system under test is started in a session of its own (systems._spawn:
start_new_session), and every such session leader is registered here the moment
it starts. A system ends the same way whether it is stopped after its points, or
the harness gets SIGTERM or Ctrl-C, or the harness fails: every process of its
session and tree is continued first (SIGCONT: one paused by --pause-idle would
otherwise keep SIGTERM pending for good), its leader gets SIGTERM (the serve
runner shuts Serve and Ray down; `vllm serve` its engine), and whatever is left
of the session after the grace time gets SIGKILL. Ray's workers run in process
groups of their own, so the session, not the group, is what is swept.

    with processes.stop_on_signals():   # SIGTERM, SIGINT, SIGHUP: stop everything registered, then exit
        ...

Normal and exceptional exits are covered by the callers' own `finally: stop()`
and, for anything still registered, by an atexit hook.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from bench.harness.profiler import process_tree

STOP_GRACE_S = 120.0  # a stop after a run: the serve runner's serve.shutdown() + ray.shutdown() take up to a minute
SIGNAL_GRACE_S = 30.0  # a stop on SIGTERM / Ctrl-C: the user wants out; then SIGKILL
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

_started: dict[int, subprocess.Popen] = {}  # session leader pid -> its Popen, while it may be running
_lock = threading.Lock()


def register(proc: subprocess.Popen) -> subprocess.Popen:
    """A session leader the harness started (start_new_session=True): ended with everything else."""
    with _lock:
        _started[proc.pid] = proc
    return proc


def registered() -> list[subprocess.Popen]:
    with _lock:
        return list(_started.values())


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):  # exited meanwhile (or its pid reused by another user's)
        pass


def session_members(sid: int) -> list[int]:
    """The live processes of session `sid` (a session leader's pid), zombies left out."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            members.append(int(entry))
    return members


def _everything(procs: list[subprocess.Popen]) -> set[int]:
    roots = [p.pid for p in procs]
    return set(process_tree(roots)) | {pid for root in roots for pid in session_members(root)}


def pause(roots: list[int]) -> list[int]:
    """SIGSTOP every process under `roots`; returns the pids, for resume()."""
    paused = list(process_tree(roots))
    for pid in paused:
        _send(pid, signal.SIGSTOP)
    return paused


def resume(pids: list[int]) -> None:
    for pid in pids:
        _send(pid, signal.SIGCONT)


def terminate(procs: list[subprocess.Popen], grace_s: float = STOP_GRACE_S) -> None:
    """Continue, then end, these session leaders and everything in their sessions and trees:
    SIGCONT to all, SIGTERM to the leaders, up to `grace_s` for them to exit (one deadline for
    all), then SIGKILL to whatever is left. Unregisters them."""
    resume(sorted(_everything(procs)))  # before SIGTERM: a stopped process would keep it pending
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    # What is left: a leader that ignored SIGTERM, or processes its shutdown left behind
    # (Ray's workers are in process groups of their own, so killpg alone misses them).
    for pid in _everything(procs):
        _send(pid, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # a process in uninterruptible sleep: nothing more to do
            pass
        with _lock:
            _started.pop(proc.pid, None)


def stop_all(grace_s: float = SIGNAL_GRACE_S) -> int:
    """Ends every registered system (terminate); returns how many there were."""
    procs = registered()
    if procs:
        terminate(procs, grace_s)
    return len(procs)


def _on_signal(signum: int, _frame) -> None:
    name = signal.Signals(signum).name
    if _stopping.is_set():  # a second Ctrl-C while stopping: no more grace
        stop_all(grace_s=0)
        raise SystemExit(128 + signum)
    _stopping.set()
    try:
        count = len(registered())
        if count:
            print(
                f"\nbench: {name}: continuing and stopping the {count} system process session(s) the harness "
                f"started (up to {SIGNAL_GRACE_S:.0f} s; again to kill them at once)",
                file=sys.stderr,
                flush=True,
            )
        stop_all()
    finally:
        _stopping.clear()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


_stopping = threading.Event()


@contextmanager
def stop_on_signals():
    """While inside: SIGTERM, SIGINT and SIGHUP stop every system the harness started (resumed
    first), then end the harness (SystemExit 128 + signal; KeyboardInterrupt for Ctrl-C). The
    previous handlers come back on the way out. Outside the main thread it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _on_signal) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@atexit.register
def _at_exit() -> None:
    stop_all()
