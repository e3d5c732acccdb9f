"""Doubles for what cannot run here: today only the Slack Web API (see DESIGN.md's table)."""

from tests.fakes.slack_api import (
    RESPONSE_URL_ENDPOINT,
    UPLOAD_ENDPOINT,
    Call,
    FakeSlack,
    FakeUser,
    Message,
    ResponsePost,
    SlackSpecMissingError,
    UploadedFile,
)

__all__ = [
    "RESPONSE_URL_ENDPOINT",
    "UPLOAD_ENDPOINT",
    "Call",
    "FakeSlack",
    "FakeUser",
    "Message",
    "ResponsePost",
    "SlackSpecMissingError",
    "UploadedFile",
]
