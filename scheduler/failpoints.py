"""Named failpoints: the places where a test makes this process crash, freeze, fail or stall.

Each ``failpoint("name")`` call marks a place where a process can stop in
the middle of a step that other processes depend on (a claim, a fenced
commit, a publish, a shard acquisition...). ``POINTS`` lists them all. What
a failpoint does is chosen by the environment, read once per process, when
this module is first imported (a prefork pool child inherits its parent's)::

    SCHEDULER_FAILPOINTS="dispatch.commit.after_fence=crash;worker.after_body=freeze 40@2"

``;`` separates entries, each ``<name>=<action>[@<k>]``:

- ``crash``: SIGKILL this process (no cleanup, no rollback but the server's).
- ``freeze N``: stop this whole process for N seconds (SIGSTOP), then let
  it go on (SIGCONT, sent by a small ``sh`` helper started just before).
  Not a sleep: a sleep stops only the calling thread, while the claim
  renewer, the beat's reconcile thread and the server's view of the
  sessions carry on. A frozen process (a VM pause, a stopped container, a
  long GC pause) stops every thread: its claim and its lease stop being
  renewed, its open transaction sits idle holding its locks, and on resume
  it sees its clock jump, which is what the guard and the beat must survive.
- ``error``: raise the connection error the failpoint's peer would raise:
  ``django.db.OperationalError`` at a database point (what Django raises
  when psycopg or sqlite3 loses its connection), ``kombu.exceptions.OperationalError``
  at a broker point, ``BrokerUnavailable`` (caused by kombu's error) at a
  point whose peer is the outbox (``POINTS`` says which is which).
- ``delay N``: sleep N seconds in the calling thread, holding whatever it holds.

``@k`` fires on the k-th hit only (counted from 1); without it, on every hit.

Hits are counted in this process, unless ``SCHEDULER_FAILPOINTS_DIR`` names
a directory: then every process given that directory shares one count per
failpoint (a worker's pool children, a process restarted after a crash and
both beat replicas: ``crash@1`` fires once in the whole cluster), hits count
only once a file ``armed`` exists there (the test creates it when the
cluster is in the state it wants), and each firing appends a JSON line
(name, action, hit, pid, parent pid, time) to ``fired.jsonl`` there.

With the variable unset (production), ``failpoint()`` costs one dict lookup.
An unknown name or a malformed action stops the process at import with
``ImproperlyConfigured``: a typo must not make a test pass that injected nothing.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

logger = logging.getLogger(__name__)

#: What a failpoint's ``error`` raises.
DATABASE = "database"
BROKER = "broker"
OUTBOX = "outbox"

#: Every failpoint, with the peer whose connection error ``error`` raises, and where it is.
POINTS: dict[str, str] = {
    # Worker (a prefork pool child).
    "worker.claim.before": DATABASE,  # executions.claim, before the claim's UPDATE
    "worker.claim.after": DATABASE,  # executions.claim, the claim committed, not yet renewed, body not started
    "worker.renew": DATABASE,  # renewer.ClaimRenewer._renew, before the UPDATE that renews the process's claims
    "worker.after_body": DATABASE,  # worker.ExecutionTask.__call__, the body returned, the outcome not written
    "worker.retry.send": BROKER,  # worker.ExecutionTask.retry, marked retrying, Celery's retry message not sent
    "outcome.in_transaction": DATABASE,  # executions._record_outcome, schedule and execution rows written and locked
    "running.fenced": DATABASE,  # running.RunningExecution.fenced, the block's writes done, its outcome not
    "running.checkpoint": DATABASE,  # running.RunningExecution.checkpoint, before the checkpoint's UPDATE
    # Beat: the leader's commit (tick thread).
    "dispatch.commit.before_fence": DATABASE,  # dispatch._commit, transaction open, lease row not locked yet
    "dispatch.commit.after_fence": DATABASE,  # dispatch._commit, lease row locked and checked, nothing written
    # Beat: publishing (tick thread, leader or follower).
    "publish.holding_batch": DATABASE,  # outbox.publish_pending, a batch of pending rows locked, not sent
    "publish.send": BROKER,  # outbox.publish_pending, just before the batch is pushed to the broker
    "publish.before_mark_queued": DATABASE,  # outbox.publish_pending, batch pushed, rows still pending
    "publish.after_mark_queued": DATABASE,  # outbox.publish_pending, rows marked queued, not committed
    # Beat: shards and leases (tick thread).
    "lease.acquire": DATABASE,  # leases.acquire_many, lease rows taken (token bumped), not committed
    "lease.release": DATABASE,  # leases.release_many, lease rows released, not committed
    # Beat: the leader's reconcile thread.
    "reconcile.after_mark_lost": DATABASE,  # reconcile._recover_lost, an execution marked lost, not retried or failed
    "reconcile.resend": OUTBOX,  # reconcile._send, before a batch of executions is sent (again)
    "broker.check": BROKER,  # broker.unconfirmed_run, asking the broker whether it lost its messages
}

ACTIONS = ("crash", "freeze", "error", "delay")
#: Actions that need a number of seconds.
TIMED = frozenset({"freeze", "delay"})

_ENTRY = re.compile(r"^(?P<action>[a-z]+)(?:\s+(?P<seconds>\d+(?:\.\d+)?))?(?:\s*@\s*(?P<hit>\d+))?$")


@dataclass(frozen=True)
class Action:
    """What one failpoint does when it fires."""

    #: One of ``ACTIONS``.
    kind: str
    seconds: float = 0.0
    #: Fire on this hit only (1 = the first); ``None``: on every hit.
    hit: int | None = None

    def __str__(self) -> str:
        text = f"{self.kind} {self.seconds:g}" if self.kind in TIMED else self.kind
        return f"{text}@{self.hit}" if self.hit is not None else text


def parse(text: str) -> dict[str, Action]:
    """Return {failpoint name: action} for a ``SCHEDULER_FAILPOINTS`` value; raise ``ImproperlyConfigured`` if malformed."""
    actions: dict[str, Action] = {}
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        name, sep, spec = (part.strip() for part in entry.partition("="))
        if not sep:
            raise ImproperlyConfigured(f"SCHEDULER_FAILPOINTS: {entry!r} is not <name>=<action>")
        if name not in POINTS:
            raise ImproperlyConfigured(
                f"SCHEDULER_FAILPOINTS: unknown failpoint {name!r}; known: {', '.join(sorted(POINTS))}"
            )
        match = _ENTRY.match(spec)
        kind = match["action"] if match else ""
        if kind not in ACTIONS:
            raise ImproperlyConfigured(
                f"SCHEDULER_FAILPOINTS: {name}={spec!r}: the action is one of crash, freeze N, error, delay N, "
                "optionally followed by @k"
            )
        assert match is not None  # else kind is "", refused above
        if (match["seconds"] is not None) != (kind in TIMED):
            raise ImproperlyConfigured(
                f"SCHEDULER_FAILPOINTS: {name}={spec!r}: freeze and delay take seconds, crash and error do not"
            )
        if match["hit"] is not None and int(match["hit"]) < 1:
            raise ImproperlyConfigured(f"SCHEDULER_FAILPOINTS: {name}={spec!r}: @k counts hits from 1")
        actions[name] = Action(
            kind, float(match["seconds"] or 0), int(match["hit"]) if match["hit"] is not None else None
        )
    return actions


#: {failpoint name: action}, from the environment once per process; empty in production.
_ACTIONS: dict[str, Action] = parse(os.environ.get("SCHEDULER_FAILPOINTS", ""))
#: Where hits are counted and firings recorded across processes (``None``: in this process).
_DIR: Path | None = Path(os.environ["SCHEDULER_FAILPOINTS_DIR"]) if os.environ.get("SCHEDULER_FAILPOINTS_DIR") else None
#: {failpoint name: hits so far} in this process (without ``_DIR``).
_HITS: dict[str, int] = {}


def failpoint(name: str) -> None:
    """Do what ``SCHEDULER_FAILPOINTS`` asks at failpoint ``name``; nothing when it names none here."""
    action = _ACTIONS.get(name)
    if action is None:
        return
    _hit(name, action)


def _hit(name: str, action: Action) -> None:
    hit = _count(name)
    if hit is None or (action.hit is not None and hit != action.hit):
        return
    logger.warning(
        "failpoint %s: %s (hit %d, pid %d)",
        name,
        action,
        hit,
        os.getpid(),
        extra={"action": "failpoint", "failpoint": name},
    )
    _record(name, action, hit)
    if action.kind == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action.kind == "freeze":
        _freeze(action.seconds)
    elif action.kind == "delay":
        time.sleep(action.seconds)
    else:
        raise _error(name)


def _count(name: str) -> int | None:
    """Count one hit of ``name``; return its number, or ``None`` when the shared count is not armed yet."""
    if _DIR is None:
        _HITS[name] = _HITS.get(name, 0) + 1
        return _HITS[name]
    if not (_DIR / "armed").exists():
        return None
    with open(_DIR / f"{name}.hits", "a+") as counter:
        fcntl.flock(counter, fcntl.LOCK_EX)  # processes hitting it at once each get their own number
        counter.seek(0)
        hit = int(counter.read() or 0) + 1
        counter.seek(0)
        counter.truncate()
        counter.write(str(hit))
    return hit


def _record(name: str, action: Action, hit: int) -> None:
    if _DIR is None:
        return
    line = json.dumps(
        {"name": name, "action": str(action), "hit": hit, "pid": os.getpid(), "ppid": os.getppid(), "at": time.time()}
    )
    with open(_DIR / "fired.jsonl", "a") as fired:
        fired.write(line + "\n")


def _freeze(seconds: float) -> None:
    """Stop this process (every thread) for ``seconds``; a helper process resumes it."""
    pid = os.getpid()
    # The second SIGCONT covers a helper that woke before the SIGSTOP below landed.
    subprocess.Popen(
        ["/bin/sh", "-c", f"sleep {seconds:g}; kill -CONT {pid}; sleep 1; kill -CONT {pid}"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    # Sent to this thread, not to the process: a process-directed SIGSTOP is taken by whichever thread
    # the kernel picks (often the main one), and until that thread stops the others this one runs on
    # past the failpoint (into its next transaction, which a frozen SQLite writer then holds). A stop
    # signal to one thread still stops every thread of the process, this one before it returns.
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _error(name: str) -> Exception:
    message = f"failpoint {name}: connection lost (injected)"
    if POINTS[name] == DATABASE:
        from django.db import OperationalError

        return OperationalError(message)
    from kombu.exceptions import OperationalError as BrokerError

    if POINTS[name] == BROKER:
        return BrokerError(message)
    from scheduler.exceptions import BrokerUnavailable

    unavailable = BrokerUnavailable(message)
    unavailable.__cause__ = BrokerError(message)
    return unavailable
