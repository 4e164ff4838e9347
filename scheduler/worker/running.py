"""The execution a task runs, as the task sees it: its row, its checkpoint, its fenced block.

``scheduler.current_execution()`` returns a ``RunningExecution``. Its reads
fall through to the Execution row as claimed (``pk``, ``attempt``,
``schedule_id``...), so code that treats it as the row keeps working.

Both writes it offers are fenced by the claim (execution id, attempt,
``running``), like every write of a claim holder, and raise ``ClaimLost``
when the claim moved on:

- ``checkpoint(data)`` saves a small JSON progress value on the row; the
  next attempt (a retry, or a successor after this worker was lost) reads it
  as ``last_checkpoint`` and resumes from there.
- ``fenced()`` opens a transaction and commits the block's writes together
  with the execution's ``succeeded`` outcome, or not at all: writes to the
  project's database then happen exactly once, even when a frozen worker
  resumes after its successor finished.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.db import transaction

from scheduler import limits
from scheduler.exceptions import CheckpointInvalid, ClaimLost, FenceRefused
from scheduler.failpoints import failpoint
from scheduler.models import Execution
from scheduler.owners import executions
from scheduler.owners.executions import Claim

#: A checkpoint is progress, not data: larger ones are refused (bytes of its JSON).
CHECKPOINT_MAX_BYTES = 64 * 1024


class RunningExecution:
    """The execution a task runs under its claim; reads fall through to the claimed row."""

    def __init__(self, execution: Execution, claim: Claim, *, on_succeeded: Callable[[Claim], None]) -> None:
        #: The row as claimed (``progress`` kept current by ``checkpoint()``).
        self.execution = execution
        #: The fencing token every write below matches on.
        self.claim = claim
        #: Whether a fenced block committed this attempt's ``succeeded`` outcome.
        self.succeeded = False
        self._on_succeeded = on_succeeded
        self._in_fenced_block = False

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not defined here; "execution" itself is
        # looked up in __dict__ so a half-built object cannot recurse.
        execution = self.__dict__.get("execution")
        if execution is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(execution, name)

    def __repr__(self) -> str:
        return f"<RunningExecution {self.claim.execution_id} attempt {self.claim.attempt}>"

    @property
    def last_checkpoint(self) -> Any:
        """The progress saved last by this attempt or an earlier one (``None``: nothing saved yet)."""
        return self.execution.progress

    def checkpoint(self, data: Any) -> None:
        """Save ``data`` (JSON, at most ``CHECKPOINT_MAX_BYTES``) as this execution's progress.

        Raises ``CheckpointInvalid`` for data that is not JSON, too large, or holds a NUL or a lone surrogate,
        and ``ClaimLost`` when this attempt no longer holds the execution;
        either way nothing is saved. Called inside the caller's own
        ``transaction.atomic()``, it commits (or rolls back) with the
        caller's writes.
        """
        self._refuse_after_outcome("checkpoint()")
        if self._in_fenced_block:
            # Pointless (the block ends the execution) and it would lock the
            # execution row before the block's end locks the schedule row.
            raise FenceRefused(
                "checkpoint() inside a fenced block: the block records the outcome; save progress before it"
            )
        try:
            text = json.dumps(data, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CheckpointInvalid(f"checkpoint refused, it is not JSON: {exc}") from None
        size = len(text.encode())
        if size > CHECKPOINT_MAX_BYTES:
            raise CheckpointInvalid(
                f"checkpoint refused: its JSON is {size} bytes, more than {CHECKPOINT_MAX_BYTES}; "
                "save progress, not data"
            )
        if limits.holds_unstorable_text(data):
            raise CheckpointInvalid(
                "checkpoint refused: it holds a NUL (\\u0000) or a lone surrogate, which no database stores as text"
            )
        stored = json.loads(text)  # what the next attempt will read back (tuples become lists)
        failpoint("running.checkpoint")
        if not executions.save_checkpoint(self.claim, stored):
            raise ClaimLost(self._lost("its checkpoint was not saved"))
        self.execution.progress = stored

    @contextmanager
    def fenced(self) -> Iterator[None]:
        """Commit the block's writes with this execution's ``succeeded`` outcome, only while the claim holds.

        Raises ``ClaimLost`` (the block's writes rolled back, nothing
        recorded) when the claim moved on. One fenced block may commit per
        attempt; it must not be nested in another transaction, whose
        rollback would undo an outcome already reported.
        """
        self._refuse_after_outcome("fenced()")
        if transaction.get_connection().in_atomic_block:
            raise FenceRefused("fenced() inside transaction.atomic(): it must open its own transaction")
        with transaction.atomic():
            self._in_fenced_block = True
            try:
                yield
            finally:
                self._in_fenced_block = False
            failpoint("running.fenced")
            if not executions.finish_in_transaction(self.claim):
                raise ClaimLost(self._lost("the fenced block was rolled back"))
        self.succeeded = True
        self._on_succeeded(self.claim)

    def _refuse_after_outcome(self, what: str) -> None:
        if self.succeeded:
            raise FenceRefused(
                f"{what} after a fenced block committed: execution {self.claim.execution_id} has already succeeded"
            )

    def _lost(self, consequence: str) -> str:
        return (
            f"execution {self.claim.execution_id} attempt {self.claim.attempt}: the claim moved on "
            f"(another attempt holds it, or it ended); {consequence}"
        )
