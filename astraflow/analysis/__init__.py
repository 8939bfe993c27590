"""Post-hoc and live analysis of a run's shards (`astraflow inspect`, the reader API)."""
