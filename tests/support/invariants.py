"""The guarantees a fault run is checked against, on the rows and the run log it left: one home for the soak and the explorer.

``tests/chaos/test_soak.py`` (the chaos soak) and ``tests/support/explore.py`` (the
failpoint explorer) both run real clusters through faults and then check
the same things with these functions:

- ``slot_violations``: every slot of every schedule from its creation to
  the end of the run has exactly one Execution (duplicates, gaps);
- ``open_executions``: what is not final yet;
- ``claim_violations``: no body completed after its claim moved on, no
  attempt ran its body twice, no two bodies of one execution overlapped
  (the run log ``tests.record`` writes, against the rows' attempts);
- ``succeeded_without_body``: every succeeded execution of a task that logs
  its bodies has the body of its attempt logged to the end;
- ``fenced_violations``: each succeeded ``tests.fenced_invoice`` committed
  its side effect exactly once, and no other did;
- ``result_violations``: Celery's stored result of each final execution's
  task id says what its row says;
- ``max_stall``: the largest gap between two committed slots of an
  every-second (on-time) schedule, to hold within 2 × the lease TTL;
- ``token_changes``: how often a lease changed hands.

The run log's clock (``time.time()`` in the workers) and the database's are
this machine's.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from itertools import pairwise
from typing import Any

from scheduler.models import Execution, Schedule


def owed_slots(schedule: Schedule, created_at: datetime, ended_at: datetime) -> set[datetime]:
    """Return the slots of ``schedule`` after ``created_at`` up to ``ended_at``."""
    count = int((ended_at - created_at).total_seconds() // schedule.interval) + 2
    return {slot for slot in schedule.next_fire_times(count, after=created_at) if slot <= ended_at}


def slot_violations(
    schedules: Iterable[Schedule], executions: Iterable[Execution], *, created_at: datetime, ended_at: datetime
) -> tuple[int, int]:
    """Return (duplicates, gaps): executions beyond one per slot, and owed slots with none (interval schedules)."""
    by_schedule = _by_schedule(executions)
    duplicates, gaps = 0, 0
    for schedule in schedules:
        slots = Counter(execution.scheduled_for for execution in by_schedule[schedule.pk])
        duplicates += sum(count - 1 for count in slots.values())
        gaps += len(owed_slots(schedule, created_at, ended_at) - set(slots))
    return duplicates, gaps


def open_executions(executions: Iterable[Execution]) -> list[Execution]:
    """The executions not in a final status."""
    return [execution for execution in executions if execution.status not in Execution.FINAL_STATUSES]


def claim_violations(
    events: list[dict[str, Any]], executions: Iterable[Execution], *, cancelled_by_policy: Iterable[int] = ()
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Return the stale, doubled and overlapping bodies in the ``tests.record`` run log.

    Stale: [execution, attempt] of a body that logged its end after its
    claim had moved on: once a later attempt of its execution started, or
    once someone else finished the execution on that attempt (reconcile
    recording a lost one ``failed``). Doubled: [execution, attempt] whose
    body started twice. Overlapping: executions two of whose bodies ran at
    once in two processes.

    ``cancelled_by_policy``: executions ``overlap=cancel_previous`` ended.
    Their finish is not a claim moving on to someone else: the cancel can
    land between a body's last fenced write and its logged end (and it
    records the tick's time, from before that), and a body whose fenced
    write came after it would have been refused (``ClaimLost``) and never
    logged an end. Only a later attempt makes theirs stale.
    """
    first_start: dict[int, dict[int, float]] = defaultdict(dict)
    starts: Counter[tuple[int, int]] = Counter()
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    open_starts: dict[tuple[int, int], float] = {}
    for event in events:
        key = (event["execution_id"], event["attempt"])
        if event["event"] == "start":
            starts[key] += 1
            attempts = first_start[event["execution_id"]]
            attempts[event["attempt"]] = min(event["at"], attempts.get(event["attempt"], event["at"]))
            open_starts[(event["execution_id"], event["pid"])] = event["at"]
        elif (event["execution_id"], event["pid"]) in open_starts:  # its end: "stop" (or "raise")
            spans[event["execution_id"]].append((open_starts.pop((event["execution_id"], event["pid"])), event["at"]))
    rows = {execution.pk: execution for execution in executions}
    ended_by_policy = set(cancelled_by_policy)
    stale = []
    for event in events:
        if event["event"] != "stop":
            continue
        execution_id, attempt = event["execution_id"], event["attempt"]
        moved_on = [at for later, at in first_start[execution_id].items() if later > attempt]
        row = rows.get(execution_id)
        if (
            row
            and row.attempt == attempt
            and row.status != Execution.Status.SUCCEEDED
            and row.finished_at
            and execution_id not in ended_by_policy
        ):
            moved_on.append(row.finished_at.timestamp())
        if moved_on and event["at"] > min(moved_on):
            stale.append([execution_id, attempt])
    twice = [list(key) for key, count in starts.items() if count > 1]
    overlapping = []
    for execution_id, runs in spans.items():
        runs.sort()
        if any(later[0] < earlier[1] for earlier, later in pairwise(runs)):
            overlapping.append(execution_id)
    return stale, twice, overlapping


