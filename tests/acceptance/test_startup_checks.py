"""A beat or a worker whose settings fail the scheduler's checks does not start: it says why in one line.

``manage.py check`` reports the same errors, but nobody runs it before each
start; a beat whose lease lasts no time would take and lose the leadership
every renewal, a worker whose claim lasts no time would run nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from scheduler import checks
from scheduler.models import Instance, Lease
from tests.support.processes import CeleryProcess, wait_until

pytestmark = pytest.mark.django_db(transaction=True)

Start = Callable[..., CeleryProcess]


def _refused_in_one_line(process: CeleryProcess, check_id: str) -> None:
    assert wait_until(lambda: not process.alive(), timeout=30), process.log()[-3000:]
    assert process.popen.returncode != 0
    log = process.log()
    assert "Traceback" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if check_id in line]
    assert len(lines) == 1 and "does not start" in lines[0], log[-3000:]


def test_a_beat_whose_lease_lasts_no_time__refuses_to_start_naming_the_setting(celery_processes: Start) -> None:
    # When a beat starts with a lease of 0 seconds
    beat = celery_processes("beat", "beat-0s", lease_ttl_seconds=0)

    # Then it stops with one line naming the check and the setting, and never took the leadership
    _refused_in_one_line(beat, "scheduler.E011")
    assert "SCHEDULER_LEASE_TTL_SECONDS" in beat.log()
    assert not Lease.objects.filter(token__gt=0).exists()


def test_a_worker_whose_claim_lasts_no_time__refuses_to_start_naming_the_setting(celery_processes: Start) -> None:
    # When a worker starts with a claim of 0 seconds
    worker = celery_processes("worker", "worker-0s", claim_seconds=0)

    # Then it stops with one line naming the check and the setting, before any heartbeat
    _refused_in_one_line(worker, "scheduler.E011")
    assert "SCHEDULER_CLAIM_SECONDS" in worker.log()
    assert not Instance.objects.exists()


def test_errors_at_start__only_the_schedulers_errors(settings: Any) -> None:
    # Given valid settings, and then one the checks refuse and one they only warn about
    assert checks.errors_at_start() == []
    settings.SCHEDULER_LEASE_TTL_SECONDS = 0
    settings.SCHEDULER_METRICS_TOKEN = ""  # (a deploy warning, W002)

    # Then the error is one line, and nothing else is
    assert [line.split(":")[0] for line in checks.errors_at_start()] == ["scheduler.E011"]
