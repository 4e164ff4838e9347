"""The leadership a beat replica holds, without a database: what each kind waits for, and the ring of sharded replicas."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler.beat.leadership import Leadership, OneLease
from scheduler.beat.shard_keeper import ShardKeeper

PROPERTY = settings(max_examples=200, deadline=None, database=None)

instance_ids = st.lists(st.text("abcdef0123456789-", min_size=1, max_size=24), min_size=1, max_size=12, unique=True)


def _keeper(instance_id: str, live: set[str]) -> ShardKeeper:
    keeper = ShardKeeper(instance_id, 4, lock=None)
    keeper.live = live
    return keeper


@PROPERTY
@given(instance_ids)
def test_watched__the_live_replicas_watch_each_other_in_one_ring(members: list[str]) -> None:
    # Given every live replica's keeper, each having seen the same live set
    live = set(members)
    keepers = {member: _keeper(member, live) for member in members}

    # When each picks the replica it waits for
    watched = {member: keeper.watched() for member, keeper in keepers.items()}

    # Then alone it waits for nobody; otherwise every replica is watched by exactly one other,
    # so the end of any one of them wakes somebody
    if len(members) == 1:
        assert watched == {members[0]: None}
    else:
        assert sorted(watched.values()) == sorted(members)
        assert all(watched[member] != member for member in members)


def test_watched__a_replica_not_yet_in_the_live_set_still_joins_the_ring() -> None:
    # Given a replica whose last step did not see itself live yet
    keeper = _keeper("b", {"a", "c"})
    # Then it watches the next one after itself in id order
    assert keeper.watched() == "c"
    assert _keeper("c", {"a", "b"}).watched() == "a"


def test_wait__nothing_to_wait_on_without_liveness_so_the_whole_sleep_is_left() -> None:
    # Given either kind of leadership on a database without liveness (SQLite), holding nothing
    kinds: list[Leadership] = [OneLease("a", lock=None, sender=object), ShardKeeper("a", 4, lock=None)]
    for leadership in kinds:
        # Then waiting spends nothing: the beat's own sleep does
        assert leadership.wait(1.5) == 1.5
        assert leadership.wait(0.0) == 0.0
        assert leadership.held == {}


def test_pause_and_lost__holding_nothing_touch_no_database() -> None:
    # Given either kind holding nothing (a unit test has no database: any query would fail)
    kinds: list[Leadership] = [OneLease("a", lock=None, sender=object), ShardKeeper("a", 4, lock=None)]
    for leadership in kinds:
        # When the database goes away, or a fence names leases it does not hold
        leadership.pause()
        leadership.lost(("beat", "beat:0"))
        # Then it still holds nothing and asked nothing
        assert leadership.held == {}
