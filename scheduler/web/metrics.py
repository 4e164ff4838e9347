"""``/metrics``: Prometheus text exposition, read from the database at scrape time.

Beat replicas and workers are separate processes; the database is what they
share, so every metric here is derived from it when Prometheus scrapes.
Counters come from rows that only grow (the lease's fencing token, the
execution tallies a trigger keeps: ``scheduler.models.tally``, whose
increments each scrape folds first), so ``rate()`` works across pruning,
restarts and any number of web processes.
Every query uses an index and reads a bounded number of rows: a scrape costs
the same with a million schedules (``bench/scrape.py``).

The series name every tenant's schedules, tasks and queues: a series that
names a schedule carries its ``tenant`` too, and the endpoint takes
``SCHEDULER_METRICS_TOKEN`` (``scheduler.web.metrics_token``).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta

from django.db import DatabaseError
from django.db.models import Case, Count, DurationField, ExpressionWrapper, F, Min, Q, QuerySet, Sum, Value, When
from django.db.models.functions import Greatest
from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeHistogramMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

from scheduler import dbclock, shards
from scheduler.conf import settings
from scheduler.fastpath.guard import PATHS as FASTPATH_PATHS
from scheduler.models import ConcurrencyLimit, Execution, Instance, Lease, PauseRule, Schedule, tally
from scheduler.models.tally import DURATION_BUCKETS, FASTPATH_FALLBACK, MESSAGE_REFUSED
from scheduler.ops import cluster
from scheduler.owners import executions, leases
from scheduler.web.metrics_token import token_required

logger = logging.getLogger(__name__)

#: Scheduled slots sent within this window feed the dispatch lag histogram.
WINDOW = timedelta(hours=1)
#: At most this many recently sent slots feed the lag histogram per scrape.
LAG_SAMPLE = 10_000
#: Upper bounds (seconds) of the dispatch lag buckets.
LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: At most this many queued executions, oldest first, are read per scrape for their age.
QUEUED_SAMPLE = 10_000
#: Schedule counts (due, overdue) stop at this many: counting every row of a
#: large backlog would make the scrape as slow as the backlog is long.
COUNT_CAP = 10_000
#: Statuses ``scheduler_executions_current`` counts.
CURRENT_STATUSES = (Execution.Status.PENDING, Execution.Status.QUEUED, Execution.Status.RUNNING)


def oldest_queued(*, now: datetime) -> dict[str, float]:
    """Return {queue: seconds its oldest ``queued`` execution has waited since it was due}.

    "Due" is the later of its slot and its creation (a backfilled slot is
    due when recorded). Not ``enqueued_at``: reconcile moves that forward
    on every re-send, which would hide a queue nobody consumes. ``""`` is
    the queue Celery's routing picks (no queue given).

    Bounded: reads at most the ``QUEUED_SAMPLE`` oldest queued rows, through
    an index of the status (``execution_current`` or ``execution_status_created``,
    as the planner picks). Past that many queued rows, a queue
    whose every row is younger than those is left out.
    """
    oldest = (
        Execution.objects.filter(status=Execution.Status.QUEUED).order_by("created_at").values("pk")[:QUEUED_SAMPLE]
    )
    rows = (
        Execution.objects.filter(pk__in=oldest)
        .values_list("queue")
        .annotate(due=Min(Greatest("created_at", "scheduled_for")))
        .order_by()
    )
    return {queue: max((now - due).total_seconds(), 0.0) for queue, due in rows}


def _fold_tallies() -> None:
    """Fold the execution tallies' increments (``scheduler.models.tally``), so this scrape reads few of them.

    A fold that fails (SQLite busy past its timeout) is logged and the
    scrape goes on: the counts read are exact either way.
    """
    try:
        tally.fold()
    except DatabaseError:
        logger.warning(
            "folding the execution tallies failed; the next scrape folds",
            exc_info=True,
            extra={"action": "tally_fold_failed"},
        )


def _capped_count(schedules: QuerySet[Schedule]) -> int:
    """Count ``schedules`` up to ``COUNT_CAP``: an index range scan that stops there."""
    return schedules.order_by().values("pk")[:COUNT_CAP].count()


def _counter_of_pseudo_status(
    counts: dict[tuple[str, str, str], int], status: str, known: Iterable[str], counter: CounterMetricFamily
) -> CounterMetricFamily:
    """Fill ``counter`` with the tallies under the pseudo-status ``status``, by their third key.

    Such a tally keeps its one label (a reason, a path) where an execution's keeps its trigger.
    Each ``known`` label has its series, at 0 until one is counted.
    """
    by_label = dict.fromkeys(known, 0)
    for (counted, _, label), count in counts.items():
        if counted == status:
            by_label[label] = by_label.get(label, 0) + count
    for label, count in sorted(by_label.items()):
        counter.add_metric([label], count)
    return counter


class DatabaseCollector(Collector):
    """Collects the scheduler's metrics from its tables."""

    def collect(self) -> Iterator[Metric]:
        _fold_tallies()
        now = dbclock.now()
        view = cluster.shard_view() if shards.is_sharded() else None
        members = _members(view, now=now)
        counts = tally.execution_counts()
        yield self._executions_total(counts)
        yield self._messages_refused(counts)
        yield self._fastpath_fallbacks(counts)
        yield self._task_duration()
        yield self._executions_current()
        yield self._dispatch_lag(since=now - WINDOW)
        yield from self._leases(view, now=now)
        yield from self._shards(view, members)

        queued = GaugeMetricFamily(
            "scheduler_oldest_queued_seconds",
            'Seconds the oldest queued (sent, unclaimed) execution has waited since due, by queue ("": default routing).',
            labels=["queue"],
        )
        for queue, age in sorted(oldest_queued(now=now).items()):
            queued.add_metric([queue], age)
        yield queued

        yield GaugeMetricFamily(
            "scheduler_due_backlog",
            f"Active schedules whose next slot is due now (counted up to {COUNT_CAP}).",
            value=_capped_count(Schedule.objects.due(now=now)),
        )
        yield GaugeMetricFamily(
            "scheduler_schedules_overdue",
            "Enabled, unpaused schedules without a success for longer than their alert window "
            f"(dead man's switch; counted up to {COUNT_CAP}).",
            value=_capped_count(Schedule.objects.overdue(now=now)),
        )
        yield self._pauses()
        yield from self._concurrency()
        yield from self._last_success()
        yield from self._instances(members)

    def _pauses(self) -> GaugeMetricFamily:
        pauses = GaugeMetricFamily(
            "scheduler_pauses",
            "Pause rules in force (manage.py pause): hold stops dispatching and claiming, drain also cancels.",
            labels=["mode"],
        )
        counts = dict(PauseRule.objects.values_list("mode").annotate(n=Count("pk")).order_by())
        for mode in PauseRule.Mode.values:
            pauses.add_metric([mode], counts.get(mode, 0))
        return pauses

    def _concurrency(self) -> Iterator[GaugeMetricFamily]:
        """Each concurrency limit: its limit per key, and how many run and wait under it (all its keys)."""
        labels = ["limit", "tenant"]
        limit = GaugeMetricFamily(
            "scheduler_concurrency_limit", "How many executions may run at once per key of the limit.", labels=labels
        )
        running = GaugeMetricFamily(
            "scheduler_concurrency_running", "Executions running under the limit, all its keys.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "scheduler_concurrency_waiting",
            "Executions waiting queued for a slot of the limit, all its keys.",
            labels=labels,
        )
        usage = executions.limit_usage()
        for row in ConcurrencyLimit.objects.order_by("pk"):
            names = [row.name, row.tenant]
            limit.add_metric(names, row.limit)
            running.add_metric(names, usage.get(row.pk, (0, 0))[0])
            waiting.add_metric(names, usage.get(row.pk, (0, 0))[1])
        yield from (limit, running, waiting)

    def _executions_total(self, counts: dict[tuple[str, str, str], int]) -> CounterMetricFamily:
        total = CounterMetricFamily(
            "scheduler_executions",
            "Executions that reached a final status, by status, task and trigger (never decreases; pruning keeps it).",
            labels=["status", "task", "trigger"],
        )
        for (status, task, trigger), count in sorted(counts.items()):
            if status not in (MESSAGE_REFUSED, FASTPATH_FALLBACK):
                total.add_metric([status, task, trigger], count)
        return total

    def _messages_refused(self, counts: dict[tuple[str, str, str], int]) -> CounterMetricFamily:
        return _counter_of_pseudo_status(
            counts,
            MESSAGE_REFUSED,
            executions.REFUSAL_REASONS,
            CounterMetricFamily(
                "scheduler_messages_refused",
                "Messages refused by a worker, not run, because they were not sent for the execution they name "
                "(task_mismatch: another task name; task_id_mismatch: another task id), or because no row can hold their "
                "task id (task_id_unrecordable) or their execution_id header is no row's id (execution_id_invalid); "
                "the execution was left as it was.",
                labels=["reason"],
            ),
        )

    def _fastpath_fallbacks(self, counts: dict[tuple[str, str, str], int]) -> CounterMetricFamily:
        return _counter_of_pseudo_status(
            counts,
            FASTPATH_FALLBACK,
            FASTPATH_PATHS,
            CounterMetricFamily(
                "scheduler_fastpath_fallbacks",
                "Processes that left a fast path for its slow path (scheduler.fastpath: its self-check found a "
                "difference, or an upstream internal it mirrors was missing or changed), by path; expected 0.",
                labels=["path"],
            ),
        )

    def _task_duration(self) -> HistogramMetricFamily:
        histogram = HistogramMetricFamily(
            "scheduler_task_duration_seconds",
            "Run time (started to finished) of executions that reached a final status, by task.",
            labels=["task"],
        )
        by_task: dict[str, dict[str, tuple[int, float]]] = defaultdict(dict)
        for (task, le), (count, seconds) in tally.duration_counts().items():
            by_task[task][le] = (count, seconds)
        for task, buckets in sorted(by_task.items()):
            cumulative, exposed = 0, []
            for le in (*map(str, DURATION_BUCKETS), "+Inf"):
                cumulative += buckets.get(le, (0, 0.0))[0]
                exposed.append((le, cumulative))
            histogram.add_metric([task], exposed, sum_value=sum(seconds for _, seconds in buckets.values()))
        return histogram

    def _executions_current(self) -> GaugeMetricFamily:
        current = GaugeMetricFamily(
            "scheduler_executions_current",
            'Executions waiting to be sent (pending), sent and unclaimed (queued) or running, by queue ("": default routing).',
            labels=["status", "queue"],
        )
        # An index-only count over the partial index ``execution_current`` (rows in a current status only).
        rows = (
            Execution.objects.filter(status__in=CURRENT_STATUSES)
            .values_list("status", "queue")
            .annotate(count=Count("*"))
            .order_by("status", "queue")
        )
        for status, queue, count in rows:
            current.add_metric([status, queue], count)
        return current

    def _dispatch_lag(self, *, since: datetime) -> GaugeHistogramMetricFamily:
        # Scheduled slots only: a backfilled, manual or retried run is "late" by design.
        # The buckets are counted by the database over the newest ``LAG_SAMPLE`` sends: one row comes back.
        lag = ExpressionWrapper(F("enqueued_at") - F("scheduled_for"), output_field=DurationField())
        recent = (
            Execution.objects.filter(trigger=Execution.Trigger.SCHEDULED, enqueued_at__gte=since)
            .order_by("-enqueued_at")
            .annotate(lag=lag)[:LAG_SAMPLE]
        )
        late = Q(lag__gt=timedelta(0))
        counts = recent.aggregate(
            total=Count("pk"),
            late_sum=Sum(Case(When(late, then=F("lag")), default=Value(timedelta(0)), output_field=DurationField())),
            **{
                f"le_{n}": Count("pk", filter=Q(lag__lte=timedelta(seconds=bound)))
                for n, bound in enumerate(LAG_BUCKETS)
            },
        )
        buckets = [(str(bound), counts[f"le_{n}"]) for n, bound in enumerate(LAG_BUCKETS)]
        buckets.append(("+Inf", counts["total"]))
        return GaugeHistogramMetricFamily(
            "scheduler_dispatch_lag_seconds",
            "Seconds from a scheduled slot to its message being sent, over scheduled slots sent in the last hour.",
            buckets=buckets,
            gsum_value=(counts["late_sum"] or timedelta(0)).total_seconds(),
        )

    def _leases(self, view: cluster.ShardView | None, *, now: datetime) -> Iterator[Metric]:
        changes = CounterMetricFamily(
            "scheduler_leader_changes", "Leadership acquisitions (the lease's fencing token).", labels=["lease"]
        )
        failures = CounterMetricFamily(
            "scheduler_lease_renew_failures", "Renewals refused because the lease was lost.", labels=["lease"]
        )
        present = GaugeMetricFamily(
            "scheduler_leader_present",
            "1 while someone holds the lease unexpired (database clock), else 0; "
            "with shards, the beat's lease reads 1 only while every shard's lease is held.",
            labels=["lease"],
        )
        held = {settings.LEASE_NAME: False}  # the beat's lease is reported even before anyone took it
        for name, token, renew_failures, holder, expires_at in Lease.objects.values_list(
            "name", "token", "renew_failures", "holder", "expires_at"
        ):
            changes.add_metric([name], token)
            failures.add_metric([name], renew_failures)
            if shards.shard_of_lease(name) is None:  # a shard's lease is in scheduler_shard_held
                held[name] = bool(holder) and expires_at is not None and expires_at > now
        if view is not None:
            held[settings.LEASE_NAME] = not view.not_held
        for name, is_held in sorted(held.items()):
            present.add_metric([name], int(is_held))
        yield changes
        yield failures
        yield present

    def _shards(self, view: cluster.ShardView | None, members: list[cluster.Member]) -> Iterator[Metric]:
        """Per shard: held or not, and by whom; per replica: how many. Bounded by ``SCHEDULER_SHARDS`` (at most 1,024)."""
        count = shards.count()
        yield GaugeMetricFamily(
            "scheduler_shards", "Shards the schedules are split into (SCHEDULER_SHARDS; 1: one leader).", value=count
        )
        held = GaugeMetricFamily(
            "scheduler_shard_held",
            "1 while a beat replica holds the shard's lease unexpired, else 0.",
            labels=["shard"],
        )
        leader = GaugeMetricFamily(
            "scheduler_shard_leader_info",
            "1 for each held shard, labelled with the replica holding it.",
            labels=["shard", "instance"],
        )
        per_replica = GaugeMetricFamily(
            "scheduler_shards_held",
            "Shards each beat replica holds (beats with a fresh heartbeat included at 0).",
            labels=["instance"],
        )
        stranded = GaugeMetricFamily(
            "scheduler_schedules_stranded",
            f"Active schedules in a shard >= SCHEDULER_SHARDS (left by a larger count): not dispatched until "
            f"manage.py shards --assign (counted up to {COUNT_CAP}).",
            value=_capped_count(cluster.stranded(count)),
        )
        if view is not None:
            for shard, state in enumerate(view.leases):
                held.add_metric([str(shard)], int(state.is_held))
                if state.is_held:
                    leader.add_metric([str(shard), state.holder], 1)
            beats = cluster.fresh_beats(members)
            for instance_id, owned in view.by_replica(live=beats).items():
                per_replica.add_metric([instance_id], len(owned))
        yield from (held, leader, per_replica, stranded)

    def _last_success(self) -> Iterator[GaugeMetricFamily]:
        limit = settings.METRICS_PER_SCHEDULE_LIMIT
        last = GaugeMetricFamily(
            "scheduler_schedule_last_success_timestamp_seconds",
            f"Unix time of each schedule's last successful run; left out above {limit} schedules "
            '(SCHEDULER_METRICS_PER_SCHEDULE_LIMIT); tenant "": bound to no tenant.',
            labels=["schedule", "tenant"],
        )
        # Counting at most limit + 1 rows keeps the check bounded at any size.
        if Schedule.objects.values("pk")[: limit + 1].count() <= limit:
            rows = (
                Schedule.objects.filter(last_success_at__isnull=False)
                .order_by()
                .values_list("name", "tenant", "last_success_at")
            )
            for name, tenant, moment in sorted(rows):
                last.add_metric([name, tenant], moment.timestamp())
        yield last

    def _instances(self, members: list[cluster.Member]) -> Iterator[GaugeMetricFamily]:
        instances = GaugeMetricFamily(
            "scheduler_instances",
            "Instances with a fresh heartbeat, by role; leader: holds the lease (with shards: any shard's).",
            labels=["role", "leader"],
        )
        alive = Counter((m.instance.role, m.is_leader) for m in members if not m.is_stale)
        for role in Instance.Role.values:
            for leader in (True, False):
                instances.add_metric([role, str(leader).lower()], alive.get((role, leader), 0))
        yield instances

        ages = GaugeMetricFamily(
            "scheduler_instance_heartbeat_age_seconds",
            "Seconds since each registered instance's last heartbeat; stale: older than the lease TTL "
            "(a worker: the claim duration), presumably dead until reconcile removes it.",
            labels=["instance", "role", "stale"],
        )
        for member in members:
            ages.add_metric(
                [member.instance.instance_id, member.instance.role, str(member.is_stale).lower()], member.age
            )
        yield ages


def _members(view: cluster.ShardView | None, *, now: datetime) -> list[cluster.Member]:
    """Every registered instance; a leader holds the beat's lease, or with shards any lease."""
    if view is not None:
        return cluster.members(leaders=view.holders, now=now)
    state = leases.current(settings.LEASE_NAME)
    return cluster.members(leaders={state.holder} if state.is_held else set(), now=now)


_registry = CollectorRegistry(auto_describe=False)
_registry.register(DatabaseCollector())


@never_cache
@require_GET
@token_required
def metrics(request: HttpRequest) -> HttpResponse:
    return HttpResponse(generate_latest(_registry), content_type=CONTENT_TYPE_LATEST)
