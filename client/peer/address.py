"""Where a rank's peer chunk server listens and the address it advertises, so that
a replacement rank on another host can reach it (every request still needs the
job's peer token).

By default it listens on every interface and advertises this host's address on
the route to the ckptd server: the source address of its heartbeats, which the
server accepts as the peer URL's host (``server/peering.py``) and which hosts of
the same network reach. ``CKPTD_PEER_INTERFACE`` names the interface peers reach
(a second network for training traffic, as ``NCCL_SOCKET_IFNAME`` does): the
server listens and advertises there; ``CKPTD_PEER_ADVERTISE_HOST`` names the
address outright; ``CKPTD_PEER_HOST`` (or ``peer_host=``) picks what it binds."""

from __future__ import annotations

import fcntl
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ckptd import knobs
from ckptd.errors import InvalidRequest

WILDCARDS = ("", "0.0.0.0", "::")

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """What the peer server binds (``bind``) and the host it advertises to peers."""

    bind: str
    advertise: str
    # No route was found toward the server (a name that does not resolve, no
    # default route): ``advertise`` is then 127.0.0.1, which other hosts cannot reach.
    unrouted: bool = False


def peer_address(host: str | None = None, *, toward: str | None = None,
                 interface: str | None = None, advertise: str | None = None) -> PeerAddress:
    """Where the peer server of a rank whose ckptd server is ``toward`` (a URL, or
    several comma-separated) listens and what it advertises: ``advertise``, else
    ``CKPTD_PEER_ADVERTISE_HOST``, else the address of ``interface`` (default
    ``CKPTD_PEER_INTERFACE``), else ``host`` when it names one address, else this
    host's address on the route to ``toward``. It binds ``host`` (default
    ``CKPTD_PEER_HOST``), else the named interface's address, else every interface
    (of the advertised address's family)."""
    host = host if host is not None else knobs.peer_host()
    interface = interface if interface is not None else knobs.peer_interface()
    advertise = advertise or knobs.peer_advertise_host()
    named = interface_address(interface) if interface else None
    unrouted = False
    if advertise is None:
        if named is not None:
            advertise = named
        elif host is not None and host not in WILDCARDS:
            advertise = host
        else:
            advertise = route(toward)
            unrouted = advertise is None
            advertise = advertise or "127.0.0.1"
    if host is None:
        host = named if named is not None else ("::" if ":" in advertise else "0.0.0.0")
    return PeerAddress(bind=host, advertise=advertise, unrouted=unrouted)


def route_address(toward: str | None = None) -> str:
    """This host's address on the route toward ``toward`` (a URL or host; default:
    the default route), as peers and the server see it: never ``localhost``; 127.0.0.1
    where there is no such route. Of several comma-separated URLs (replicas), the first."""
    return route(toward) or "127.0.0.1"


def route(toward: str | None = None) -> str | None:
    """``route_address``, or None where no route is found (``toward``'s host does not
    resolve, or no default route). A UDP ``connect`` sends nothing; it only asks the
    kernel which source it would use. ``ValueError`` for a URL urllib cannot parse."""
    toward = toward.split(",")[0] if toward else None
    host = urlparse(toward).hostname if toward and "//" in toward else toward
    target = host or "10.255.255.255"
    try:
        infos = socket.getaddrinfo(target, 9, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return None


def interface_address(name: str) -> str:
    """The address of network interface ``name``: its IPv4 address, else its first
    global IPv6 one. ``InvalidRequest`` naming the interface when it has neither."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        pass
    try:
        lines = Path("/proc/net/if_inet6").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:  # address, index, prefix length, scope, flags, name
        fields = line.split()
        if len(fields) == 6 and fields[5] == name and fields[3] == "00":
            raw = bytes.fromhex(fields[0])
            return socket.inet_ntop(socket.AF_INET6, raw)
    have = ", ".join(n for _, n in socket.if_nameindex())
    raise InvalidRequest(f"network interface {name!r} (CKPTD_PEER_INTERFACE) has no address "
                         f"here; this host has: {have}")
