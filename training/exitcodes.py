"""Exit codes of `python -m training.runner`: the one place the bot learns how a run ended.

The bot reads the process's exit status over SSH before (or instead of) the status file,
so each outcome that calls for a different reaction has its own code:

====  ===================  ==========================================================
code  name                 what the bot should do
====  ===================  ==========================================================
0     EXIT_DONE            the run finished; the status file holds the summary
1     EXIT_FAILED          the run failed (an exception, a user script's error, a loss
                           that went NaN for good); do not retry blindly
2     EXIT_USAGE           bad command line (argparse's own code); a user error
75    EXIT_PREEMPTED       stopped on SIGTERM (spot interruption notice, cancel) after
                           writing a checkpoint; start it again with the same
                           ``--checkpoint-dir`` to resume (75 is sysexits' EX_TEMPFAIL)
76    EXIT_TIME_LIMIT      reached ``--max-minutes``; checkpointed, resumable the same way
77    EXIT_OOM             out of GPU memory even at the smallest batch; retry on a
                           bigger GPU or with a smaller ``--batch-size``
====  ===================  ==========================================================

A user command run through the runner keeps its own exit status, so a script that saves
its own checkpoint on SIGTERM can exit 75 to say "resume me". A child killed by signal
N is reported as 128 + N, the shell's convention.
"""

from __future__ import annotations

EXIT_DONE = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_PREEMPTED = 75
EXIT_TIME_LIMIT = 76
EXIT_OOM = 77

#: Codes after which starting the same command again continues the run.
RESUMABLE = frozenset({EXIT_PREEMPTED, EXIT_TIME_LIMIT})

_WORDS = {
    EXIT_DONE: "exit status 0, done",
    EXIT_FAILED: "exit status 1: the run raised an error or its loss went NaN for good",
    EXIT_USAGE: "exit status 2: a bad command line",
    EXIT_PREEMPTED: "exit status 75: stopped by SIGTERM after a checkpoint",
    EXIT_TIME_LIMIT: "exit status 76: its time limit was reached after a checkpoint",
    EXIT_OOM: "exit status 77: out of GPU memory even at the smallest batch",
    126: "exit status 126: the command is not executable",
    127: "exit status 127: command not found",
}
_SIGNALS = {
    2: "SIGINT (interrupted)",
    6: "SIGABRT (aborted, often a crash in native code)",
    9: "SIGKILL (killed, often by the kernel's out-of-memory killer: host RAM)",
    11: "SIGSEGV (a segmentation fault in native code)",
    15: "SIGTERM (asked to stop)",
}


def describe_exit(code: int | None) -> str:
    """An exit status in words, for the owner's DM: ``exit 137: killed by SIGKILL ...``."""
    if code is None:
        return "no exit status (the process vanished)"
    if code in _WORDS:
        return _WORDS[code]
    if 128 < code < 160:
        signal = _SIGNALS.get(code - 128, f"signal {code - 128}")
        return f"exit status {code}: killed by {signal}"
    return f"exit status {code}"
