"""A worker pass that stops dead right after EC2 answered a launch, for the crash test.

It builds the runtime exactly as `gpubot worker` does (provider, settings and EC2 from the
environment; AWS_ENDPOINT_URL points boto3 at moto), then runs one fleet pass whose
`after_launch` seam writes the new instance id to a file and sleeps: the test kills
this process with SIGKILL there, between the cloud's answer and the bot's commit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bot.app.config import load_settings
from bot.faces.runtime import build_runtime
from provisioning.base import Instance


def main(marker: str) -> None:
    runtime = build_runtime(load_settings())
    assert runtime.fleet is not None, "GPUBOT_PROVIDER=aws expected"

    def freeze(inst: Instance) -> None:
        Path(marker).write_text(inst.instance_id or "")
        time.sleep(120)  # the test's SIGKILL lands here

    runtime.fleet.after_launch = freeze
    runtime.fleet.cycle()
    print("the pass finished without launching", file=sys.stderr)
    sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1])
