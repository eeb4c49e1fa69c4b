"""``resilience template slurm CONFIG.yaml [key=value ...]``: print a Slurm batch script rendered from a training YAML."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

from resilience.config import ConfigError, load_config
from resilience.exit_codes import ExitCode
from resilience.slurm.render import CONFIG_PLACEHOLDER, render_slurm

HELP = "print a Slurm batch script rendered from a training YAML (resilience template slurm CONFIG.yaml)"
#: Options and positionals may come in any order (``template slurm x.yaml -o f key=val``).
INTERMIXED = True


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``template`` command's arguments to ``parser`` (``resilience template slurm ...``)."""
    parser.add_argument("kind", choices=["slurm"], help="what to render: a Slurm batch script")
    parser.add_argument(
        "config",
        metavar="CONFIG.yaml",
        nargs="?",
        default=None,
        help="the training's YAML, with a slurm: section; without it the defaults are rendered (templates/slurm.sub)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="dotted overrides applied before rendering; those outside slurm.* are also appended "
        "to every rank's arguments, so the training reads the same values",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write the script here instead of stdout")
    return parser


def run(args: argparse.Namespace) -> int:
    """Render per parsed :func:`add_arguments` arguments; print it (or write ``--output``).

    Returns 0, or ``ExitCode.CONFIG_ERROR`` (2) with the reason on stderr for a bad
    configuration or an unwritable output file.
    """
    if args.config is not None and "=" in args.config and not Path(args.config).exists():
        args.overrides, args.config = [args.config, *args.overrides], None  # `template slurm slurm.nodes=2`
    try:
        config = load_config(args.config, args.overrides)  # no YAML: the defaults
        training = [o for o in args.overrides if not o.lstrip("-").startswith("slurm.")]
        if training:
            slurm = dataclasses.replace(config.slurm, script_args=[*config.slurm.script_args, *training])
            config = dataclasses.replace(config, slurm=slurm)
        text = render_slurm(config, config_path=args.config)
        if args.config is not None and not _has_slurm_section(args.config) and not any(o.lstrip("-").startswith("slurm.") for o in args.overrides):
            print(
                f"resilience template: {args.config} has no slurm: section; rendered with the defaults "
                f"(slurm.script: {config.slurm.script}, slurm.script_args: {config.slurm.script_args}, "
                f"slurm.nproc_per_node: {config.slurm.nproc_per_node}). Set them, e.g. script_args: [--config, {args.config}]",
                file=sys.stderr,
            )
        elif args.config is not None and not _passes_config(config.slurm.script_args, args.config):
            print(
                f"resilience template: slurm.script_args {config.slurm.script_args} does not pass {args.config} "
                f"to the training, so its checkpoint: and step_scheduler: settings (checkpoint_dir, "
                f'preemption_signal, ...) will not reach it; add e.g. script_args: [--config, "{CONFIG_PLACEHOLDER}"]',
                file=sys.stderr,
            )
        elif not Path(config.slurm.script).expanduser().exists():
            print(
                f"resilience template: slurm.script {config.slurm.script} does not exist here; the job runs it from the directory "
                "sbatch is called in (after slurm.setup): fine if it exists there on the cluster",
                file=sys.stderr,
            )
    except ConfigError as error:
        print(f"resilience template: {error}", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    if args.output:
        try:
            with open(args.output, "w") as handle:
                handle.write(text)
        except OSError as error:
            print(f"resilience template: cannot write {args.output}: {error}", file=sys.stderr)
            return int(ExitCode.CONFIG_ERROR)
    else:
        sys.stdout.write(text)
    return 0


def _passes_config(script_args: Sequence[str], path: str) -> bool:
    """Whether the ranks' arguments name the YAML: ``{config}``, or the path as given."""
    return any(CONFIG_PLACEHOLDER in str(arg) or str(arg) == path or str(arg).endswith("=" + path) for arg in script_args)


def _has_slurm_section(path: str) -> bool:
    """Whether the YAML at ``path`` (already loaded once by :func:`load_config`) has a ``slurm`` key."""
    import yaml

    try:
        return "slurm" in (yaml.safe_load(Path(path).read_text()) or {})
    except (OSError, ValueError, TypeError, yaml.YAMLError):
        return True  # load_config read it: nothing to warn about here


def main(argv: Sequence[str] | None = None) -> int:
    """``resilience template`` on its own: parse ``argv`` (default ``sys.argv[1:]``) and :func:`run`."""
    parser = add_arguments(argparse.ArgumentParser(prog="resilience template", description=HELP))
    return run(parser.parse_args(argv))
