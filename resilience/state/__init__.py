"""Training state that is not model or optimizer: RNG, data position, step counters."""
