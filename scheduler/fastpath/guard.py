"""Whether a fast path is still taken in this process: checked once, fallen back from for good, counted once."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from django.db import DatabaseError, transaction

from scheduler.models.tally import FASTPATH_FALLBACK, TallyIncrement

logger = logging.getLogger(__name__)

#: Every fast path's name: the ``path`` label of ``scheduler_fastpath_fallbacks_total`` (a tally's column: 20
#: characters at most).
PATHS = ("bulk_insert", "celery_result", "prepared", "prepared_statements", "publisher")
#: What a renamed, removed or re-signatured upstream internal raises: breakage, not a broker or database error.
BREAKAGE: tuple[type[Exception], ...] = (AttributeError, TypeError, ImportError, KeyError, NameError)


class FastPath:
    """One fast path's state in this process: taken until its check or a call shows it broken, then never again."""

    def __init__(self, name: str, *, slow_path: str) -> None:
        assert name in PATHS, name
        self.name = name
        #: What runs instead, for the log line.
        self.slow_path = slow_path
        self.fallen = False
        self._checked = False
        self._lock = threading.RLock()  # check_once holds it while a failed check falls back

    def check_once(self, difference: Callable[[], str | None]) -> bool:
        """Run the self-check ``difference`` on the first call in this process; return whether the fast path is taken.

        ``difference`` returns the first way the fast and the slow result
        differ, or ``None``; a difference, or ``BREAKAGE`` raised, falls back.
        """
        if not self._checked:
            with self._lock:
                if not self._checked:
                    self._checked = True
                    self.check(difference)
        return not self.fallen

    def check(self, difference: Callable[[], str | None]) -> bool:
        """Run ``difference`` now (see ``check_once``); return whether the fast path is still taken."""
        try:
            found = difference()
        except BREAKAGE as exc:
            self.fall_back(f"its self-check raised {exc!r}", exc)
        else:
            if found is not None:
                self.fall_back(f"its self-check found a difference from {self.slow_path}: {found}")
        return not self.fallen

    def fall_back(self, reason: str, exc: BaseException | None = None) -> None:
        """Take the slow path from now on in this process; the first call logs one warning and counts one fallback."""
        with self._lock:
            if self.fallen:
                return
            self.fallen = True
        logger.warning(
            "fast path %s falls back to %s for the rest of this process: %s",
            self.name,
            self.slow_path,
            reason,
            exc_info=exc,
            extra={"action": "fastpath_fallback", "path": self.name},
        )
        _count(self.name)


def comparable(value: Any) -> Any:
    """``value`` as a check compares it: the value a JSON adapter wraps (psycopg's ``Jsonb`` has no ``==``).

    Equal values are alike whatever their type: a driver's own ``int``
    subclasses (psycopg's ``Int2``, which Django's PostgreSQL backend adapts
    a small integer to) bind as the plain ``int`` the fast paths send.
    """
    return getattr(value, "obj", value)


def _count(path: str) -> None:
    """Count one fallback (``scheduler_fastpath_fallbacks_total``), in a savepoint of the caller's transaction.

    A count that cannot be written (the database is down) is logged, not
    raised: the caller's own statement reports that database error, if it
    meets it.
    """
    try:
        with transaction.atomic():
            TallyIncrement.objects.create(status=FASTPATH_FALLBACK, task="", trigger=path)
    except DatabaseError:
        logger.warning(
            "counting the fallback of fast path %s failed", path, exc_info=True, extra={"action": "fastpath_fallback"}
        )
