"""Stopping at one step on every rank: signal handlers that only record, the rank handshake, the stop-step agreement, and the wall-time deadline."""
