"""The beat: the Celery scheduler class, what a replica leads, the leader's pass and its housekeeping.

``scheduler.beat:LeaderScheduler`` is the name ``CELERY_BEAT_SCHEDULER``
gives; the class lives in ``scheduler.beat.scheduler`` and is loaded on
first use, so that importing a module of this package does not load the
whole beat.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from scheduler.beat.scheduler import LeaderScheduler

__all__ = ["LeaderScheduler"]


def __getattr__(name: str) -> Any:
    if name != "LeaderScheduler":
        raise AttributeError(f"module 'scheduler.beat' has no attribute {name!r}")
    from scheduler.beat.scheduler import LeaderScheduler

    return LeaderScheduler
