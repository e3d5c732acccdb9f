"""`bot.app.access.Membership` on Slack: a user group's members from `usergroups.users.list`
(scope `usergroups:read`). Any failure, Slack's or the network's, is a `MembershipError`,
which `bot.app.access.RunGate` answers as a plain refusal."""

from __future__ import annotations

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackClientError

from bot.app.access import MembershipError


class SlackMembership:
    def __init__(self, client: WebClient) -> None:
        self._client = client

    def members(self, group_id: str) -> frozenset[str]:
        try:
            resp = self._client.usergroups_users_list(usergroup=group_id)
        except SlackApiError as exc:
            raise MembershipError(f"Slack answered {exc.response.get('error')!r}") from None
        except (SlackClientError, OSError, ValueError) as exc:  # refused, timed out, garbled
            raise MembershipError(f"Slack unreachable ({type(exc).__name__})") from None
        users = resp.get("users")
        if not isinstance(users, list):
            raise MembershipError("Slack's answer had no user list")
        return frozenset(str(u) for u in users)
