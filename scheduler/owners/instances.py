"""The one writer of Instance rows: each process's heartbeat, and its removal.

A heartbeat's times are the database's clock, so a reader compares
``last_seen`` with the same clock whichever process wrote it.
"""

from __future__ import annotations

import os
import socket
from datetime import datetime

from celery import __version__ as celery_version
from django.db.models.functions import Now

from scheduler.models import Instance


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
