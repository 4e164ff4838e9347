"""Failpoints in a real cluster: one scenario per kind of process and step keeps every guarantee.

The fast subset of the exploration matrix (``tests.support.explore.FAST``; ``make
explore`` runs all of it): a pool child stalled between its claim and its
body, one frozen between its body and its outcome, the leader killed inside its fenced commit, a publisher killed
between pushing a batch and marking it queued, a replica killed while
handing shards over, and the leader killed while reconcile handles a lost
execution. Each scenario runs two beat replicas and two workers on the test
database and broker; ``tests/support/explore.py`` describes the scenario and the
invariants checked (one execution per slot, every execution final within
its bound, no stale body completing, no stall past 2 × the lease TTL,
leadership changing only when a beat replica stops).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import explore

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "action"), explore.FAST, ids=[f"{name}={action}" for name, action in explore.FAST])
def test_failpoint__keeps_the_guarantees(name: str, action: str, process_env: dict[str, str], tmp_path: Path) -> None:
    # Given a cluster whose processes stop, freeze, fail or stall at the failpoint
    # When one execution (commit, publish, handover) passes through it
    result = explore.run(explore.POINTS_BY_NAME[name], action, env=process_env, workdir=tmp_path)
    # Then the point fired where expected, and every invariant holds
    assert result["fired"], f"{name} never fired: {result['logs']}"
    assert result["fired_in"] == explore.POINTS_BY_NAME[name].process, result
    assert result["passed"], result
