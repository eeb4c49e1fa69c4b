"""The ``resilience`` command line: one subcommand per job, dispatched by :func:`main`.

Adding a subcommand takes one handler function ``_cmd_<name>(args) -> int`` and one
``_add(subparsers, "<name>", ...)`` line in :func:`build_parser`, whose ``add_arguments``
callable (usually living next to the feature, like :func:`resilience.launch.add_arguments`)
declares the options.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from resilience import advise_cli, consolidate_cli, launch, status_cli, templates, verify_cli

Handler = Callable[[argparse.Namespace], int]


def _cmd_run(args: argparse.Namespace) -> int:
    return launch.run(args)


def _add(
    subparsers: argparse._SubParsersAction,
    name: str,
    add_arguments: Callable[[argparse.ArgumentParser], object],
    handler: Handler,
    help: str,
    *,
    intermixed: bool = False,
) -> None:
    """Register subcommand ``name``. ``intermixed``: its positionals may come after its options
    (``template slurm x.yaml -o f key=val``), parsed with ``parse_intermixed_args``."""
    parser = subparsers.add_parser(name, help=help, description=help)
    add_arguments(parser)
    parser.set_defaults(handler=handler, intermixed_parser=parser if intermixed else None)


def build_parser() -> argparse.ArgumentParser:
    """The ``resilience`` parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="resilience",
        description="Slurm-aware fault tolerance and preemption handling for PyTorch training.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add(
        subparsers,
        "run",
        launch.add_arguments,
        _cmd_run,
        help="start N local ranks (torchrun-like), forward USR1/USR2/TERM/INT to them and "
        "exit with their combined code",
    )
    _add(
        subparsers, "consolidate", consolidate_cli.add_arguments, consolidate_cli.run,
        help="write model/consolidated/ (a Hugging Face bundle) from a checkpoint's sharded safetensors; what model/consolidate.sh runs",
    )
    _add(
        subparsers, "template", templates.add_arguments, templates.run,
        help="print a Slurm batch script rendered from a training YAML (resilience template slurm CONFIG.yaml)", intermixed=True,
    )
    _add(
        subparsers, "status", status_cli.add_status_arguments, status_cli.run_status,
        help="a table of the checkpoints under CHECKPOINT_DIR (complete, incomplete, corrupt, marked bad; pointers; metric) "
        "and which one a resume would pick and why; never writes",
    )
    _add(
        subparsers, "verify", verify_cli.add_verify_arguments, verify_cli.run_verify,
        help="check every file's size and digest against the manifest of a checkpoint, or of every checkpoint under a root; exit 1 on any failure",
    )
    _add(
        subparsers, "advise", advise_cli.add_advise_arguments, advise_cli.run_advise,
        help="recommend #SBATCH --signal=B:USR1@N from the step and save times recorded in the checkpoints' manifests",
    )
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
            args = sub.parse_intermixed_args(argv[argv.index(command) + 1:])
            args.command = command
        else:
            args = parser.parse_args(argv)
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())
