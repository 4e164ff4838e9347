"""``manage.py alive``: which heartbeat passes, and the one line that says why one does not."""

from __future__ import annotations

import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduler import dbclock
from scheduler.models import Instance

pytestmark = pytest.mark.django_db

HOST = "worker-host"


def _instance(role: str, *, seconds_ago: float, host: str = HOST) -> Instance:
    seen = dbclock.now() - timedelta(seconds=seconds_ago)
    return Instance.objects.create(
        instance_id=f"{role}@{host}-{int(seconds_ago)}",
        role=role,
        hostname=host,
        pid=1,
        started_at=seen,
        last_seen=seen,
    )


def _alive(role: str, within: float = 30, host: str = HOST) -> str:
    out = io.StringIO()
    call_command("alive", role=role, within=within, hostname=host, stdout=out)
    return out.getvalue().strip()


def test_worker__round_trip_within_the_window__passes() -> None:
    # Given a stale row of an earlier process and a fresh one of this host's worker
    _instance(Instance.Role.WORKER, seconds_ago=600)
    _instance(Instance.Role.WORKER, seconds_ago=2)

    assert _alive(Instance.Role.WORKER) == f"worker on {HOST} is alive"


def test_worker__last_round_trip_too_old__fails_naming_the_probe_and_its_age() -> None:
    # Given a worker whose last probe came back 95 s ago (deaf since, or its broker gone)
    _instance(Instance.Role.WORKER, seconds_ago=95)

    with pytest.raises(CommandError) as refused:
        _alive(Instance.Role.WORKER)

    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"no worker on {HOST} received its own probe back through the broker in the last 30s")
    assert "(last 95s ago)" in message or "(last 96s ago)" in message
    assert "consumer is deaf" in message


def test_worker__never_registered_on_this_host__fails() -> None:
    _instance(Instance.Role.WORKER, seconds_ago=1, host="another-host")
    _instance(Instance.Role.BEAT, seconds_ago=1)

    with pytest.raises(CommandError, match=r"in the last 30s \(never\)"):
        _alive(Instance.Role.WORKER)


def test_beat__heartbeat_too_old__fails_as_before() -> None:
    _instance(Instance.Role.BEAT, seconds_ago=45)

    with pytest.raises(CommandError, match=rf"^no beat on {HOST} wrote a heartbeat in the last 30s$"):
        _alive(Instance.Role.BEAT)
    assert _alive(Instance.Role.BEAT, within=60) == f"beat on {HOST} is alive"
