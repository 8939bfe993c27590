"""HDF5 trajectory shards (single writer, SWMR readers) and the dataflow journal.

Imports nothing else from the package but `config`.
"""
