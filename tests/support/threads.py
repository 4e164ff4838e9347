"""Test code run on threads of its own, each with its own database connection, keeping what it raises."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from django.db import connection, transaction

from tests.support.processes import wait_until


def on_own_connection(body: Callable[[], None], errors: list[BaseException]) -> Callable[[], None]:
    """``body`` as a thread's target: what it raises goes to ``errors``, and the thread's connection is closed after.

    Django opens one connection per thread; left open, it keeps the test database from being dropped.
    """

    def run() -> None:
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 -- reported by the test's assertion
            errors.append(exc)
        finally:
            connection.close()

    return run


def run_at_once(bodies: Sequence[Callable[[], None]], errors: list[BaseException], *, timeout: float) -> None:
    """Run ``bodies`` at once, each on its own connection, until all return; fail if one is stuck past ``timeout``."""
    threads = [threading.Thread(target=on_own_connection(body, errors)) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck"


def waits_for_a_lock(backend_pid: int) -> bool:
    """Whether the PostgreSQL session ``backend_pid`` is waiting for a lock."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", [backend_pid])
        return bool(cursor.fetchone()[0])


def closing_a_cycle(
    first: Callable[[], None], then: Callable[[], None], *, behind: int, errors: list[BaseException], timeout: float
) -> threading.Thread:
    """Start a thread whose transaction runs ``first``, waits until session ``behind`` waits for a lock, runs ``then``, commits.

    Returns once ``first`` ran (or raised). When ``behind`` waits for what
    ``first`` took and ``then`` needs what ``behind`` holds, the two wait for
    each other: PostgreSQL's deadlock detector, or a ``lock_timeout``, ends
    one of them. What this side raises goes to ``errors``.
    """

    first_ran = threading.Event()

    def body() -> None:
        with transaction.atomic():
            try:
                first()
            finally:
                first_ran.set()
            assert wait_until(lambda: waits_for_a_lock(behind), timeout=timeout, interval=0.02), (
                f"session {behind} never waited for a lock"
            )
            then()

    thread = threading.Thread(target=on_own_connection(body, errors))
    thread.start()
    assert first_ran.wait(timeout), "the other transaction's first statement never ran"
    return thread
