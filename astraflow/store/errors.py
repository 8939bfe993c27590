"""Why the store cannot be used as it is: the dataflow rank stops rather than go on.

A `StoreStop` is not a bug and not bad input from a peer: it says that writing or recovering
would lose or corrupt data (a full disk, a shard found damaged while serving, a config that
no longer matches the stored data, a journal that vanished). The rank lets it out of its
loop and `astraflow dataflow` prints its message as one line and exits 1; the supervisor may
restart the rank, and whatever the restart can repair (a damaged shard is quarantined) it
repairs.
"""
from __future__ import annotations


class StoreStop(Exception):
    """The dataflow rank stops; the message is the one-line reason and what to do."""


class StoreRefused(StoreStop):
    """Stored data that is not damaged but that this rank must not use as it is: shards or
    journal lines of other policies than the config names, a newer schema, a shard this user
    cannot read or another process holds locked. Quarantine is for damaged files only: the
    rank stops and moves nothing, so that fixing the cause (restoring the config, the
    permissions) brings everything back."""
