"""Probes: ``/healthz`` (alive), ``/readyz`` (can serve), ``/leaderz`` (a beat leads), ``/healthz/schedules``.

``/readyz`` answers 200 when the database and the broker answer: it is the
web pods' readiness probe, so it must not depend on the beat, or the admin
would leave the load balancer exactly during a beat outage, when operators
need it. ``/leaderz`` is the dead man's switch for alerting, not routing:
200 only when a beat leader renewed its lease within twice the renew
interval (database clock); with shards (a stored shard count above 1), only
when every shard's lease was, so a shard with no live owner, whose
schedules nobody dispatches, is named there and never fails ``/readyz``
(a beat problem must not take the web out of the load balancer). Both
answer 503 otherwise, with a JSON body
naming each failed check; a service that does not answer is named, never
quoted (the driver's message, with its host, port and user, goes to the
log). ``/healthz/schedules`` is the per-schedule dead
man's switch (``scheduler.timing.overdue``) for those who want to probe it: 503
naming the overdue schedules; it is about the jobs, so ``/readyz`` ignores it.
It names every tenant's schedules, so it takes ``SCHEDULER_METRICS_TOKEN``
like ``/metrics`` (``scheduler.web.metrics_token``).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from scheduler import dbclock
from scheduler.celery_app import celery_app
from scheduler.conf import settings
from scheduler.models import Schedule
from scheduler.ops import cluster
from scheduler.web.metrics_token import token_required

logger = logging.getLogger(__name__)

#: Seconds to wait for the broker before calling it unreachable.
BROKER_TIMEOUT = 2.0
#: ``/leaderz`` names at most this many shards without an owner.
SHARD_NAMES = 50
#: ``/healthz/schedules`` names at most this many overdue schedules ...
OVERDUE_NAMES = 100
#: ... and counts them up to this many, so the probe stays cheap in a mass outage.
OVERDUE_COUNT_CAP = 10_000


@dataclass(frozen=True)
class Check:
    ok: bool
    detail: str


def check_database() -> Check:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError as exc:
        connection.close()  # a broken connection must not be reused by the next request
        return _unreachable("database", exc)
    return Check(True, "database answers")


def check_broker() -> Check:
    app = celery_app()
    options = {"socket_connect_timeout": BROKER_TIMEOUT, "socket_timeout": BROKER_TIMEOUT}
    try:
        with app.connection_for_read(transport_options=options) as conn:
            # kombu takes the timeout in (float) seconds; its stubs say int.
            conn.ensure_connection(max_retries=0, timeout=BROKER_TIMEOUT)  # type: ignore[arg-type]
    except Exception as exc:  # noqa: BLE001 -- any transport error means "not reachable"
        return _unreachable("broker", exc)
    return Check(True, "broker answers")


def check_leader() -> Check:
    """A leader renewed the lease within 2x the renew interval, on the database clock; with shards, every shard's."""
    limit = 2 * settings.LEASE_RENEW_SECONDS
    view = cluster.shard_view()  # one query: every lease row and the stored shard count
    if view.count > 1:
        return _check_shards(view, limit)
    state = view.state(settings.LEASE_NAME)
    if not state.is_held or state.renewed_at is None:
        return Check(False, "no beat replica holds the lease: nothing is being dispatched")
    age = (state.db_now - state.renewed_at).total_seconds()
    if age > limit:
        return Check(False, f"the leader last renewed {age:.1f}s ago (limit {limit:.1f}s): it may be stuck")
    return Check(True, f"{state.holder} renewed {age:.1f}s ago (token {state.token})")


def _check_shards(view: cluster.ShardView, limit: float) -> Check:
    """Every shard's lease renewed within ``limit`` seconds."""
    unowned = [state.name for state in view.unowned(within=limit)]
    if unowned:
        named = ", ".join(unowned[:SHARD_NAMES]) + (", ..." if len(unowned) > SHARD_NAMES else "")
        return Check(
            False,
            f"{len(unowned)} of {view.count} shards have no owner that renewed within {limit:.1f}s, "
            f"so their schedules are not dispatched: {named}",
        )
    return Check(True, f"all {view.count} shards renewed within {limit:.1f}s by {len(view.by_replica())} replicas")


def overdue_schedules() -> tuple[list[str], int]:
    """Return the names of up to ``OVERDUE_NAMES`` overdue schedules, most overdue first, and how many (capped)."""
    overdue = Schedule.objects.overdue(now=dbclock.now())
    names = list(overdue.order_by("overdue_at", "id").values_list("name", flat=True)[:OVERDUE_NAMES])
    return names, len(names) if len(names) < OVERDUE_NAMES else overdue.values("pk")[:OVERDUE_COUNT_CAP].count()


def readiness() -> dict[str, Check]:
    """What the web needs to serve: the database and the broker (never the beat)."""
    return {"database": check_database(), "broker": check_broker()}


def leadership() -> dict[str, Check]:
    """Whether a beat dispatches; the leader check needs the database."""
    database = check_database()
    leader = check_leader() if database.ok else Check(False, "not checked: the database is unreachable")
    return {"database": database, "leader": leader}


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    """The process is alive and serving requests."""
    return JsonResponse({"status": "alive"})


@never_cache
@require_GET
def readyz(request: HttpRequest) -> JsonResponse:
    """Readiness probe for the web: the database and the broker answer."""
    return _answer(readiness(), ok="ready", not_ok="not ready")


@never_cache
@require_GET
def leaderz(request: HttpRequest) -> JsonResponse:
    """Alert on this one: 503 while no beat leader renews its lease."""
    return _answer(leadership(), ok="leading", not_ok="no leader")


@never_cache
@require_GET
@token_required
def schedules(request: HttpRequest) -> JsonResponse:
    """503 naming the overdue schedules (the per-schedule dead man's switch), else 200."""
    database = check_database()
    if not database.ok:
        return _answer({"database": database}, ok="on time", not_ok="not checked")
    names, count = overdue_schedules()
    more = f" (the first {len(names)} named)" if count > len(names) else ""
    check = Check(not names, f"{count} overdue{more}: {', '.join(names)}" if names else "no schedule is overdue")
    return _answer(
        {"database": database, "schedules": check},
        ok="on time",
        not_ok="overdue",
        extra={"overdue": names, "overdue_count": count},
    )


def _answer(checks: dict[str, Check], *, ok: str, not_ok: str, extra: dict[str, Any] | None = None) -> JsonResponse:
    failed = sorted(name for name, check in checks.items() if not check.ok)
    body: dict[str, Any] = {
        "status": not_ok if failed else ok,
        "failed": failed,
        "checks": {name: asdict(check) for name, check in checks.items()},
        **(extra or {}),
    }
    return JsonResponse(body, status=503 if failed else 200)


def _unreachable(component: str, exc: BaseException) -> Check:
    """A failed check that names ``component`` only; the driver's message, which names hosts, ports and users, is logged."""
    logger.warning(
        "%s unreachable: %s",
        component,
        str(exc).strip() or type(exc).__name__,
        extra={"action": f"{component}_unreachable"},
    )
    return Check(False, f"{component} unreachable")
