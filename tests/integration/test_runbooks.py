"""docs/runbooks/: a page behind every alert; every ``manage.py`` command the manual shows exists with its flags."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from functools import cache

import pytest
import yaml
from django.core.management import ManagementUtility

from tests.support.processes import ROOT

RUNBOOKS = ROOT / "docs" / "runbooks"
PAGES = sorted(path for path in RUNBOOKS.glob("*.md") if path.name != "README.md")
#: The failures issue 19 asks a page for, besides one per alert.
REQUIRED = {
    "no-leader",
    "leader-flapping",
    "backlog-growing",
    "executions-stuck-queued",
    "circuit-breaker",
    "broker-down",
    "database-down",
}
FENCED = re.compile(r"^```[a-z]*[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`]+)`")


def _commands(text: str) -> list[list[str]]:
    """Every ``manage.py`` invocation in a page (code blocks and inline code), as argv after ``manage.py``."""
    snippets = [line for block in FENCED.findall(text) for line in block.splitlines()]
    snippets += [" ".join(span.split()) for span in INLINE.findall(FENCED.sub("", text))]
    found = []
    for snippet in snippets:
        if "manage.py " in snippet:
            rest = snippet.split("manage.py ", 1)[1].split("|")[0]
            found.append(shlex.split(rest))
    return found


@cache
def _help(*argv: str) -> tuple[int, str]:
    """Run ``manage.py <argv> --help`` in this process once; return its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        ManagementUtility(["manage.py", *argv, "--help"]).execute()
    return exited.value.code or 0, out.getvalue() + err.getvalue()


def test_runbooks__every_alert_links_an_existing_page() -> None:
    groups = yaml.safe_load((ROOT / "docker" / "prometheus" / "alerts.yml").read_text())["groups"]
    for rule in (rule for group in groups for rule in group["rules"]):
        page = ROOT / rule["annotations"]["runbook_url"]
        assert page.is_file() and page.parent == RUNBOOKS, f"{rule['alert']}: {page} is not a runbook"
        # The page names the alert it answers
        assert rule["alert"] in page.read_text(), f"{page.name} does not mention {rule['alert']}"


def test_runbooks__each_failure_has_a_page_that_says_what_it_looks_like_how_to_check_and_fix() -> None:
    assert REQUIRED <= {page.stem for page in PAGES}
    index = (RUNBOOKS / "README.md").read_text()
    for page in PAGES:
        text = page.read_text()
        headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
        assert headings[:3] == ["What it looks like", "Check", "Fix"], page.name
        assert f"]({page.name})" in index, f"{page.name} is not listed in docs/runbooks/README.md"
        for link in re.findall(r"\]\(([a-z0-9-]+\.md)\)", text):
            assert (RUNBOOKS / link).is_file(), f"{page.name} links a missing page {link}"


def test_docs__every_manage_py_command_and_flag_exists() -> None:
    # Given every manage.py command the manual's pages (runbooks included) and the README show
    checked = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for argv in _commands(page.read_text()):
            name, rest = argv[0], argv[1:]
            # When its help runs (once per command and action)
            status, output = _help(name)
            assert status == 0, f"{page.name}: manage.py {name}: {output.strip()}"
            if " ACTION ..." in output:
                action, rest = rest[0], rest[1:]
                status, output = _help(name, action)
                assert status == 0, f"{page.name}: manage.py {name} {action}: {output.strip()}"
            # Then each flag it uses is one the command (or action) accepts
            for flag in (token.split("=")[0] for token in rest if token.startswith("-")):
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", output), (
                    f"{page.name}: manage.py {shlex.join(argv)}: no {flag}"
                )
            checked += 1
    assert checked >= 60, "the pages should show the commands to run"


def test_runbooks__the_check_fails_on_an_invented_flag_or_command() -> None:
    # A check that cannot fail proves nothing: an unknown flag and an unknown command are caught
    (argv,) = _commands("```sh\npython manage.py leases --holder x\n```\n")
    status, output = _help(argv[0])
    assert status == 0 and not re.search(r"(?<![\w-])--holder(?![\w-])", output)
    assert _help("no_such_command")[0] != 0
    assert _help("schedules", "no-such-action")[0] != 0


def test_docs__link_the_runbooks_and_the_monitoring_profile() -> None:
    operations = (ROOT / "docs" / "operations.md").read_text()
    deploying = (ROOT / "docs" / "deploying.md").read_text()
    assert "runbooks/README.md" in operations
    assert "docker/prometheus/alerts.yml" in operations and "docker/grafana/" in operations
    assert "--profile monitoring" in deploying


def test_commands_parser__reads_fenced_and_wrapped_inline_commands() -> None:
    text = "Run `python manage.py schedules update NAME\n  --jitter 30` or\n\n```sh\npython manage.py leases --json | jq .\n```\n"
    assert sorted(_commands(text)) == [["leases", "--json"], ["schedules", "update", "NAME", "--jitter", "30"]]
