"""Decisions over the set of checkpoints: retention, LOWEST_VAL, timelines, the world-size policy and the requeue-loop guard."""
