"""Build the project's wheel in a copy of the files it is made of (two suite runs may build at once)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTION = "django-leader-beat"


def build(workdir: Path) -> Path:
    """Build the wheel under ``workdir``; return its path."""
    source = workdir / "source"
    source.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "scheduler", source / "scheduler", ignore=shutil.ignore_patterns("__pycache__"))
    out = workdir / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    [path] = out.glob("*.whl")
    return path
