"""Slurm: the heterogeneous job's per-task entry point, sbatch rendering, submission, elastic arrays."""
