"""The admin's schedule add form, filled in, for tests that post it."""

from __future__ import annotations


def schedule_form(**fields: str) -> dict[str, str]:
    """The admin's add form, filled in with a valid schedule, then ``fields``."""
    return {
        "name": "new",
        "task": "scheduler.echo",
        "args": "[]",
        "kwargs": "{}",
        "queue": "",
        "priority": "",
        "description": "",
        "tenant": "",
        "cron": "",
        "interval": "60",
        "run_at_0": "",
        "run_at_1": "",
        "timezone": "UTC",
        "start_at_0": "",
        "start_at_1": "",
        "end_at_0": "",
        "end_at_1": "",
        "max_runs": "",
        "overlap": "allow",
        "catchup_window": "300",
        "misfire": "run_all",
        "jitter": "0",
        "dst_gap": "shift",
        "dst_fold": "first",
        "timeout": "",
        "max_retries": "0",
        "retry_backoff": "1",
        "pause_after_failures": "",
        "enabled": "on",
        "paused_reason": "",
        **fields,
    }
