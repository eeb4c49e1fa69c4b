"""Adapters for other launchers (submitit)."""
