"""What the fast path tests share: a fresh fast path per test, its fallback warnings and its count on ``/metrics``."""

from __future__ import annotations

import logging
import re
from types import ModuleType

import pytest
from django.test import Client

from scheduler.fastpath.guard import FastPath


def fresh(monkeypatch: pytest.MonkeyPatch, module: ModuleType) -> FastPath:
    """Give ``module`` a fast path not yet checked nor fallen back from, as in a new process; return it."""
    path = FastPath(module.FAST_PATH.name, slow_path=module.FAST_PATH.slow_path)
    monkeypatch.setattr(module, "FAST_PATH", path)
    return path


def fallback_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        record
        for record in caplog.records
        if getattr(record, "action", None) == "fastpath_fallback" and record.levelno == logging.WARNING
    ]


def fallbacks_counted(path: str) -> float:
    """``scheduler_fastpath_fallbacks_total{path=...}`` as ``/metrics`` serves it."""
    response = Client().get("/metrics")
    assert response.status_code == 200
    found = re.search(
        rf'^scheduler_fastpath_fallbacks_total\{{path="{path}"\}} (\S+)$', response.content.decode(), re.M
    )
    assert found, response.content.decode()
    return float(found.group(1))
