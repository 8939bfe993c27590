"""Which address the dataflow rank binds and publishes."""
from __future__ import annotations

import pytest

from astraflow.config.loader import ConfigError
from astraflow.dataflow.address import cluster_address, resolve


def test_loopback_only_for_local_runs():
    assert resolve("loopback", local=True) == "127.0.0.1"
    assert resolve("auto", local=True) == "127.0.0.1"
    with pytest.raises(ConfigError, match="resolves to loopback 127.0.0.1.*only for local runs"):
        resolve("loopback", local=False)
    with pytest.raises(ConfigError, match="only for local runs"):
        resolve("lo", local=False)


def test_auto_picks_a_cluster_address_under_slurm():
    addr = cluster_address()
    if addr is None:  # a host with only loopback: auto must refuse rather than publish it
        with pytest.raises(ConfigError, match="no non-loopback IPv4 address"):
            resolve("auto", local=False)
    else:
        assert resolve("auto", local=False) == addr and not addr.startswith("127.")


def test_interface_names_and_literals():
    assert resolve("lo", local=True) == "127.0.0.1"
    assert resolve("10.1.2.3", local=False) == "10.1.2.3"
    with pytest.raises(ConfigError, match=r"no such interface.*interfaces here: \[.*'lo'"):
        resolve("ib9", local=True)
