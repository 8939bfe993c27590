"""Benchmarks that print JSON (`astraflow bench ...`)."""
