"""Hashed cron (``H``) on schedules: the same slots in every process, shown as the times they stand for."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scheduler import dbclock, timing
from scheduler.owners import schedules
from tests.integration.api_support import token_client
from tests.support.factories import make_schedule
from tests.support.processes import ROOT

pytestmark = pytest.mark.django_db

#: Prints the next slot of "H H * * *" hashed from a schedule's tenant and name, as any process computes it.
SLOT_IN_ANOTHER_PROCESS = """
from datetime import datetime, timezone
from scheduler.timing import Timing, next_slot
print(next_slot(Timing(cron="H H * * *", hash_key="acme/nightly"), after=datetime(2026, 3, 2, tzinfo=timezone.utc)))
"""


def test_two_processes_with_other_hash_seeds_compute_the_same_slots() -> None:
    slots = {
        subprocess.run(
            [sys.executable, "-c", SLOT_IN_ANOTHER_PROCESS],
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert len(slots) == 1 and slots != {"None"}


def test_a_schedule_fires_at_the_times_its_h_fields_stand_for_and_moves_when_renamed() -> None:
    # Given a daily schedule at a hashed time
    schedule = make_schedule("nightly", tenant="acme", cron="H H * * *")
    minute, hour = (int(field) for field in timing.resolved_cron(schedule.cron, hash_key="acme/nightly").split()[:2])
    assert schedule.next_run_at is not None
    assert (schedule.next_run_at.hour, schedule.next_run_at.minute) == (hour, minute)
    # When it is renamed, its slots are those of its new name
    schedule.name = "nightly-report"
    schedules.save(schedule, now=dbclock.now())
    schedule.refresh_from_db()
    expected = timing.next_slot(schedule.timing, after=dbclock.now())
    assert schedule.next_run_at == expected


def test_api__an_h_cron_is_accepted_and_r_refused_with_the_reason() -> None:
    operator = token_client("root", role="operator")
    body = {"name": "spread", "task": "scheduler.echo", "cron": "H(0-29)/10 H(1-5) * * *"}
    created = operator.post("/api/v1/schedules/", body, content_type="application/json")
    assert created.status_code == 201, created.content
    shown = operator.get(f"/api/v1/schedules/{created.json()['id']}/next/?n=3").json()
    assert len(shown["times"]) == 3
    refused = operator.post(
        "/api/v1/schedules/", {**body, "name": "random", "cron": "R * * * *"}, content_type="application/json"
    )
    assert refused.status_code == 400 and "uses R (random)" in refused.json()["cron"][0]
