"""Owned GPUs first, the cloud offered with its price when the wait grows long
(bot.app.burst.offers); the offers' states (bot.app.burst.state)."""
