"""Benchmarks of issue 7: our checkpointing and stop agreement against the disk, memory and the peers.

Run ``python -m bench`` (``make bench``); see ``bench/README.md``. Importing this package does
nothing; each module runs its measurements only when called.
"""
