"""Start, signal and watch real ``celery`` processes from tests (bounded waits only)."""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

from django.db import connection

from tests.support.services import free_port

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))


class CeleryProcess:
    """One ``celery -A project ...`` child process whose output goes to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, *, cwd: Path = ROOT) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.cwd = cwd
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> CeleryProcess:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            self.argv, env=self.env, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def send(self, sig: int) -> None:
        """Signal the process itself (SIGSTOP/SIGCONT/SIGTERM), not its pool children."""
        if self.alive():
            os.kill(self.pid, sig)

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (a worker and its pool children)."""
        if self.popen is not None:
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 15.0) -> None:
        """Ask politely (SIGTERM), then SIGKILL the group after ``timeout``."""
        if self.popen is None:
            return
        if self.alive():
            self.send(signal.SIGCONT)
            self.send(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.kill_group(signal.SIGKILL)
        self.wait_for_exit()

    def wait_for_exit(self, timeout: float = 5.0) -> None:
        if self.popen is not None:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass

    def assert_exits(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the process to end; fail with its log tail otherwise."""
        assert self.popen is not None
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name}: still running {timeout}s on; log tail:\n{self.log()[-6000:]}") from None

    def wait_for_log(self, pattern: str, timeout: float = 20.0) -> re.Match[str]:
        """Wait until the log matches ``pattern``; fail with the log tail otherwise."""
        found = wait_until(lambda: re.search(pattern, self.log()), timeout=timeout)
        if not found:
            raise AssertionError(f"{self.name}: no {pattern!r} within {timeout}s; log tail:\n{self.log()[-3000:]}")
        return found


def wait_until(predicate: Callable[[], object], *, timeout: float, interval: float = 0.05) -> object:
    """Poll ``predicate`` until it returns something truthy or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


def process_state(pid: int) -> str:
    """Return the state letter of process ``pid`` (``T``: stopped, ``Z``: a zombie not yet reaped, ...), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or reaped between the open and the read
        return "gone"


def exited(pid: int) -> bool:
    """Return whether process ``pid`` has ended (gone, or a zombie not yet reaped)."""
    return process_state(pid) in {"gone", "Z"}


def freeze_outside_a_write(process: CeleryProcess) -> None:
    """SIGSTOP ``process`` at a moment it holds no database write lock.

    On SQLite every writer shares one write lock: a process stopped inside a
    write transaction stops them all until it resumes, so nobody could take
    anything over. That is SQLite, not the leases: stop it again elsewhere.
    """
    for _ in range(10):
        process.send(signal.SIGSTOP)
        assert wait_until(lambda: process_state(process.pid) == "T", timeout=5), f"{process.name} did not stop"
        if connection.vendor != "sqlite" or _sqlite_writable():
            return
        process.send(signal.SIGCONT)
        time.sleep(0.3)
    raise AssertionError(f"{process.name} held SQLite's write lock at every one of 10 stops")


def _sqlite_writable() -> bool:
    """Whether the test database's write lock can be taken within 3 s (the live processes hold it briefly)."""
    probe = sqlite3.connect(connection.settings_dict["NAME"], timeout=3, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        probe.close()


def pid_of(process_id: str) -> int:
    """Return the pid in a process id: ``<host>:<pid>[:<token>]``, or an older release's ``<host>-<pid>-<token>``."""
    if ":" in process_id:
        return int(process_id.split(":")[1])
    return int(process_id.rsplit("-", 2)[1])


def instance_lock_waiters() -> int:
    """Count the sessions blocked on another process's instance lock (PostgreSQL)."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = 'scheduler-instance-lock' AND wait_event_type = 'Lock'"
        )
        return cursor.fetchone()[0]


def beat_argv() -> list[str]:
    return [CELERY, "-A", "project", "beat", "-l", "info", "--pidfile="]


def end_all(processes: list[CeleryProcess]) -> None:
    """SIGKILL every process group at once: a finished test asks nothing more of them.

    A polite stop, one after another, waited for each worker's bodies in
    flight (a warm shutdown) and added seconds to every test that started
    workers; a test about shutting down signals its processes itself.
    """
    for process in processes:
        process.kill_group(signal.SIGKILL)
    for process in processes:
        process.wait_for_exit()


def worker_argv(
    name: str,
    *,
    concurrency: int = 2,
    queues: str | None = None,
    tasks: str = "tests.support.tasks",
    log_level: str = "info",
    heartbeat: bool = False,
) -> list[str]:
    """Return the command of a Celery worker ``<name>@<host>``: prefork, no gossip or mingle, heartbeats on request."""
    return [
        CELERY,
        "-A",
        "project",
        "worker",
        "-l",
        log_level,
        "-P",
        "prefork",
        "-c",
        str(concurrency),
        "-n",
        f"{name}@%h",
        "--include",
        tasks,
        "--without-gossip",
        "--without-mingle",
        *([] if heartbeat else ["--without-heartbeat"]),
        *(["-Q", queues] if queues else []),
    ]


def test_database_url() -> str:
    """Return a DATABASE_URL that points child processes at the test database."""
    params = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{params['NAME']}"
    user = quote(params.get("USER") or "")
    password = f":{quote(params['PASSWORD'])}" if params.get("PASSWORD") else ""
    return f"postgres://{user}{password}@{params['HOST']}:{params['PORT']}/{params['NAME']}"


@contextmanager
def runserver(env: dict[str, str]) -> Iterator[str]:
    """Serve the project with ``manage.py runserver`` in its own process for the block; yield its base URL."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/healthz", timeout=2):
                return True
        except OSError:
            return False

    try:
        assert wait_until(answers, timeout=30), "runserver did not answer within 30 s"
        yield url
    finally:
        server.terminate()
        server.wait(10)
