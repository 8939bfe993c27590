"""Command-line entry points: `astraflow` and `astraflow-launch`."""
