"""EC2 refusals on demand: a botocore `before-call` hook that answers RunInstances itself.

moto has no fault injection, and a capacity error is exactly what real EC2 returns for a
GPU type on a busy day, so the fallback path needs a way to see one. The hook answers
with the same error shape EC2 sends; botocore turns it into the same `ClientError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from botocore.awsrequest import AWSResponse
from botocore.compat import HTTPHeaders


@dataclass
class RunInstancesFaults:
    """Refuses a RunInstances call when `refuse(instance_type, subnet_id)` names an error code."""

    refuse: Callable[[str, str], str | None]
    # Every attempt seen, refused or not: (instance type, subnet id).
    attempts: list[tuple[str, str]] = field(default_factory=list)

    def __call__(
        self, params: dict[str, Any], **_: Any
    ) -> tuple[AWSResponse, dict[str, Any]] | None:
        body = params.get("body") or {}
        itype = str(body.get("InstanceType", ""))
        subnet = str(body.get("SubnetId", ""))
        self.attempts.append((itype, subnet))
        code = self.refuse(itype, subnet)
        if code is None:
            return None
        http = AWSResponse("https://ec2.test/", 500, HTTPHeaders(), None)
        parsed = {
            "Error": {"Code": code, "Message": f"injected {code} for {itype} in {subnet}"},
            "ResponseMetadata": {"HTTPStatusCode": 500},
        }
        return http, parsed
