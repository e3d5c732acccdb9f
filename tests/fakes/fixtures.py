"""The `fake_slack` fixture. Import it into a conftest (or a test module) to use it:

from tests.fakes.fixtures import fake_slack  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fakes.slack_api import FakeSlack, SlackSpecMissingError

# Proxy variables would send slack_sdk's loopback calls elsewhere (WebClient reads them itself).
_PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy")


@pytest.fixture
def fake_slack(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeSlack]:
    """A started FakeSlack; the test fails at teardown if any call broke Slack's spec.

    A test that provokes a violation on purpose declares it with `fake.expect_violation(regex)`
    (then it also fails if the violation does not happen) or consumes it with
    `fake.take_violations()`. SLACK_API_URL and SLACK_BOT_TOKEN point at the fake, so code that
    reads its settings from the environment talks to it without further wiring.
    """
    try:
        fake = FakeSlack()
    except SlackSpecMissingError as exc:
        pytest.skip(str(exc))
    for var in _PROXY_VARS:
        monkeypatch.delenv(var, raising=False)
    with fake:
        monkeypatch.setenv("SLACK_API_URL", fake.url)
        monkeypatch.setenv("SLACK_BOT_TOKEN", fake.bot_token)
        yield fake
    problems = fake.problems()
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
