"""Slurm glue: the job's environment and the batch-script renderer.

:mod:`~resilience.slurm.job` reads the job (ids, end time, restart count) from the environment;
:mod:`~resilience.slurm.render` renders a batch script from the training's YAML, out of the shell
templates in ``resilience/slurm/templates/*.sh.in``.
"""
