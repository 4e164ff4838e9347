"""Prove the suite runs against the real services tests.suite started."""

from __future__ import annotations

import os

import pytest
import redis
from django.db import connection


def test_redis_client__round_trips_a_value(redis_client: redis.Redis) -> None:
    # Given an empty Redis database
    assert redis_client.dbsize() == 0
    # When a value is written
    redis_client.set("greeting", "hello", ex=60)
    # Then the server returns it, with a real TTL
    assert redis_client.get("greeting") == b"hello"
    assert 0 < redis_client.ttl("greeting") <= 60


@pytest.mark.django_db
def test_database__runs_a_query_on_the_labelled_vendor(db_vendor: str) -> None:
    # Given the database chosen for this run
    label = os.environ.get("SCHEDULER_TEST_DB_LABEL")
    # When a trivial query runs
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        row = cursor.fetchone()
    # Then it answers, on the vendor tests.suite asked for
    assert row == (1,)
    if label:
        assert db_vendor == label


def test_test_database__can_be_opened_by_other_processes(db_vendor: str) -> None:
    # Celery processes started by the acceptance tests open the test database
    # through DATABASE_URL: SQLite's must be a file, never in-memory, and
    # PostgreSQL's must be reachable over TCP.
    if db_vendor == "sqlite":
        name = str(connection.settings_dict["TEST"]["NAME"])
        assert name.endswith(".sqlite3") and "memory" not in name
    else:
        assert connection.settings_dict["HOST"] and connection.settings_dict["PORT"]
