"""The one writer of Instance rows: each process's heartbeat, and its removal; and the one format of a process's id.

A heartbeat's times are the database's clock, so a reader compares
``last_seen`` with the same clock whichever process wrote it.
"""

from __future__ import annotations

import os
import secrets
import socket
from datetime import datetime

from celery import __version__ as celery_version
from django.db.models.functions import Now

from scheduler.models import Instance


def process_id(host: str | None = None, pid: int | str | None = None, *, unique: bool = False) -> str:
    """Return a process's id: ``<host>:<pid>``, then ``:<token>`` when ``unique``.

    Every id the project writes has this format: a beat replica's (its
    Instance row and its lease holder name), a worker's heartbeat (``host``
    is its Celery node name) and a claim's ``Execution.worker`` (the pool
    process's). A lease holder's id is ``unique``: the token drawn at its
    start tells it apart from an earlier process of the same host and pid
    (a restarted container), which must never count as the same holder.
    """
    ident = f"{host or socket.gethostname()}:{os.getpid() if pid is None else pid}"
    return f"{ident}:{secrets.token_hex(3)}" if unique else ident


def beat(instance_id: str, *, role: str, is_leader: bool = False) -> None:
    """Record that ``instance_id`` (this process, of ``role``) is alive now; create its row on its first beat."""
    Instance.objects.update_or_create(
        instance_id=instance_id,
        defaults={"last_seen": Now(), "is_leader": is_leader},
        create_defaults={
            "role": role,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "version": celery_version,
            "started_at": Now(),
            "last_seen": Now(),
            "is_leader": is_leader,
        },
    )


def remove(instance_id: str) -> None:
    """Remove the row of ``instance_id``: its process is stopping."""
    Instance.objects.filter(instance_id=instance_id).delete()


def remove_stale(instance: Instance, *, cutoff: datetime) -> bool:
    """Remove ``instance`` if it is still unseen since ``cutoff``; False if it beat meanwhile (or is gone)."""
    return bool(Instance.objects.filter(pk=instance.pk, last_seen__lt=cutoff).delete()[0])
