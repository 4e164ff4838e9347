"""``make run`` as the README's tour drives it: kill -9 the leader beat, the stack keeps running.

The real ``make run`` runs here, on a throwaway SQLite file (``VAR_DIR``), a
private web port and the suite's Redis (``REDIS_URL``), so the developer's
``var/db.sqlite3`` and port 6379 are never touched. Whichever database the
suite runs on, ``make run`` uses its own SQLite file: that is what it does.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.processes import ROOT, pid_of, wait_until
from tests.support.services import free_port

#: A fresh SQLite file needs every migration before the admin answers.
STARTUP_TIMEOUT = 240.0
#: SQLite has no advisory lock: the follower waits for the lease TTL (10 s).
TAKEOVER_TIMEOUT = 40.0


@dataclass
class AdminPoller:
    """Requests /admin/login/ every 0.2 s in a thread and keeps every answer after the first 200."""

    url: str
    answers: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self._stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    answer = str(response.status)
            except urllib.error.HTTPError as exc:
                answer = str(exc.code)
            except OSError as exc:
                answer = f"error: {exc}"
            if self.answers or answer == "200":
                self.answers.append(answer)
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()


@dataclass
class MakeRun:
    popen: subprocess.Popen[bytes]
    log_path: Path
    database: Path
    web_port: int
    #: Processes seen below make, {pid: start time}; killed at the end if one outlived it.
    children: dict[int, str | None] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def query(self, sql: str) -> list[tuple]:
        if not self.database.exists():
            return []
        conn = sqlite3.connect(f"file:{self.database}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute(sql).fetchall()
        except sqlite3.OperationalError:  # tables not migrated yet
            return []
        finally:
            conn.close()

    def lease(self) -> tuple[str, int] | None:
        rows = self.query("SELECT holder, token FROM scheduler_lease WHERE name = 'beat'")
        return (rows[0][0], int(rows[0][1])) if rows and rows[0][0] else None

    def beat_instances(self) -> dict[str, int]:
        return dict(self.query("SELECT instance_id, pid FROM scheduler_instance WHERE role = 'beat'"))


@pytest.fixture
def make_run(tmp_path: Path, redis_client: object, redis_url: str) -> Iterator[MakeRun]:
    """Start ``make run`` in its own session; SIGKILL whatever is left at the end."""
    # Not the suite's database, nor an outer make's jobserver (under `make test`).
    dropped = {"DATABASE_URL", "CELERY_BROKER_URL", "MAKEFLAGS", "MFLAGS", "MAKELEVEL"}
    env = {key: value for key, value in os.environ.items() if not key.startswith("SCHEDULER_") and key not in dropped}
    var_dir, port = tmp_path / "var", free_port()
    env.update(DJANGO_DEBUG="1", VAR_DIR=str(var_dir), WEB_PORT=str(port), REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
    log_path = tmp_path / "make-run.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            ["make", "run"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    run = MakeRun(popen, log_path, var_dir / "db.sqlite3", port)
    try:
        yield run
    finally:
        leftovers = {pid: started(pid) for pid in [popen.pid, *descendants(popen.pid)]}
        # The start time guards against a pid the system gave to someone else since.
        leftovers.update({pid: since for pid, since in run.children.items() if started(pid) == since})
        for pid in leftovers:
            if running(pid):
                _signal(pid, signal.SIGKILL)
        popen.wait(10)


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (honcho starts each child in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def started(pid: int) -> str | None:
    """The process's start time (in clock ticks since boot), or None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except OSError:
        return None


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may be slow to reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@pytest.mark.parametrize("stop", ["ctrl-c", "sigterm-to-make"])
def test_make_run__leader_killed__other_replica_leads_killed_one_restarts_admin_stays_up(
    make_run: MakeRun, stop: str
) -> None:
    # Given make run serving the admin, with one beat replica holding the lease
    poller = AdminPoller(f"http://127.0.0.1:{make_run.web_port}/admin/login/")
    thread = threading.Thread(target=poller.run, daemon=True)
    thread.start()
    try:
        answered = wait_until(
            lambda: poller.answers or make_run.popen.poll() is not None, timeout=STARTUP_TIMEOUT, interval=0.5
        )
        assert answered and make_run.popen.poll() is None, (
            f"the admin never answered; log tail:\n{make_run.log()[-4000:]}"
        )
        lease = wait_until(make_run.lease, timeout=30)
        assert lease, f"no beat took the lease; log tail:\n{make_run.log()[-4000:]}"
        holder, token = lease
        killed_pid = pid_of(holder)
        both = wait_until(lambda: len(make_run.beat_instances()) == 2, timeout=30)
        assert both, f"the standby beat never wrote its heartbeat; log tail:\n{make_run.log()[-4000:]}"
        before = make_run.beat_instances()

        # When the leader beat is killed with SIGKILL, as in the tour's step 4
        os.kill(killed_pid, signal.SIGKILL)

        # Then another replica takes the lease under a higher token (on SQLite, once
        # the TTL ran out: the standby or the restarted one, whichever tries first)
        def taken_over() -> tuple[str, int] | None:
            now = make_run.lease()
            return now if now and now[0] != holder and now[1] > token else None

        new_lease = wait_until(taken_over, timeout=TAKEOVER_TIMEOUT, interval=0.2)
        assert new_lease, f"nobody took over from {holder}; log tail:\n{make_run.log()[-4000:]}"

        # And the killed replica is started again: a new beat instance with a new, live pid
        def restarted() -> dict[str, int]:
            return {iid: pid for iid, pid in make_run.beat_instances().items() if iid not in before and running(pid)}

        fresh = wait_until(restarted, timeout=30, interval=0.2)
        assert fresh, f"the killed beat was not restarted; log tail:\n{make_run.log()[-4000:]}"
        assert killed_pid not in fresh.values() and not running(killed_pid)
        assert "respawn: .venv/bin/celery exited (status 137); restarting" in make_run.log()
        (standby_pid,) = [pid for iid, pid in before.items() if iid != holder]
        assert running(standby_pid), "the standby replica did not survive"
        assert make_run.popen.poll() is None, "make run stopped"
    finally:
        poller.stop()
        thread.join(10)

    # And the admin answered 200 from its first answer to the end
    failures = [answer for answer in poller.answers if answer != "200"]
    assert not failures, f"the admin did not answer 200 {len(failures)} times: {failures[:5]}"

    # When make run is stopped: Ctrl-C (SIGINT to its whole process group), or SIGTERM to make alone
    children = descendants(make_run.popen.pid)
    make_run.children = {pid: started(pid) for pid in children}
    assert len(children) >= 4, children
    if stop == "ctrl-c":
        os.killpg(make_run.popen.pid, signal.SIGINT)
    else:
        make_run.popen.terminate()

    # Then make and every process it started exit
    make_run.popen.wait(60)
    left = wait_until(lambda: not [pid for pid in children if running(pid)], timeout=30, interval=0.2)
    assert left, f"still running after make run exited: {[pid for pid in children if running(pid)]}"
