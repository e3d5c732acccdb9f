"""What people and clocks talk to: the terminal, Slack, the CLI, the worker, `doctor`,
and `runtime`, the one composition root. The top layer: nothing imports it."""
