"""The Slack face: Bolt app, Block Kit rendering, HTTP and Socket Mode serving, the
outbox notifier, App Home, the run modal and the app manifest."""
