"""``/metrics``: Prometheus text exposition, read from the database at scrape time.

Beat replicas and workers are separate processes; the database is what they
share, so every metric here is derived from it when Prometheus scrapes,
with queries that use indexes and a bounded window (``WINDOW``).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta

from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from scheduler import cluster, leases
from scheduler.conf import settings
from scheduler.models import Execution, Instance, Lease, Schedule

#: Executions recorded within this window are counted and their lag measured.
WINDOW = timedelta(hours=1)
#: At most this many recent executions feed the lag histogram per scrape.
LAG_SAMPLE = 10_000
#: Upper bounds (seconds) of the dispatch lag buckets.
LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: At most this many queued executions, oldest first, are read per scrape for their age.
QUEUED_SAMPLE = 10_000


def oldest_queued(*, now: datetime) -> dict[str, float]:
    """Return {queue: seconds its oldest ``queued`` execution has waited since it was due}.

    "Due" is the later of its slot and its creation (a backfilled slot is
    due when recorded). Not ``enqueued_at``: reconcile moves that forward
    on every re-send, which would hide a queue nobody consumes. ``""`` is
    the queue Celery's routing picks (no queue given).

    Bounded: reads at most the ``QUEUED_SAMPLE`` oldest queued rows, through
    the ``(status, created_at)`` index. Past that many queued rows, a queue
    whose every row is younger than those is left out.
    """
    rows = (
        Execution.objects.filter(status=Execution.Status.QUEUED)
        .order_by("created_at")
        .values_list("queue", "created_at", "scheduled_for")[:QUEUED_SAMPLE]
    )
    ages: dict[str, float] = {}
    for queue, created_at, scheduled_for in rows:
        age = max((now - max(created_at, scheduled_for)).total_seconds(), 0.0)
        ages[queue] = max(ages.get(queue, 0.0), age)
    return ages


class DatabaseCollector(Collector):
    """Collects the scheduler's metrics from its tables."""

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | GaugeHistogramMetricFamily]:
        now = leases.db_now()
        since = now - WINDOW

        executions = GaugeMetricFamily(
            "scheduler_executions", "Executions recorded in the last hour, by status and task.", labels=["status", "task"]
        )
        rows = Counter(
            Execution.objects.filter(status__in=Execution.Status.values, created_at__gte=since)
            .values_list("status", "task")
        )
        for (status, task), count in sorted(rows.items()):
            executions.add_metric([status, task], count)
        yield executions

        yield self._dispatch_lag(since)

        changes = CounterMetricFamily(
            "scheduler_leader_changes", "Leadership acquisitions (the lease's fencing token).", labels=["lease"]
        )
        failures = CounterMetricFamily(
            "scheduler_lease_renew_failures", "Renewals refused because the lease was lost.", labels=["lease"]
        )
        for name, token, renew_failures in Lease.objects.values_list("name", "token", "renew_failures"):
            changes.add_metric([name], token)
            failures.add_metric([name], renew_failures)
        yield changes
        yield failures

        queued = GaugeMetricFamily(
            "scheduler_oldest_queued_seconds",
            'Seconds the oldest queued (sent, unclaimed) execution has waited since due, by queue ("": default routing).',
            labels=["queue"],
        )
        for queue, age in sorted(oldest_queued(now=now).items()):
            queued.add_metric([queue], age)
        yield queued

        yield GaugeMetricFamily(
            "scheduler_due_backlog", "Active schedules whose next slot is due now.", value=Schedule.objects.due(now=now).count()
        )

        yield from self._instances(now)

    def _instances(self, now: datetime) -> Iterator[GaugeMetricFamily]:
        state = leases.current(settings.LEASE_NAME)
        members = cluster.members(leaders={state.holder} if state.is_held else set(), now=now)
        instances = GaugeMetricFamily(
            "scheduler_instances",
            "Instances with a fresh heartbeat, by role; leader: holds the lease.",
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
            ages.add_metric([member.instance.instance_id, member.instance.role, str(member.is_stale).lower()], member.age)
        yield ages

    def _dispatch_lag(self, since: object) -> GaugeHistogramMetricFamily:
        pairs = (
            Execution.objects.filter(enqueued_at__gte=since, status__in=Execution.Status.values)
            .order_by("-enqueued_at")
            .values_list("enqueued_at", "scheduled_for")[:LAG_SAMPLE]
        )
        lags = [max((enqueued - slot).total_seconds(), 0.0) for enqueued, slot in pairs]
        buckets = [(str(bound), sum(lag <= bound for lag in lags)) for bound in LAG_BUCKETS]
        buckets.append(("+Inf", len(lags)))
        return GaugeHistogramMetricFamily(
            "scheduler_dispatch_lag_seconds",
            "Seconds from a slot to its message being sent, over executions sent in the last hour.",
            buckets=buckets,
            gsum_value=sum(lags),
        )


_registry = CollectorRegistry(auto_describe=False)
_registry.register(DatabaseCollector())


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    return HttpResponse(generate_latest(_registry), content_type=CONTENT_TYPE_LATEST)
