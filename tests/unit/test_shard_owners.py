"""Rendezvous ownership of shards: every shard owned once, loads within one, few moves on a join or leave."""
from __future__ import annotations

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
