"""Run the whole pytest suite on SQLite and on PostgreSQL at once, against real services.

Usage: ``python -m tests.suite [pytest args...]`` (what ``make test`` runs).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from tests.support.services import ServiceError, postgres_cluster, redis_server

ROOT = Path(__file__).resolve().parent.parent
NO_TESTS_COLLECTED = 5  #: pytest's exit code when nothing was collected
#: What the whole suite (no paths given) runs in one database's run only, to keep within its time. The chaos soak
#: runs on PostgreSQL, the production database, and the explorer's fast subset on SQLite, so each run has a fault
#: run; ``make run`` uses its own SQLite file whatever the suite's database, so it is the same test in both runs.
#: So are the tests that reach no database: the pure unit tests and the checks of the repository's files.
LEFT_TO_THE_OTHER_RUN = {
    "sqlite": ["tests/chaos/test_soak.py"],
    "postgresql": [
        "tests/chaos/test_explore.py",
        "tests/acceptance/test_make_run.py",
        "tests/unit",
        "tests/integration/test_docker_files.py",
        "tests/integration/test_docs.py",
        "tests/integration/test_packaging.py",
        "tests/integration/test_runbooks.py",
    ],
}


@dataclass(frozen=True)
class RunResult:
    """Outcome of one pytest run, from its exit code and JUnit XML report."""

    label: str
    exit_code: int
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    #: "file::test: first line of the message" for each failed or erroring test
    failures: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        # Exit 0 alone is not enough: a run that collected or passed nothing
        # (wrong testpaths, everything skipped) must not look green.
        return self.exit_code == 0 and self.passed > 0


def parse_junit(label: str, exit_code: int, path: Path) -> RunResult:
    """Sum the counts of every <testsuite> in a pytest JUnit XML file."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return RunResult(label, exit_code)  # pytest died before writing it
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    failures = tuple(
        f"{case.get('classname', '')}::{case.get('name', '')}: {first_line(problem.get('message', ''))}"
        for case in root.iter("testcase")
        for problem in case
        if problem.tag in ("failure", "error")
    )
    return RunResult(label, exit_code, passed, total["failures"], total["errors"], total["skipped"], failures)


def first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:limit]


def banner(text: str) -> None:
    line = "=" * 78
    print(f"\n{line}\n== {text}\n{line}", flush=True)


def start_pytest(
    label: str, env: dict[str, str], args: list[str], junit: Path
) -> tuple[subprocess.Popen[str], threading.Thread]:
    """Start pytest in a subprocess with env; a thread copies its output, each line prefixed with label."""
    print(f"[{label}] pytest on {env.get('DATABASE_URL', 'sqlite file in ' + env['VAR_DIR'])}", flush=True)
    process = subprocess.Popen(
        [sys.executable, "-m", "pytest", *args, f"--junitxml={junit}"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )

    def copy_output() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            print(f"[{label}] {line}", end="", flush=True)

    copier = threading.Thread(target=copy_output, daemon=True)
    copier.start()
    return process, copier


def summary(results: list[RunResult]) -> str:
    row = "{:<12}{:>6}{:>8}{:>8}{:>8}{:>9}  {}".format
    header = row("database", "exit", "passed", "failed", "errors", "skipped", "result")
    rows = [
        row(
            r.label,
            r.exit_code,
            r.passed,
            r.failed,
            r.errors,
            r.skipped,
            "ok" if r.ok else "FAILED" + (" (no test passed)" if r.passed == 0 else ""),
        )
        for r in results
    ]
    # The names come last, so that the tail of a CI log says what failed.
    failures = [f"{r.label}: {failure}" for r in results for failure in r.failures]
    return "\n".join([header, "-" * len(header), *rows, *(["", "failed:", *failures] if failures else [])])


def named_tests(args: list[str]) -> bool:
    """Whether ``args`` name tests to run (paths, node ids): then each database runs them, none left to the other.

    Options alone (``-q``, ``-x``) keep the whole suite's split.
    """
    return any(Path(arg.split("::")[0]).exists() for arg in args if not arg.startswith("-"))


def main(args: list[str]) -> int:
    """Start Redis and PostgreSQL, run pytest on SQLite and on PostgreSQL at once, report both."""
    # SIGTERM (CI cancel) becomes SystemExit so the services' teardown runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    base = {
        k: v
        for k, v in os.environ.items()
        # Anything here would point the tests at someone else's services.
        if k not in {"DATABASE_URL", "REDIS_URL", "CELERY_BROKER_URL", "VAR_DIR"}
    }
    # SCHEDULER_SUITE_DATABASES=postgresql runs one database only (make chaos does).
    wanted = os.environ.get("SCHEDULER_SUITE_DATABASES", "").split(",")
    labels = [label for label in ("sqlite", "postgresql") if label in wanted] or ["sqlite", "postgresql"]
    running: dict[str, tuple[subprocess.Popen[str], threading.Thread]] = {}
    try:
        with contextlib.ExitStack() as services:
            workdir = Path(services.enter_context(tempfile.TemporaryDirectory(prefix="scheduler-suite-")))
            # Both databases run at once (most tests wait on real processes, so
            # two runs share 2 cores well), each with its own broker.
            for label in labels:
                env = {
                    **base,
                    "REDIS_URL": services.enter_context(redis_server()),
                    "DJANGO_DEBUG": "1",
                    # Keeps tests off the dev var/db.sqlite3.
                    "VAR_DIR": str(workdir / f"var-{label}"),
                    "SCHEDULER_TEST_DB_LABEL": label,
                }
                if label == "postgresql":
                    env["DATABASE_URL"] = services.enter_context(postgres_cluster())
                extra = [] if named_tests(args) else [f"--ignore={path}" for path in LEFT_TO_THE_OTHER_RUN[label]]
                running[label] = start_pytest(label, env, [*args, *extra], workdir / f"junit-{label}.xml")
            results = []
            for label, (process, copier) in running.items():
                code = process.wait()
                copier.join()
                results.append(parse_junit(label, code, workdir / f"junit-{label}.xml"))
    except ServiceError as exc:
        print(f"\ntests.suite: cannot start test services: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # services were stopped by the context managers
        print("\ntests.suite: interrupted", file=sys.stderr)
        return 130
    finally:
        for process, _ in running.values():
            if process.poll() is None:  # cancelled: do not leave pytest running on stopped services
                process.kill()
    banner("summary")
    print(summary(results), flush=True)
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
