"""Revoke the Celery tasks of cancelled executions on a thread of their own, never on the beat's tick.

Celery's ``control.revoke`` broadcasts through the app's producer pool and
retries until the broker takes the message: on a broker that stopped
answering it waits for as long as the broker is silent. The leader's tick
renews its lease, so it hands the task ids over here and goes on. A revoke
is only a courtesy: the executions are recorded ``cancelled`` before, and a
worker that still gets such a message refuses it (a cancelled execution
cannot be claimed).
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from typing import TYPE_CHECKING

from scheduler.exceptions import BrokerUnavailable
from scheduler.outbox import broker

if TYPE_CHECKING:
    from celery import Celery

logger = logging.getLogger(__name__)


class Revoker:
    """One daemon thread that sends the revokes handed to ``revoke``, oldest first; ``revoke`` never waits."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._waiting: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def revoke(self, task_ids: list[str]) -> None:
        """Have the tasks ``task_ids`` revoked (and terminated where they run) as soon as the broker takes it."""
        if not task_ids:
            return
        self._waiting.put(list(task_ids))
        if self._thread is None:
            # The copied context carries the bound log fields (instance id, token) into the thread.
            self._thread = threading.Thread(
                target=contextvars.copy_context().run, args=(self._run,), name="scheduler-revoke", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            task_ids = self._waiting.get()
            while not self._waiting.empty():  # what piled up while the broker was slow goes in one broadcast
                task_ids += self._waiting.get()
            try:
                broker.revoke(self.app, task_ids)
            except BrokerUnavailable as exc:
                logger.warning("could not revoke %s: %s", task_ids, exc, extra={"action": "revoke_failed"})
