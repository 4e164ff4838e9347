"""Test code run on threads of its own, each with its own database connection, keeping what it raises."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from django.db import connection


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
