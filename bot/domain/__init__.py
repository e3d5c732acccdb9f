"""The bottom layer: pure rules and data, no I/O, no database, no clock reads.

The /gpu vocabulary (typed requests and the grammar's usage text), durations, errors,
metering, estimates, best fit, the scheduler, read models and replies as data (views).
Imports nothing else of `bot`.
"""
