"""Leases on the real database: compare-and-set, fencing tokens, the database clock."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connections, transaction
from django.db.models import F

from scheduler.exceptions import LeaseLost
from scheduler.models import Lease
from scheduler.owners import leases

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]


def test_acquire__free_lease_is_taken_and_token_bumped() -> None:
    first = leases.acquire("beat", "a", ttl=10)
    assert first is not None and first.token == 1
    assert first.expires_at > first.db_now

    assert leases.acquire("beat", "b", ttl=10) is None
    again = leases.acquire("beat", "a", ttl=10)
    assert again is not None and again.token == 2


def test_renew__only_same_holder_and_token() -> None:
    handle = leases.acquire("beat", "a", ttl=10)
    renewed = leases.renew(handle, ttl=10)
    assert renewed.token == handle.token and renewed.expires_at >= handle.expires_at

    stranger = leases.LeaseHandle("beat", "b", handle.token, handle.expires_at, handle.db_now)
    with pytest.raises(LeaseLost):
        leases.renew(stranger, ttl=10)
    stale_token = leases.LeaseHandle("beat", "a", handle.token - 1, handle.expires_at, handle.db_now)
    with pytest.raises(LeaseLost):
        leases.renew(stale_token, ttl=10)


def test_expired_lease__is_taken_over_and_old_holder_cannot_renew() -> None:
    # Given a lease whose expiry has passed (moved back on the database, the
    # only clock that matters, instead of sleeping)
    old = leases.acquire("beat", "a", ttl=10)
    Lease.objects.filter(name="beat").update(expires_at=F("expires_at") - timedelta(seconds=11))
    # When another instance asks for it
    new = leases.acquire("beat", "b", ttl=10)
    # Then it gets it with a higher token, and the old holder is fenced off
    assert new is not None and new.token == old.token + 1
    with pytest.raises(LeaseLost):
        leases.renew(old, ttl=10)
    with pytest.raises(LeaseLost), transaction.atomic():
        leases.assert_held(old)


def test_release__lets_a_follower_take_over_at_once() -> None:
    handle = leases.acquire("beat", "a", ttl=10)
    assert leases.release(handle) is True
    assert leases.current("beat").is_held is False
    assert leases.acquire("beat", "b", ttl=10) is not None
    assert leases.release(handle) is False  # no longer ours: changes nothing


def test_current__reports_holder_and_seconds_left() -> None:
    handle = leases.acquire("beat", "a", ttl=10)
    state = leases.current("beat")
    assert state.holder == "a" and state.is_held
    # seconds left is the stored expiry against the database clock, nothing local
    assert state.expires_at == handle.expires_at
    assert state.seconds_left == (handle.expires_at - state.db_now).total_seconds() > 0


def test_force__takes_an_unexpired_lease() -> None:
    leases.acquire("beat", "a", ttl=10)
    taken = leases.acquire("beat", "b", ttl=10, force=True)
    assert taken is not None and leases.current("beat").holder == "b"


def test_eight_contenders__never_two_holders_and_tokens_increase() -> None:
    # Given eight threads, each on its own connection, hammering the lease
    # with acquire / renew / release for a few seconds (short TTLs so that
    # expiry-driven takeovers happen too)
    events: list[tuple[str, str, int, object, object]] = []
    events_lock = threading.Lock()
    errors: list[BaseException] = []
    stop_at = time.monotonic() + 10

    def contender(name: str) -> None:
        rng = random.Random(name)
        handle = None
        try:
            while time.monotonic() < stop_at:
                try:
                    if handle is None:
                        handle = leases.acquire("beat", name, ttl=rng.choice([0.05, 0.2, 0.5]))
                        if handle:
                            with events_lock:
                                events.append(("acquire", name, handle.token, handle.db_now, handle.expires_at))
                    elif rng.random() < 0.1:
                        leases.release(handle)
                        handle = None
                    else:
                        handle = leases.renew(handle, ttl=rng.choice([0.05, 0.2]))
                        with events_lock:
                            events.append(("renew", name, handle.token, handle.db_now, handle.expires_at))
                except LeaseLost:
                    handle = None
                time.sleep(rng.random() * 0.02)
        except BaseException as exc:  # noqa: BLE001 -- reported by the main thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=contender, args=(f"c{i}",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)

    # Then: no errors, tokens unique per acquisition and increasing in time
    assert not errors, errors
    acquisitions = sorted((e for e in events if e[0] == "acquire"), key=lambda e: e[2])
    assert len(acquisitions) > 20, "contenders should have changed hands many times"
    tokens = [e[2] for e in acquisitions]
    assert len(tokens) == len(set(tokens))
    times = [e[3] for e in acquisitions]
    assert times == sorted(times), "a higher token was issued earlier on the database clock"
    # ... and no holder renewed after a later token had been acquired
    acquired_at = {e[2]: e[3] for e in acquisitions}
    for kind, _name, token, db_now, _expires in events:
        if kind == "renew":
            later = [t for t, at in acquired_at.items() if t > token and at < db_now]
            assert not later, f"token {token} renewed at {db_now} after token {later[0]} was acquired"


SKEWED_CLIENT = """
import datetime, json, os, sys
import time_machine
# This process's clock runs 60 s ahead of the database's.
with time_machine.travel(datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=60), tick=True):
    import django
    django.setup()
    from scheduler.owners import leases
    handle = leases.acquire("beat", "skewed", ttl=10)
    print(json.dumps({"acquired": handle is not None, "local_now": datetime.datetime.now(datetime.timezone.utc).isoformat()}))
"""


def test_skewed_clock__cannot_steal_an_unexpired_lease(process_database_url: str) -> None:
    # Given a lease held by "a" for 10 s on the database clock
    leases.acquire("beat", "a", ttl=10)
    # When a process whose clock is 60 s ahead tries to take it
    env = {**os.environ, "DATABASE_URL": process_database_url, "DJANGO_SETTINGS_MODULE": "project.settings"}
    out = subprocess.run(
        [sys.executable, "-c", SKEWED_CLIENT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # Then it fails: expiry is judged by the database clock, not the caller's
    assert result["acquired"] is False
    assert leases.current("beat").holder == "a"


def test_assert_held__outside_a_transaction_is_refused() -> None:
    handle = leases.acquire("beat", "a", ttl=10)
    with pytest.raises(RuntimeError):
        leases.assert_held(handle)


def test_acquire_gone__takes_over_only_that_holder_and_token() -> None:
    # Given a lease held, unexpired, by "a"
    held = leases.acquire("beat", "a", ttl=10)
    # When "c" claims it as gone with a stale token or another holder
    assert leases.acquire("beat", "c", ttl=10, gone=("a", held.token - 1)) is None
    assert leases.acquire("beat", "c", ttl=10, gone=("b", held.token)) is None
    # Then only the exact (holder, token) is taken over, with a new token
    taken = leases.acquire("beat", "c", ttl=10, gone=("a", held.token))
    assert taken is not None and taken.token == held.token + 1
    assert leases.current("beat").holder == "c"
