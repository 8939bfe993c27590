"""Typed run configuration, its strict YAML loader, and the run directory.

Imports nothing else from the package; everything else may import it.
"""
