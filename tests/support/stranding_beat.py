"""A beat replica whose instance id would strand a shard if replicas followed their own ``SCHEDULER_SHARDS``.

``python -m tests.support.stranding_beat <other id> <other count> <own count> celery -A project beat ...``

Which shards a replica wants depends on the hash of every live replica's
id, and an id ends in a token drawn at random: only about one pair of ids
in nine has shards below the other replica's count that neither would want
with its own setting. This process draws its token until its id and
``<other id>`` form such a pair, then runs the given ``celery`` command
unchanged; so the test of a rolling restart meets the case it is about on
its first restart, instead of restarting replicas until chance brings it.
"""

from __future__ import annotations

import sys

from celery.bin.celery import main as celery_main

from scheduler import process_ids, shards

#: Draws at most; one id in 200 strands a shard for the least favourable other id seen.
DRAWS = 100_000


def stranded_by_own_settings(live: dict[str, int], count: int) -> set[int]:
    """The shards below ``count`` no replica would want if each followed its own setting ({instance id: setting})."""
    wanted = {
        shard
        for instance_id, own in live.items()
        for shard, owner in shards.preferred_owners(live, own).items()
        if owner == instance_id
    }
    return set(range(count)) - wanted


def main() -> None:
    other_id, other_count, own_count, *celery_argv = sys.argv[1:]
    draw = process_ids.process_id

    def stranding_id(host: str | None = None, pid: int | str | None = None, *, unique: bool = False) -> str:
        if not unique:
            return draw(host, pid)
        for _ in range(DRAWS):
            candidate = draw(host, pid, unique=True)
            if stranded_by_own_settings({other_id: int(other_count), candidate: int(own_count)}, int(other_count)):
                return candidate
        raise SystemExit(f"no instance id in {DRAWS} draws strands a shard against {other_id}")

    process_ids.process_id = stranding_id
    sys.argv = celery_argv
    celery_main()


if __name__ == "__main__":
    main()
