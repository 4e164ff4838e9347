"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from scheduler import leases


@pytest.fixture
def lease() -> Iterator[leases.LeaseHandle]:
    """The beat lease, held by this test as leader for a minute."""
    handle = leases.acquire("beat", "test-leader", ttl=60)
    assert handle is not None
    yield handle
    leases.release(handle)
