"""Every environment variable the package reads or sets, by name (as submitit's ``JobEnvironment._env``).

Ours (set by the launcher or the batch templates, read by the ranks):

========================  ==========================================================================
``READY_DIR_ENV``         directory where each rank creates ``rank_<RANK>`` once its handlers are in
``STOP_FILE_ENV``         a file whose existence means "a stop was requested"
``TEMPLATE_ENV``          ``1`` when launched by one of our batch templates
``RUN_ID_ENV``            the run's id, kept across requeues and resubmissions
``PID_FILE_ENV``          where ``resilience run`` writes its ``launcher``/``rank`` pid lines
``SIGNAL_LEAD_S_ENV``     the batch script's Slurm signal lead time (seconds)
``LAUNCHER_PID_ENV``      the launcher's pid, in each rank's environment
``PROGRESS_FILE_ENV``     the file where a rank reports its progress to ``resilience run``'s watchdog
``RESTART_COUNT_ENV``     how many times ``resilience run`` restarted the ranks in this job (``0`` first)
``COLLECTIVE_TIMEOUT_ENV``  seconds that bound each collective on the library's own gloo groups
``RANK_MANIFEST_BLOCK_ENV``  ranks per rank manifest file (default 64; tests set 2 to get several blocks)
``DIRECT_IO_ENV``         ``0``: write large checkpoint files buffered instead of with ``O_DIRECT``
========================  ==========================================================================

``SLURM``: what :class:`resilience.slurm.job.SlurmJob` reads, each field's variables in order (the
first one set wins). ``TORCH``: the torch.distributed variables a launcher gives each rank.
``CONSOLIDATE``: the knobs of ``model/consolidate.sh``.
"""

READY_DIR_ENV = "RESILIENCE_READY_DIR"
"""Directory where each rank creates ``rank_<RANK>`` once its signal handlers are installed."""
STOP_FILE_ENV = "RESILIENCE_STOP_FILE"
"""A file whose existence means "a stop was requested" (launcher or batch script writes it)."""
TEMPLATE_ENV = "RESILIENCE_TEMPLATE"  # "1" when launched by one of our batch templates
RUN_ID_ENV = "RESILIENCE_RUN_ID"  # kept across requeues and resubmissions
PID_FILE_ENV = "RESILIENCE_PID_FILE"
SIGNAL_LEAD_S_ENV = "RESILIENCE_SIGNAL_LEAD_S"
LAUNCHER_PID_ENV = "RESILIENCE_LAUNCHER_PID"
PROGRESS_FILE_ENV = "RESILIENCE_PROGRESS_FILE"
"""Set by ``resilience run`` per rank: where :class:`resilience.progress.ProgressReporter` writes."""
RESTART_COUNT_ENV = "RESILIENCE_RESTART_COUNT"  # in-job restarts so far (torchrun: TORCHELASTIC_RESTART_COUNT)
COLLECTIVE_TIMEOUT_ENV = "RESILIENCE_COLLECTIVE_TIMEOUT_S"
"""Seconds bounding each collective on the library's own groups (the launcher derives it from its progress timeout)."""
RANK_MANIFEST_BLOCK_ENV = "RESILIENCE_RANK_MANIFEST_BLOCK"
"""Ranks per rank manifest file at a save (default ``layout.RANK_MANIFEST_BLOCK``); the manifest records it."""
DIRECT_IO_ENV = "RESILIENCE_DIRECT_IO"
"""``1`` (default) or ``0``: whether a local save writes its large tensor files with ``O_DIRECT``
(:mod:`resilience.checkpoint.storage.direct_file`)."""

SLURM = {
    "job_id": ("SLURM_JOB_ID", "SLURM_JOBID"),
    "array_job_id": ("SLURM_ARRAY_JOB_ID",),
    "array_task_id": ("SLURM_ARRAY_TASK_ID",),
    "restart_count": ("SLURM_RESTART_COUNT",),
    "step_id": ("SLURM_STEP_ID",),
    "node_list": ("SLURM_JOB_NODELIST", "SLURM_NODELIST"),
    "node_id": ("SLURM_NODEID",),
    "procid": ("SLURM_PROCID",),
}

TORCH = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "group_rank": "GROUP_RANK",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
}

CONSOLIDATE = {"nproc": "NPROC_PER_NODE", "num_threads": "NUM_THREADS", "cast_dtype": "CAST_DTYPE"}
