"""During a burst, the leader publishes on a thread of its own: the next part commits while the last one is sent.

A tick that leaves due schedules for the next one (a burst, a backlog:
``DispatchReport.more``) wakes this thread and goes on committing; the
tick that ends the burst publishes in line, as every other tick does. The
commit mostly waits for the database and the publish mostly builds
messages, so the two overlap. Publishers take different batches
(``outbox.publish_pending`` locks each batch's rows and passes over locked
ones), so the thread and the tick never send a row twice. PostgreSQL only:
SQLite has one writer at a time and no row locks.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Callable

from django.db import DatabaseError, connection

logger = logging.getLogger(__name__)


class Publishing:
    """One daemon thread that runs ``publish`` (one pass; whether a full batch went out) until nothing is left, when woken."""

    def __init__(self, publish: Callable[[], bool]) -> None:
        self._publish = publish
        self._woken = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        """Publish what is pending now, on the thread (started on first use); never waits."""
        if self._thread is None or not self._thread.is_alive():
            # The copied context carries the bound log fields (instance id, token) into the thread.
            self._thread = threading.Thread(
                target=contextvars.copy_context().run, args=(self._run,), name="scheduler-publish", daemon=True
            )
            self._thread.start()
        self._woken.set()

    def close(self, *, timeout: float) -> None:
        """Stop the thread after its pass, waiting for it at most ``timeout`` seconds."""
        self._stopping = True
        self._woken.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._woken.wait()
                self._woken.clear()
                try:
                    while not self._stopping and self._publish():
                        pass
                except DatabaseError:
                    logger.warning("publishing paused: the database did not answer", exc_info=True)
                    connection.close()  # this thread's own; the next wake reconnects
                except Exception:  # the thread's boundary: the in-line publish of the next tick goes on
                    logger.exception("publishing failed; the next tick publishes", extra={"action": "publish_failed"})
        finally:
            connection.close()
