"""Rendezvous ownership of shards: every shard owned once, loads within one, few moves on a join or leave, one count for all."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import shards

PROPERTY = settings(max_examples=200, deadline=None, database=None)

instance_ids = st.lists(st.text("abcdef0123456789-", min_size=1, max_size=24), min_size=1, max_size=12, unique=True)
shard_counts = st.integers(min_value=1, max_value=256)


@PROPERTY
@given(instance_ids, shard_counts)
def test_preferred_owners__every_shard_has_one_live_owner_and_loads_differ_by_at_most_one(
    members: list[str], count: int
) -> None:
    # Given any live replicas and any number of shards
    # When the owners are computed
    owners = shards.preferred_owners(members, count)

    # Then every shard has one owner among the members, and no two loads differ by more than one
    assert sorted(owners) == list(range(count))
    assert set(owners.values()) <= set(members)
    loads = [list(owners.values()).count(member) for member in members]
    assert max(loads) - min(loads) <= 1


@PROPERTY
@given(instance_ids, shard_counts, st.randoms(use_true_random=False))
def test_preferred_owners__the_same_answer_whatever_order_the_replicas_are_listed_in(
    members: list[str], count: int, random: object
) -> None:
    # Given the same live replicas listed in another order (each replica reads them itself)
    shuffled = list(members)
    random.shuffle(shuffled)  # type: ignore[attr-defined]

    # Then every replica computes the same owners
    assert shards.preferred_owners(shuffled, count) == shards.preferred_owners(members, count)


def test_preferred_owners__a_join_moves_about_its_fair_share_not_everything() -> None:
    # Given 64 shards over four replicas
    members = [f"host-{index}-abc" for index in range(4)]
    before = shards.preferred_owners(members, 64)

    # When a fifth replica joins
    after = shards.preferred_owners([*members, "host-4-abc"], 64)

    # Then mostly the shards it takes over move (12 or 13), not a reshuffle of all 64
    moved = [shard for shard in range(64) if before[shard] != after[shard]]
    taken = [shard for shard in moved if after[shard] == "host-4-abc"]
    assert len(taken) in (12, 13)
    assert len(moved) <= 2 * len(taken), f"{len(moved)} shards moved for {len(taken)} taken by the new replica"


def test_preferred_owners__no_replicas_own_nothing() -> None:
    assert shards.preferred_owners([], 8) == {}


def test_shard_of_lease__reads_back_only_the_shard_lease_names() -> None:
    assert [shards.shard_of_lease(name) for name in shards.lease_names(3)] == [0, 1, 2]
    assert shards.shard_of_lease("beat") is None
    assert shards.shard_of_lease("other:1") is None
    assert shards.shard_of_lease("beat:x") is None


@PROPERTY
@given(instance_ids, shard_counts, st.data())
def test_wanted__replicas_started_with_different_settings_follow_one_stored_count(
    members: list[str], stored: int, data: st.DataObject
) -> None:
    # Given live replicas each started with its own SCHEDULER_SHARDS (some
    # mid-way through a rolling change, some never restarted), and one stored count
    configured = {member: data.draw(shard_counts, label=f"SCHEDULER_SHARDS of {member}") for member in members}

    # When each replica works out the shards it should hold, from the count it follows
    wanted = {member: shards.wanted(member, members, shards.resolve(stored, configured[member])) for member in members}

    # Then every shard of the stored count is wanted by exactly one live replica, and none past it
    claims = Counter(shard for owned in wanted.values() for shard in owned)
    assert sorted(claims) == list(range(stored))
    assert set(claims.values()) == {1}


def test_wanted__each_replica_on_its_own_setting_would_leave_shards_unowned() -> None:
    # Given one replica on 4 shards and one restarted on 8 (the old rolling change)
    unowned = []
    for draw in range(50):
        old, new = f"host-old-{draw}", f"host-new-{draw}"
        live = [old, new]
        # When each used its own setting as the count
        claimed = set(shards.wanted(old, live, 4)) | set(shards.wanted(new, live, 8))
        unowned.append(set(range(4)) - claimed)
    # Then in some draws a shard holding schedules (0-3) is wanted by nobody: why the count is stored
    assert any(unowned), "no draw left a shard unowned"
    # ... which one stored count never does
    assert shards.resolve(4, 8) == shards.resolve(4, 4) == 4


def test_resolve__the_setting_only_until_a_count_is_stored() -> None:
    assert shards.resolve(None, 8) == 8
    assert shards.resolve(4, 8) == 4
    assert shards.resolve(1, 64) == 1
