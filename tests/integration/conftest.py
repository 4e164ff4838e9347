"""Fixtures shared by the integration tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from django.contrib.auth import get_user_model
from django.test import Client

from project.celery import app
from scheduler.beat import LeaderScheduler
from scheduler.owners import leases
from tests.integration.api_support import token_client
from tests.support.processes import ROOT
from tests.support.replicas import BeatReplica
from tests.support.schema_migrations import migrate_to_newest
from tests.support.services import free_port


@pytest.fixture
def lease() -> Iterator[leases.LeaseHandle]:
    """The beat lease, held by this test as leader for a minute."""
    handle = leases.acquire("beat", "test-leader", ttl=60)
    assert handle is not None
    yield handle
    leases.release(handle)


@pytest.fixture
def beat_replica(redis_url: str) -> Iterator[BeatReplica]:
    """Return ``start(**options)``: a beat replica in this process, which the test ticks; each is closed after the test."""
    started: list[LeaderScheduler] = []

    def start(**options: Any) -> LeaderScheduler:
        replica = LeaderScheduler(app, lazy=True, **options)
        started.append(replica)
        return replica

    yield start
    for replica in reversed(started):
        replica.close()  # (a second close of one the test closed itself does nothing)


@pytest.fixture
def staff() -> Client:
    """An admin client logged in as a superuser (of every tenant)."""
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "root@example.invalid", "pw"))
    return client


@pytest.fixture
def operator() -> Client:
    """An API client holding an operator's token (of no tenant)."""
    return token_client("ops", role="operator")


@pytest.fixture
def broker_down() -> Iterator[None]:
    """Point the project's Celery app at a loopback port nothing listens on."""
    configured = app.conf.broker_url
    app.conf.broker_url = f"redis://127.0.0.1:{free_port()}/0"
    try:
        yield
    finally:
        app.conf.broker_url = configured


@pytest.fixture
def unreachable_app() -> Iterator[Celery]:
    """A Celery app of its own whose broker is a loopback port nothing listens on."""
    app = Celery("down", broker=f"redis://127.0.0.1:{free_port()}/0", set_as_current=False)
    try:
        yield app
    finally:
        app.close()


@pytest.fixture
def manage(process_database_url: str, redis_url: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Return ``manage(*argv, broker=...)``: run manage.py in a child process against the test database."""

    def run(*argv: str, broker: str = redis_url) -> subprocess.CompletedProcess[str]:
        env = {key: value for key, value in os.environ.items() if not key.startswith("SCHEDULER_")}
        env.update(DATABASE_URL=process_database_url, REDIS_URL=broker, DJANGO_DEBUG="1")
        return subprocess.run(
            [sys.executable, "manage.py", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )

    return run


@pytest.fixture
def back_to_newest() -> Iterator[None]:
    """For a test that moves the schema to an older migration (``migrate_to``): the newest comes back after it."""
    yield
    migrate_to_newest()


@pytest.fixture
def no_background_renewal(settings: Any) -> None:
    """No claim renewal within the test: the guard's renewer thread would open its own connection in this process."""
    settings.SCHEDULER_CLAIM_RENEW_SECONDS = 3600
