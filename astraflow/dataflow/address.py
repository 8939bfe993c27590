"""Which address the dataflow rank binds and publishes.

`dataflow.interface`:
- "loopback": 127.0.0.1 (single-machine runs only);
- "auto": loopback for a local run, the node's cluster address under Slurm (the address the
  host name resolves to, or else the first non-loopback interface);
- an interface name ("ib0", "hsn0", "eth0"): that interface's IPv4 address (multi-homed
  nodes: pick the high-speed network);
- a literal IPv4 address.
A loopback address is never published for a run that is not local: peers on other nodes
could not reach it.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from astraflow.config.loader import ConfigError

_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        return None
    finally:
        s.close()


def _is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


def cluster_address() -> str | None:
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not _is_loopback(addr):
            return addr
    except OSError:
        pass
    for _, name in socket.if_nameindex():
        addr = interface_address(name)
        if addr and not _is_loopback(addr):
            return addr
    return None


def is_local_run() -> bool:
    return "SLURM_JOB_ID" not in os.environ


def resolve(interface: str, local: bool | None = None) -> str:
    local = is_local_run() if local is None else local
    if interface == "loopback":
        addr = "127.0.0.1"
    elif interface == "auto":
        addr = "127.0.0.1" if local else cluster_address()
        if addr is None:
            raise ConfigError("dataflow.interface=auto: this node has no non-loopback IPv4 address; "
                              "name an interface (e.g. ib0) or an address")
    else:
        try:
            addr = str(ipaddress.IPv4Address(interface))
        except ValueError:
            addr = interface_address(interface)
            if addr is None:
                names = [n for _, n in socket.if_nameindex()]
                raise ConfigError(f"dataflow.interface={interface!r}: no such interface with an IPv4 "
                                  f"address; interfaces here: {names}") from None
    if not local and _is_loopback(addr):
        raise ConfigError(f"dataflow.interface={interface!r} resolves to loopback {addr}, which peers on "
                          "other nodes cannot reach; loopback is only for local runs")
    return addr
