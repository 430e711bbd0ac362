"""An httpx client that connects only to addresses the FetchPolicy allows.

The check sits in the network backend, at the moment a TCP connection is
opened: the host name is resolved once (asynchronously), every address it
resolves to is checked, and the connection goes to one of those very
addresses. So each redirect hop is checked when it connects, and a DNS name
that answers "public" to a first lookup and "127.0.0.1" to a second
(rebinding) cannot slip through: there is no second lookup. The URL keeps
its host name, so the Host header, TLS SNI and certificate checks are the
usual ones.

Proxies from the environment are ignored (trust_env=False): through a proxy
we could not see, let alone check, the address finally reached.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable

import httpcore
import httpx

from pipeline.media.address_policy import FetchPolicy


class FetchRefused(Exception):
    """The URL's host is, or resolves to, an address the policy does not allow."""


async def resolve_allowed(host: str, port: int, policy: FetchPolicy, timeout_s: float) -> list[str]:
    """The addresses of `host` to connect to, or FetchRefused.

    If any address of a name is disallowed, the name is refused as a whole:
    a mixed answer is what a rebinding attacker would send.
    """
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise httpcore.ConnectError("could not resolve the host name") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise httpcore.ConnectError("could not resolve the host name")
    if not policy.host_allowed(host):
        for addr in addresses:
            if not policy.address_allowed(ipaddress.ip_address(addr)):
                raise FetchRefused(host)
    return addresses


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore network backend: resolve, check, connect to the checked address."""

    def __init__(self, policy: FetchPolicy, resolve_timeout_s: float):
        self.policy = policy
        self.resolve_timeout_s = resolve_timeout_s
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await resolve_allowed(host, port, self.policy, timeout or self.resolve_timeout_s)
        error: Exception | None = None
        for addr in addresses:  # e.g. an IPv6 answer on a host without IPv6
            try:
                return await self.inner.connect_tcp(addr, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as err:
                error = err
        raise error

    async def connect_unix_socket(self, *args, **kwargs):
        raise FetchRefused("unix sockets are never fetched from")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class GuardedClient(httpx.AsyncClient):
    """An AsyncClient whose every connection goes through GuardedBackend."""

    def __init__(self, policy: FetchPolicy, timeout_s: float):
        transport = httpx.AsyncHTTPTransport(trust_env=False)
        # httpx does not expose the network backend; rebuild its pool with ours
        # (same settings as the default transport's pool).
        transport._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False),
            max_connections=100,
            max_keepalive_connections=20,
            keepalive_expiry=5.0,
            network_backend=GuardedBackend(policy, timeout_s),
        )
        super().__init__(transport=transport, trust_env=False, follow_redirects=False, timeout=timeout_s)
        self.policy = policy
