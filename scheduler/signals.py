"""Django signals the scheduler sends; receivers observe, they cannot veto."""

from __future__ import annotations

from django.dispatch import Signal

#: Sent by a beat replica that just became leader. Arguments: ``instance_id``, ``token``.
leadership_acquired = Signal()

#: Sent by a beat replica that stopped being leader. Arguments: ``instance_id``,
#: ``token``, ``reason`` ("lost", "released", "database unavailable").
leadership_lost = Signal()
