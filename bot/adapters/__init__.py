"""Technical parts the faces plug into the use cases: charts, metrics, the leader lock,
log formatting, the host agent's lease. May import `bot.app` and `bot.domain`."""
