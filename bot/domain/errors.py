"""The split between failures a user caused and failures we caused.

A `UserError` is expected (bad input, nothing free, not yours): its text is the
whole message the user sees. Anything else is our bug or an outage; the user sees
only a short reference id, and the log has the traceback under that id, so the
user can quote it and an operator can find it.
"""

from __future__ import annotations

import logging
import secrets

log = logging.getLogger("gpubot")


class UserError(Exception):
    """An expected failure; `str(err)` is shown to the user verbatim."""

    def __init__(self, reason: str, usage: str | None = None) -> None:
        self.reason = reason
        self.usage = usage
        super().__init__(self.text)

    @property
    def text(self) -> str:
        if self.usage:
            return f"{self.reason}\nUsage: {self.usage}"
        return self.reason


def new_ref() -> str:
    """A short id an operator can grep for; 8 hex characters is plenty per day of logs."""
    return secrets.token_hex(4)


def failure_message(exc: BaseException, context: str) -> str:
    """Logs an unexpected exception with a reference and returns what the user may see."""
    ref = new_ref()
    log.error("ref=%s %s failed", ref, context, exc_info=exc)
    return (
        f"Sorry, that failed on our side (ref {ref}); an admin can find the details under that ref."
    )
