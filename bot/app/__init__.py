"""The use cases: reservations, runs, the fleet, budgets, billing, the digest's numbers,
utilization, idle, the outbox; written over the ports in `bot.app.ports` and the
database sessions `db` hands out. Imports `bot.domain` only (never adapters or faces).
"""
