"""Which network addresses the server may fetch images from (SSRF guard).

By default only public unicast addresses: a client must not be able to make
the server reach its own loopback, the cloud metadata service (169.254.169.254),
or private networks behind it. Operators add exceptions by host name or CIDR.

The blocked ranges are listed here rather than taken from ipaddress.is_global,
whose answers changed between Python patch releases.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

BLOCKED_V4 = tuple(
    ipaddress.IPv4Network(n)
    for n in (
        "0.0.0.0/8",  # "this network", incl. the unspecified 0.0.0.0
        "10.0.0.0/8",  # private
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",  # loopback
        "169.254.0.0/16",  # link-local, incl. cloud metadata 169.254.169.254
        "172.16.0.0/12",  # private
        "192.0.0.0/24",  # IETF protocol assignments
        "192.0.2.0/24",  # documentation
        "192.88.99.0/24",  # 6to4 relay anycast
        "192.168.0.0/16",  # private
        "198.18.0.0/15",  # benchmarking
        "198.51.100.0/24",  # documentation
        "203.0.113.0/24",  # documentation
        "224.0.0.0/4",  # multicast
        "240.0.0.0/4",  # reserved, incl. broadcast 255.255.255.255
    )
)
BLOCKED_V6 = tuple(
    ipaddress.IPv6Network(n)
    for n in (
        "::/8",  # unspecified, loopback, IPv4-compatible (mapped ones are unwrapped first)
        "64:ff9b:1::/48",  # local-use NAT64
        "100::/64",  # discard
        "2001::/23",  # IETF protocol assignments, incl. Teredo
        "2001:db8::/32",  # documentation
        "fc00::/7",  # unique local
        "fe80::/10",  # link-local
        "fec0::/10",  # site-local (deprecated)
        "ff00::/8",  # multicast
    )
)
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


def embedded_ipv4(ip: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address stands for (mapped, 6to4, NAT64), if any:
    ::ffff:127.0.0.1 reaches loopback as surely as 127.0.0.1 does."""
    if ip.version != 6:
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public(ip: IPAddress) -> bool:
    """True for a public unicast address (after unwrapping embedded IPv4)."""
    inner = embedded_ipv4(ip)
    if inner is not None and not is_public(inner):
        return False
    if ip.version == 6 and ip.ipv4_mapped is not None:
        return True  # judged by its IPv4 address above
    blocked = BLOCKED_V4 if ip.version == 4 else BLOCKED_V6
    return not any(ip in net for net in blocked)


def normalize_host(host: str) -> str:
    # DNS names are case-insensitive and may end in a root dot.
    return host.strip().lower().rstrip(".").strip("[]")


@dataclass(frozen=True)
class FetchPolicy:
    """Public addresses always; beyond them only these hosts and networks."""

    allowed_hosts: frozenset[str] = frozenset()  # normalized names, exact match
    allowed_networks: tuple[IPNetwork, ...] = ()

    @classmethod
    def build(
        cls, hosts: frozenset[str] | set[str] = frozenset(), cidrs: frozenset[str] | set[str] = frozenset()
    ) -> FetchPolicy:
        networks = tuple(sorted((ipaddress.ip_network(c, strict=False) for c in cidrs), key=str))
        return cls(frozenset(normalize_host(h) for h in hosts), networks)

    def host_allowed(self, host: str) -> bool:
        """An allowed host may resolve to any address: the operator vouches for it."""
        return normalize_host(host) in self.allowed_hosts

    def address_allowed(self, ip: IPAddress) -> bool:
        candidates = [ip]
        inner = embedded_ipv4(ip)
        if inner is not None:
            candidates.append(inner)  # an allowed 127.0.0.0/8 also allows ::ffff:127.0.0.1
        for addr in candidates:
            if any(addr.version == net.version and addr in net for net in self.allowed_networks):
                return True
        return is_public(ip)
