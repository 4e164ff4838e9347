"""How every row names a process: one format, ``<host>:<pid>``."""

from __future__ import annotations

import os
import secrets
import socket

#: The longest id a row holds (``Instance.instance_id``, ``Execution.worker``, ``Lease.holder``).
MAX_LENGTH = 255
#: The largest pid Linux gives (``pid_max`` at most 2**22).
MAX_PID = 4_194_304


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
