"""The suite's closing table names each failed test, so a CI log's tail says what broke."""

from pathlib import Path

from tests.suite import named_tests, parse_junit, summary

JUNIT = """<?xml version="1.0"?>
<testsuites><testsuite tests="3" failures="1" errors="1" skipped="0">
  <testcase classname="tests.unit.test_a" name="test_ok"/>
  <testcase classname="tests.unit.test_a" name="test_bad"><failure message="assert 1 == 2&#10;more">tb</failure></testcase>
  <testcase classname="tests.unit.test_b" name="test_setup"><error message="fixture died">tb</error></testcase>
</testsuite></testsuites>
"""


def test_summary__lists_failed_and_erroring_tests_after_the_table(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(JUNIT)

    result = parse_junit("sqlite", 1, report)
    text = summary([result])

    assert (result.passed, result.failed, result.errors) == (1, 1, 1)
    assert text.splitlines()[-2:] == [
        "sqlite: tests.unit.test_a::test_bad: assert 1 == 2",
        "sqlite: tests.unit.test_b::test_setup: fixture died",
    ]


def test_summary__has_no_failed_list_when_all_pass(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(
        JUNIT.replace('failures="1" errors="1"', 'failures="0" errors="0"')
        .replace("<failure", "<x")
        .replace("</failure>", "</x>")
        .replace("<error", "<y")
        .replace("</error>", "</y>")
    )

    assert "failed:" not in summary([parse_junit("postgresql", 0, report)])


def test_named_tests__options_alone_keep_the_split_and_paths_or_node_ids_do_not() -> None:
    assert not named_tests([])
    assert not named_tests(["-q", "-x", "-p", "no:cacheprovider"])
    assert named_tests(["-q", "tests/unit"])
    assert named_tests(["tests/unit/test_suite_report.py::test_named_tests"])
