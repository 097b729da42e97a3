"""Progress lines reach the ``lrkv`` logger whether or not a progress bar is shown, and long silences are
broken by a heartbeat."""

import logging
import re
import threading
from contextlib import contextmanager

import pytest

from lrkv_tasks import progress


class Lines(logging.Handler):
    """Collects the ``lrkv`` logger's messages; ``wait_for(text)`` blocks until one contains ``text``."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        with self.changed:
            self.messages.append(record.getMessage())
            self.changed.notify_all()

    def wait_for(self, text: str, timeout: float = 30.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: any(text in m for m in self.messages), timeout)


@pytest.fixture
def lines():
    logger = logging.getLogger("lrkv")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def bar():
    """A reporter like the CLI's bars on a terminal: records what it was shown."""
    shown = []

    @contextmanager
    def factory(description):
        yield lambda done, total: shown.append((description, done, total))

    progress.set_reporter(factory)
    yield shown
    progress.set_reporter(None)


def test_a_step_logs_its_start_quarters_and_end_even_with_a_bar_shown(lines, bar):
    with progress.step("collect gram", heartbeat=3600) as advance:
        for done in range(1, 9):
            advance(done, 8)
    assert bar == [("collect gram", done, 8) for done in range(1, 9)]
    assert lines.messages[0] == "collect gram: started"
    assert lines.messages[1:-1] == ["collect gram: 1/8", "collect gram: 2/8", "collect gram: 4/8",
                                    "collect gram: 6/8", "collect gram: 8/8"]  # fmt: skip
    assert lines.messages[-1].startswith("collect gram: done in ")
    assert re.fullmatch(r"collect gram: done in [0-9.]+ s, peak RSS [0-9.]+ GiB", lines.messages[-1])


def test_a_step_without_progress_is_not_silent(lines):
    with progress.step("plan ranks", heartbeat=0.05):
        assert lines.wait_for("plan ranks: still running after")  # the step itself waits for its heartbeat
    assert lines.messages[0] == "plan ranks: started" and lines.messages[-1].startswith("plan ranks: done in")


def test_a_failed_step_says_where_it_stopped(lines):
    with pytest.raises(RuntimeError), progress.step("evaluate", heartbeat=3600) as advance:
        advance(1, 4)
        raise RuntimeError("out of memory")
    assert lines.messages[-1].startswith("evaluate: stopped at 1/4 after ")
    assert lines.messages[-1].split(", peak RSS ")[0].endswith("(RuntimeError)")
