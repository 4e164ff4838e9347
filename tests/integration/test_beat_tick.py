"""One LeaderScheduler tick, in process: its cost does not grow with idle schedules."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from project.celery import app
from scheduler import leases
from scheduler.beat import LeaderScheduler
from scheduler.models import Execution, Schedule

pytestmark = pytest.mark.django_db(transaction=True)


def _load_schedules(total: int, *, due: int) -> list[int]:
    """Insert ``total`` every-minute schedules far from due; return the ids of the first ``due``."""
    far = leases.db_now() + timedelta(hours=1)
    Schedule.objects.bulk_create(
        [Schedule(name=f"s{i}", task="scheduler.echo", interval=60, next_run_at=far) for i in range(total)],
        batch_size=2000,
    )
    return list(Schedule.objects.order_by("id").values_list("id", flat=True)[:due])


def _make_due(ids: list[int]) -> None:
    """Point the schedules at their latest slot (a whole minute), so exactly one slot is due."""
    now = leases.db_now()
    Schedule.objects.filter(id__in=ids).update(next_run_at=now.replace(second=0, microsecond=0))


def test_tick_query_count__same_for_10_and_10000_schedules(redis_url: str) -> None:
    counts = {}
    for total in (10, 10_000):
        # Given `total` enabled schedules of which three are due, and a leader
        Execution.objects.all().delete()
        Schedule.objects.all().delete()
        due_ids = _load_schedules(total, due=3)
        scheduler = LeaderScheduler(app, lazy=True)
        try:
            _make_due(due_ids)
            scheduler.tick()  # acquires the lease and dispatches
            assert scheduler.lease is not None
            Execution.objects.all().delete()  # so the same slot can fire again
            _make_due(due_ids)
            scheduler._last_renew = time.monotonic()  # keep the measured tick free of a renewal

            # When one more tick dispatches the three due schedules
            with CaptureQueriesContext(connection) as queries:
                scheduler.tick()
        finally:
            scheduler.close()
        counts[total] = len(queries)
        assert Execution.objects.filter(status=Execution.Status.QUEUED).count() == 3

    # Then it took the same number of queries
    assert counts[10] == counts[10_000], counts
