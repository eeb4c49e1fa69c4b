"""Decisions over the set of checkpoints: retention, LOWEST_VAL, timelines, the world-size policy, the requeue-loop guard, the root's check."""
