"""Browser tests: JupyterLab in Debian's headless Chromium, driven by playwright.

Artifacts (screenshots) go to ``$DISTNB_TEST_ARTIFACTS`` or, by default, a folder under
pytest's base temporary directory; their paths are listed at the end of the test output.
"""

from __future__ import annotations

import os

import pytest

ARTIFACTS = []


class Artifacts:
    """A folder for test artifacts; :meth:`path` names a file there and lists it in the summary."""

    def __init__(self, directory):
        self.dir = directory
        os.makedirs(directory, exist_ok=True)

    def path(self, name):
        path = os.path.join(self.dir, name)
        ARTIFACTS.append(path)
        return path


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    """Where screenshots are saved: ``$DISTNB_TEST_ARTIFACTS``, else under pytest's base temp dir."""
    return Artifacts(os.environ.get("DISTNB_TEST_ARTIFACTS")
                     or str(tmp_path_factory.getbasetemp() / "distnb-artifacts"))


def pytest_terminal_summary(terminalreporter):
    if ARTIFACTS:
        terminalreporter.write_sep("-", "distnb browser test artifacts")
        for path in ARTIFACTS:
            terminalreporter.write_line(path)
