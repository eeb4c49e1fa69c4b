"""The exit-code contract between a training process, its launcher and the batch script.

Every rank of a run exits with the same code, so a launcher (ours, ``srun``, ``torchrun``)
and the Slurm templates can act on any one of them:

========================  ====  ==========================================================
code                      int   what the batch script does
========================  ====  ==========================================================
``DONE``                  0     training finished; stop, no requeue
``FAILED``                1     an exception; no requeue (a crash loop helps nobody)
``CONFIG_ERROR``          2     bad configuration or arguments, raised before training
``PREEMPTED``             75    a stop was agreed and a checkpoint published: requeue me
``NO_PROGRESS``           76    restarts keep producing no new checkpoint: do not requeue
``RESTART_LIMIT``         77    the batch script's restart limit is reached: do not requeue
========================  ====  ==========================================================

``resilience run`` (one node's launcher) exits with the ranks' common code when they agree on one
of these, or when it received a signal itself. When a start fails instead (a rank stalls past
``--progress-timeout``, is killed by a signal, or exits with an error while others run), it ends
every local rank and, up to ``--max-restarts`` times, starts them again from ``LATEST``; with no
restart left it exits:

=================================================  ============================================
the failure                                        launcher's code
=================================================  ============================================
a stall, or a loop's rank killed by a signal       ``PREEMPTED`` (75): requeue, resume elsewhere
an error exit, ``--max-restarts`` >= 1             ``PREEMPTED`` (75)
an error exit, ``--max-restarts 0``                the ranks' combined code (``FAILED``, 1)
a kill without the loop, ``--max-restarts 0``      the ranks' combined code
the restarted ranks exit ``NO_PROGRESS``           ``NO_PROGRESS`` (76): the restarts saved nothing
another node's failure (``--fault-file``)           75 for its stall or kill, else as above
a local error exit right after another node's kill  ``PREEMPTED`` (75): the kill was the cause
another node will not restart (barrier)             ``PREEMPTED`` (75)
=================================================  ============================================

75 is ``EX_TEMPFAIL`` from BSD ``sysexits.h`` ("temporary failure; the user is invited to
retry"), the conventional code for "try again later". Codes above 128 are avoided because
shells report death by signal N as 128+N.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes of a ``resilience`` run (see the module docstring for the table)."""

    DONE = 0
    FAILED = 1
    CONFIG_ERROR = 2
    PREEMPTED = 75
    NO_PROGRESS = 76
    RESTART_LIMIT = 77

    @property
    def requeue(self) -> bool:
        """True only for ``PREEMPTED``: the one code after which a job should be requeued."""
        return self is ExitCode.PREEMPTED
