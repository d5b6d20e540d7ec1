"""Which peer URLs a heartbeat may register (docs/SECURITY.md, "Peers").

Restoring ranks connect to the URLs in restore plans, so a URL a heartbeat
names must not point anywhere its sender likes (a metadata service, another
tenant's host): it must name the IP address the heartbeat came from, or one in
the operator's allow-list of networks (``CKPTD_PEER_NETWORKS``, for NAT, proxies
and multi-homed hosts). Names are refused: checking one would need DNS, whose
answer can change between the check and the restore."""

from __future__ import annotations

import ipaddress
from urllib.parse import urlparse

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def _plain(addr: IPAddress) -> IPAddress:
    # "::ffff:10.0.0.1" (a v4 client on a dual-stack socket) is 10.0.0.1.
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def refuse_peer_url(url: str, source: str | None, networks: list[IPNetwork]) -> str | None:
    """Why ``url`` may not be registered by a heartbeat from ``source``; None if it may."""
    try:
        parsed = urlparse(url)
        host = parsed.hostname
        port = parsed.port
    except ValueError:
        return "peer_url does not parse"
    if parsed.scheme not in ("http", "https") or not host or port is None:
        return "peer_url must be http://ADDRESS:PORT"
    try:
        addr = _plain(ipaddress.ip_address(host))
    except ValueError:
        return "peer_url must name an IP address, not a host name"
    if source is not None:
        try:
            if addr == _plain(ipaddress.ip_address(source)):
                return None
        except ValueError:
            pass
    if any(addr in net for net in networks):
        return None
    return (f"peer_url {addr} is neither the heartbeat's source address nor in "
            "CKPTD_PEER_NETWORKS")
