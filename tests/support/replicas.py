"""Beat replicas in the test process, which a test ticks itself (started by the ``beat_replica`` fixture)."""

from __future__ import annotations

from collections.abc import Callable

from scheduler.beat import LeaderScheduler

#: ``beat_replica(**options)``: a ``LeaderScheduler(app, lazy=True, **options)``, closed after the test.
BeatReplica = Callable[..., LeaderScheduler]

#: The longest sleep of a tick where a test looks at what the tick does, not at how long it sleeps
#: (on PostgreSQL a tick ends with its sleep, ``Leadership.wait``): ``beat_replica(max_interval=TICK_SLEEP)``.
TICK_SLEEP = 0.05
