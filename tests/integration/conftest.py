"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scheduler.owners import leases
from tests.services import free_port


@pytest.fixture
def lease() -> Iterator[leases.LeaseHandle]:
    """The beat lease, held by this test as leader for a minute."""
    handle = leases.acquire("beat", "test-leader", ttl=60)
    assert handle is not None
    yield handle
    leases.release(handle)


@pytest.fixture
def broker_down() -> Iterator[None]:
    """Point the project's Celery app at a loopback port nothing listens on."""
    from project.celery import app

    configured = app.conf.broker_url
    app.conf.broker_url = f"redis://127.0.0.1:{free_port()}/0"
    try:
        yield
    finally:
        app.conf.broker_url = configured
