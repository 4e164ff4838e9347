"""The manual: it builds without a broken link, and its reference pages name every setting, command, flag and metric."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import load_command_class

from scheduler.conf import Defaults
from tests.support.processes import ROOT

DOCS = ROOT / "docs"
COMMANDS = sorted(path.stem for path in (ROOT / "scheduler" / "management" / "commands").glob("[!_]*.py"))
#: Flags every Django command has: Django documents them.
DJANGO_FLAGS = {
    "--help",
    "--version",
    "--verbosity",
    "--settings",
    "--pythonpath",
    "--traceback",
    "--no-color",
    "--force-color",
    "--skip-checks",
}


def test_docs__build_strict_with_every_page_in_the_nav_and_no_broken_link(tmp_path: Path) -> None:
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert (tmp_path / "site" / "adding-to-a-project" / "index.html").is_file()


def test_readme__is_a_landing_page_under_250_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) < 250


def test_configuration_page__names_every_setting() -> None:
    page = (DOCS / "configuration.md").read_text()
    settings = [name for name in vars(Defaults) if name.isupper()]
    assert len(settings) > 20
    assert [name for name in settings if f"`SCHEDULER_{name}`" not in page] == []


def _flags(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                found.append(((*path, name), ""))
                found += _flags(subparser, (*path, name))
        found += [(path, flag) for flag in action.option_strings if flag.startswith("--") and flag not in DJANGO_FLAGS]
    return found


@pytest.mark.parametrize("command", COMMANDS)
def test_commands_page__names_every_command_action_and_flag(command: str) -> None:
    page = (DOCS / "reference" / "commands.md").read_text()
    # Each command and action has its own heading, and each flag is in its section
    sections = dict(re.findall(r"^#{2,3} `([^`]+)`\n(.*?)(?=^#{2,3} `|\Z)", page, re.M | re.S))
    parser = load_command_class("scheduler", command).create_parser("manage.py", command)
    missing = []
    for path, flag in [((command,), ""), *_flags(parser, (command,))]:
        section = sections.get(" ".join(path))
        if section is None:
            missing.append(" ".join(path))
        elif flag and f"`{flag}`" not in section:
            missing.append(f"{' '.join(path)} {flag}")
    assert missing == []


def test_operations_page__names_every_metric() -> None:
    page = (DOCS / "operations.md").read_text()
    metrics = set(re.findall(r'"(scheduler_[a-z_]+)"', (ROOT / "scheduler" / "web" / "metrics.py").read_text()))
    assert len(metrics) > 10
    assert sorted(name for name in metrics if name not in page) == []
