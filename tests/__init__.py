"""The test suite."""
# A regular package (not a namespace one), so `python -m tests.suite` and the
# `-p tests.support.env_defaults` plugin can never resolve to some other `tests`.
