"""The admin's schedule add form, filled in, and a page's form as a browser posts it, for tests that post them."""

from __future__ import annotations

from html.parser import HTMLParser


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


class _FormFields(HTMLParser):
    """What a browser posts from a page's form: each named input, checked box, chosen option and text area."""

    def __init__(self) -> None:
        super().__init__()
        self.data: dict[str, str | list[str]] = {}
        self._select: str | None = None
        self._multiple = False
        self._first_option: str | None = None
        self._textarea: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        given = {key: value or "" for key, value in attrs}
        name = given.get("name")
        if tag == "input" and name and given.get("type") not in ("submit", "button", "file"):
            if given.get("type") not in ("checkbox", "radio") or "checked" in given:
                self.data[name] = given.get("value", "on" if given.get("type") == "checkbox" else "")
        elif tag == "select" and name:
            self._select, self._first_option, self._multiple = name, None, "multiple" in given
            if self._multiple:
                self.data[name] = []
        elif tag == "option" and self._select is not None:
            if self._first_option is None:
                self._first_option = given.get("value", "")
            chosen = self.data.get(self._select)
            if "selected" in given and isinstance(chosen, list):
                chosen.append(given.get("value", ""))
            elif "selected" in given:
                self.data[self._select] = given.get("value", "")
        elif tag == "textarea" and name:
            self._textarea = name
            self.data[name] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "select" and self._select is not None:
            self.data.setdefault(self._select, self._first_option or "")
            self._select = None
        elif tag == "textarea":
            self._textarea = None

    def handle_data(self, data: str) -> None:
        text = self.data.get(self._textarea or "")
        if self._textarea is not None and isinstance(text, str):
            self.data[self._textarea] = text + (data.removeprefix("\n") if not text else data)


def page_form(html: str) -> dict[str, str | list[str]]:
    """The fields a browser would post from the form on ``html`` (an admin change page), as they are shown."""
    parser = _FormFields()
    parser.feed(html)
    return parser.data
