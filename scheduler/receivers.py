"""Celery signal receivers: a worker's heartbeat in the Instance registry (observe, never veto)."""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

from celery import __version__ as celery_version
from celery.signals import worker_ready, worker_shutdown
from django.db import DatabaseError, close_old_connections
from django.db.models.functions import Now

from scheduler.conf import settings
from scheduler.models import Instance

logger = logging.getLogger(__name__)

_stop = threading.Event()


def _instance_id(sender: Any) -> str:
    return f"{getattr(sender, 'hostname', None) or socket.gethostname()}-{os.getpid()}"


def _beat(instance_id: str) -> None:
    """Write the worker's heartbeat now and then every renew interval, until shutdown."""
    while True:
        try:
            Instance.objects.update_or_create(
                instance_id=instance_id,
                defaults={"last_seen": Now()},
                create_defaults={
                    "role": Instance.Role.WORKER,
                    "hostname": socket.gethostname(),
                    "pid": os.getpid(),
                    "version": celery_version,
                    "started_at": Now(),
                    "last_seen": Now(),
                },
            )
        except DatabaseError:
            logger.warning("could not write the worker heartbeat; trying again", exc_info=True)
            close_old_connections()
        if _stop.wait(settings.EXECUTION_RENEW_SECONDS):
            return


@worker_ready.connect(dispatch_uid="scheduler.worker_heartbeat")
def start_heartbeat(sender: Any = None, **kwargs: Any) -> None:
    _stop.clear()
    threading.Thread(target=_beat, args=(_instance_id(sender),), name="worker-heartbeat", daemon=True).start()


@worker_shutdown.connect(dispatch_uid="scheduler.worker_heartbeat_stop")
def stop_heartbeat(sender: Any = None, **kwargs: Any) -> None:
    _stop.set()
    try:
        Instance.objects.filter(instance_id=_instance_id(sender)).delete()
    except DatabaseError:
        pass  # reconcile removes stale instances
