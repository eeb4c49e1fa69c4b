"""The ``resilience`` command line: one module per subcommand, dispatched by :func:`main`.

Every command module in this package declares the same three things: ``HELP`` (its one-line
description), ``add_arguments(parser)`` (its options) and ``run(args) -> int`` (its exit code);
``INTERMIXED = True`` where positionals may come after options. Adding a subcommand is one module
and one entry in :data:`COMMANDS`. Command modules import torch only inside ``run``, so
``resilience run`` has its signal handlers in place within milliseconds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from types import ModuleType

from resilience.cli import advise, consolidate, run, status, template, verify

#: Subcommand name -> its module, in ``--help`` order.
COMMANDS: dict[str, ModuleType] = {
    "run": run,
    "consolidate": consolidate,
    "template": template,
    "status": status,
    "verify": verify,
    "advise": advise,
}


def build_parser() -> argparse.ArgumentParser:
    """The ``resilience`` parser with every subcommand of :data:`COMMANDS` registered."""
    parser = argparse.ArgumentParser(
        prog="resilience",
        description="Slurm-aware fault tolerance and preemption handling for PyTorch training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        sub = subparsers.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub)
        sub.set_defaults(handler=module.run, intermixed_parser=sub if getattr(module, "INTERMIXED", False) else None)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code.

    Always returns an ``int`` (usable as ``sys.exit(main())``): argparse's own exits
    (``--help`` -> 0, a usage error -> 2) are turned into return values.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, _ = parser.parse_known_args(argv)
        sub = getattr(args, "intermixed_parser", None)
        if sub is not None:  # options and positionals in any order; argv[0] is the command
            command = args.command
            args = sub.parse_intermixed_args(argv[argv.index(command) + 1 :])
            args.command = command
        else:
            args = parser.parse_args(argv)
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
