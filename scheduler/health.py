"""Probes: ``/healthz`` (alive), ``/readyz`` (can serve) and ``/leaderz`` (a beat leads).

``/readyz`` answers 200 when the database and the broker answer: it is the
web pods' readiness probe, so it must not depend on the beat, or the admin
would leave the load balancer exactly during a beat outage, when operators
need it. ``/leaderz`` is the dead man's switch for alerting, not routing:
200 only when a beat leader renewed its lease within twice the renew
interval (database clock). Both answer 503 otherwise, with a JSON body
naming each failed check.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from django.db import DatabaseError, connection
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from scheduler import leases
from scheduler.conf import settings

#: Seconds to wait for the broker before calling it unreachable.
BROKER_TIMEOUT = 2.0


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
        return Check(False, f"database unreachable: {_first_line(exc)}")
    return Check(True, "database answers")


def check_broker() -> Check:
    from project.celery import app

    options = {"socket_connect_timeout": BROKER_TIMEOUT, "socket_timeout": BROKER_TIMEOUT}
    try:
        with app.connection_for_read(transport_options=options) as conn:
            conn.ensure_connection(max_retries=0, timeout=BROKER_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 -- any transport error means "not reachable"
        return Check(False, f"broker unreachable: {_first_line(exc)}")
    return Check(True, "broker answers")


def check_leader() -> Check:
    """A leader renewed the lease within 2x the renew interval, on the database clock."""
    limit = 2 * settings.LEASE_RENEW_SECONDS
    state = leases.current(settings.LEASE_NAME)
    if not state.is_held or state.renewed_at is None:
        return Check(False, "no beat replica holds the lease: nothing is being dispatched")
    age = (state.db_now - state.renewed_at).total_seconds()
    if age > limit:
        return Check(False, f"the leader last renewed {age:.1f}s ago (limit {limit:.1f}s): it may be stuck")
    return Check(True, f"{state.holder} renewed {age:.1f}s ago (token {state.token})")


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


def _answer(checks: dict[str, Check], *, ok: str, not_ok: str) -> JsonResponse:
    failed = sorted(name for name, check in checks.items() if not check.ok)
    body: dict[str, Any] = {
        "status": not_ok if failed else ok,
        "failed": failed,
        "checks": {name: asdict(check) for name, check in checks.items()},
    }
    return JsonResponse(body, status=503 if failed else 200)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