def succeeded_without_body(
    events: list[dict[str, Any]], executions: Iterable[Execution], *, tasks: Sequence[str]
) -> list[int]:
    """Ids of succeeded executions of ``tasks`` (which log their bodies) whose attempt logged no finished body."""
    finished = {(event["execution_id"], event["attempt"]) for event in events if event["event"] == "stop"}
    return [
        execution.pk
        for execution in executions
        if execution.task in tasks
        and execution.status == Execution.Status.SUCCEEDED
        and (execution.pk, execution.attempt) not in finished
    ]


def fenced_violations(side_effects: list[tuple[int, int, int]], executions: Iterable[Execution]) -> list[int]:
    """Executions of ``tests.fenced_invoice`` whose committed side effects are not exactly one, of the succeeded attempt."""
    committed: dict[int, list[int]] = defaultdict(list)
    for execution_id, attempt, _ in side_effects:
        committed[execution_id].append(attempt)
    wrong = []
    for execution in executions:
        if execution.task != "tests.fenced_invoice":
            continue
        want = [execution.attempt] if execution.status == Execution.Status.SUCCEEDED else []
        if committed.get(execution.pk, []) != want:
            wrong.append(execution.pk)
    return wrong


def result_violations(executions: Iterable[Execution], results: Mapping[str, str]) -> list[int]:
    """Executions whose Celery result (``results``: task id -> stored state) says otherwise than their row.

    One task id carries every attempt of its execution (a redelivery, a
    retry sent again): the state stored is the attempt's that recorded the
    outcome, never a late one's whose claim had moved on. A succeeded
    execution's is ``SUCCESS``; a failed or timed-out one's is not. None
    stored contradicts nothing (a worker may die after the outcome and
    before a result Celery stores itself).
    """
    failed = (Execution.Status.FAILED, Execution.Status.TIMED_OUT)
    wrong = []
    for execution in executions:
        stored = results.get(execution.celery_task_id)
        if stored is None:
            continue
        succeeded = execution.status == Execution.Status.SUCCEEDED
        if (succeeded and stored != "SUCCESS") or (execution.status in failed and stored == "SUCCESS"):
            wrong.append(execution.pk)
    return wrong


def max_stall(
    schedules: Iterable[Schedule], executions: Iterable[Execution], *, created_at: datetime, ended_at: datetime
) -> tuple[float, str]:
    """Return the largest gap in seconds between two committed slots of an every-second schedule, and where it was.

    Where: the schedule's name and the UTC time the gap began (``tick-01 after 08:47:40.123``), to
    read against a fault timeline.

    Measured on the rows' ``created_at`` (the database clock at commit),
    from ``created_at`` to the last slot up to ``ended_at``: a schedule that
    should run every second and was committed nothing for that long.
    """
    by_schedule = _by_schedule(executions)
    lo, hi = created_at.timestamp(), ended_at.timestamp()
    worst, where = 0.0, ""
    for schedule in schedules:
        if schedule.interval != 1:
            continue
        commits = sorted(
            [lo]
            + [e.created_at.timestamp() for e in by_schedule[schedule.pk] if lo < e.scheduled_for.timestamp() <= hi]
        )
        gap, began = max(((later - earlier, earlier) for earlier, later in pairwise(commits)), default=(0.0, lo))
        if gap > worst:
            worst, where = gap, f"{schedule.name} after {datetime.fromtimestamp(began, timezone.utc):%H:%M:%S.%f}"[:-3]
    return worst, where


def token_changes(lease_log: list[tuple[float, str, str, int]]) -> int:
    """How many times a lease got a new token after the first one logged for it ((time, name, holder, token) entries)."""
    first: dict[str, int] = {}
    tokens: dict[str, set[int]] = defaultdict(set)
    for _, name, _, token in lease_log:
        first.setdefault(name, token)
        if token:
            tokens[name].add(token)
    return sum(len(seen - {first[name]}) for name, seen in tokens.items())


def _by_schedule(executions: Iterable[Execution]) -> dict[int | None, list[Execution]]:
    grouped: dict[int | None, list[Execution]] = defaultdict(list)
    for execution in executions:
        grouped[execution.schedule_id].append(execution)
    return grouped
