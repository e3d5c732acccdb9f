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
