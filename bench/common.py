"""What every benchmark shares: its own services, a migrated database, tables and JSON."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"


def machine() -> dict[str, Any]:
    """Describe the machine a result was measured on."""
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def django_env(database_url: str, redis_url: str, var_dir: Path) -> dict[str, str]:
    """Return the environment for a child process that uses these services."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SCHEDULER_")}
    env.update(
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        CELERY_BROKER_URL=redis_url,
        DJANGO_DEBUG="1",
        DJANGO_SETTINGS_MODULE="project.settings",
        VAR_DIR=str(var_dir),
        PYTHONUNBUFFERED="1",
    )
    return env


def migrate(env: dict[str, str]) -> None:
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, env=env, check=True
    )


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Render rows as a plain-text table with right-aligned numbers."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max(len(str(h)), *(len(row[i]) for row in cells)) for i, h in enumerate(headers)]
    line = "  ".join(str(h).ljust(w) for h, w in zip(headers, widths, strict=True))
    out = [line, "-" * len(line)]
    for row in cells:
        out.append("  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(out)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _numeric(text: str) -> bool:
    return text.replace(",", "").replace(".", "").replace("-", "").isdigit()


def write_results(name: str, payload: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` with the machine and time of the run."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    document = {"benchmark": name, "measured_at": datetime.now(timezone.utc).isoformat(), "machine": machine(), **payload}
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path
