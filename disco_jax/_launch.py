"""`disco-jax launch`: run a command as an N-process JAX job on this machine, over loopback.

    disco-jax launch -n 2 [--devices-per-process K] [--port P] [--timeout S] -- python train.py

Each child runs the same command with the job in its environment: `DISCO_JAX_COORDINATOR`
(`127.0.0.1:PORT`, a free port unless given), `DISCO_JAX_NUM_PROCESSES`, `DISCO_JAX_PROCESS_ID`,
`JAX_PLATFORMS=cpu` and, with `--devices-per-process K`, `XLA_FLAGS` asking for K CPU devices. The
script joins the job with `disco_jax.initialize_from_env()` (gloo collectives over TCP). Output
lines come back prefixed with `[pN] `. When a child fails, the others are terminated (their whole
process groups, SIGTERM then SIGKILL); the launcher exits with the first failing child's status,
124 on timeout, 0 when every child succeeded.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from disco_jax._distributed import COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
LOOPBACK = "127.0.0.1"
TERMINATE_GRACE_S = 5.0


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def child_env(
    base: dict[str, str], *, port: int, num_processes: int, process_id: int, devices_per_process: int | None
) -> dict[str, str]:
    """The environment of child `process_id`: `base` plus the job's variables."""
    env = dict(base)
    env[COORDINATOR_ENV] = f"{LOOPBACK}:{port}"
    env[NUM_PROCESSES_ENV] = str(num_processes)
    env[PROCESS_ID_ENV] = str(process_id)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_process is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
        env["XLA_FLAGS"] = " ".join(flags + [f"{DEVICE_COUNT_FLAG}={devices_per_process}"])
    return env


@dataclasses.dataclass
class LaunchResult:
    returncodes: list[int | None]  # None: killed by the launcher before it exited on its own
    outputs: list[str]  # each child's stdout and stderr, interleaved as written
    timed_out: bool
    exit_code: int  # what `disco-jax launch` exits with
    terminated: list[int] = dataclasses.field(default_factory=list)  # process ids the launcher stopped


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    devices_per_process: int | None = None,
    port: int | None = None,
    timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    on_line: Callable[[int, str], None] | None = None,
    cwd: str | None = None,
) -> LaunchResult:
    """Run `command` as `num_processes` processes of one job on loopback and wait for all of them.

    `on_line(process_id, line)` is called for each output line as it arrives. If a child exits
    non-zero, or `timeout_s` passes, every child still running is terminated."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if not command:
        raise ValueError("no command to launch")
    port = free_port() if port is None else port
    base = dict(os.environ if env is None else env)
    outputs: list[list[str]] = [[] for _ in range(num_processes)]
    children: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    timed_out, first_failure = False, None
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    running: list[int] = []
    try:
        for i in range(num_processes):
            child = subprocess.Popen(
                list(command),
                env=child_env(
                    base, port=port, num_processes=num_processes, process_id=i, devices_per_process=devices_per_process
                ),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=cwd,
                start_new_session=True,
            )  # its own process group: terminating it reaches its children
            children.append(child)
            reader = threading.Thread(target=_read_lines, args=(child, i, outputs[i], on_line), daemon=True)
            reader.start()
            readers.append(reader)
        while True:
            codes = [c.poll() for c in children]
            failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                first_failure = failed[0]
                break
            if all(code == 0 for code in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.05)
    finally:
        running = [i for i, c in enumerate(children) if c.poll() is None]
        _terminate([children[i] for i in running])
        for reader in readers:
            reader.join(timeout=TERMINATE_GRACE_S)
    codes = [c.returncode for c in children]
    if timed_out:
        exit_code = 124
    elif first_failure is not None:
        code = codes[first_failure]
        exit_code = 128 - code if code < 0 else code
    else:
        exit_code = 0
    return LaunchResult(codes, ["".join(lines) for lines in outputs], timed_out, exit_code, running)


def _read_lines(
    child: subprocess.Popen, process_id: int, sink: list[str], on_line: Callable[[int, str], None] | None
) -> None:
    for raw in iter(child.stdout.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        sink.append(line)
        if on_line is not None:
            on_line(process_id, line)
    child.stdout.close()


def _terminate(children: list[subprocess.Popen]) -> None:
    """SIGTERM the process group of each child, then SIGKILL what is left after a grace period."""
    for child in children:
        _signal_group(child, signal.SIGTERM)
    end = time.monotonic() + TERMINATE_GRACE_S
    for child in children:
        try:
            child.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(child, signal.SIGKILL)
            child.wait()
    for child in children:  # anything the child left behind in its group
        _signal_group(child, signal.SIGKILL)


def _signal_group(child: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(child.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(
    command: Sequence[str],
    num_processes: int,
    devices_per_process: int | None,
    port: int | None,
    timeout_s: float | None,
) -> int:
    """`disco-jax launch`: stream the children's output prefixed with `[pN] `; return the exit code."""
    command = list(command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("disco-jax launch: give the command after '--', e.g. disco-jax launch -n 2 -- python train.py")
    lock = threading.Lock()

    def print_line(process_id: int, line: str) -> None:
        with lock:
            sys.stdout.write(f"[p{process_id}] {line if line.endswith(chr(10)) else line + chr(10)}")
            sys.stdout.flush()

    result = launch(
        command,
        num_processes,
        devices_per_process=devices_per_process,
        port=port,
        timeout_s=timeout_s,
        on_line=print_line,
    )
    if result.exit_code:
        why = "timed out" if result.timed_out else f"a process failed (exit statuses {result.returncodes})"
        stopped = f"; terminated process(es) {result.terminated}" if result.terminated else ""
        print(f"disco-jax launch: {why}{stopped}", file=sys.stderr)
    return result.exit_code
