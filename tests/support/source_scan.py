"""The project's own source, as the source scans read it (``tests/unit/test_row_owners.py``, ``test_audit_writers.py``)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What the scans read: the app and the demo project.
SCANNED = ("scheduler", "project")
#: Never scanned: migrations run at deploy time, through the historical models.
SKIPPED_DIRS = ("scheduler/migrations/",)


def project_sources() -> dict[str, str]:
    """Return {path relative to the repository: text} of every Python file the scans read."""
    files = [file for top in SCANNED for file in sorted((ROOT / top).rglob("*.py"))]
    sources = {file.relative_to(ROOT).as_posix(): file for file in files}
    return {
        path: file.read_text(encoding="utf-8") for path, file in sources.items() if not path.startswith(SKIPPED_DIRS)
    }
