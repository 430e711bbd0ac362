"""SSRF guard for remote images: which addresses may be fetched, checked after
DNS resolution and on every redirect hop, against real HTTP servers on loopback.

Loopback stands in for "internal": it is refused by default exactly like the
metadata service or a private network, so a server on 127.0.0.1 must be
unreachable until its address or name is explicitly allowed.
"""

from __future__ import annotations

import asyncio
import io
import ipaddress
import socket
import time

import httpx
import pytest
from PIL import Image
from pydantic import ValidationError

from pipeline.errors import IrisError
from pipeline.media.address_policy import FetchPolicy, is_public
from pipeline.media.fetch import fetch_client, load_media_bytes
from pipeline.media.limits import MediaLimits
from tests.support.http_server import QuietHandler, http_server


def _png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, "PNG")
    return buf.getvalue()


PNG = _png()


# --------------------------------------------------------------------------- address policy


@pytest.mark.parametrize(
    "addr",
    [
        "127.0.0.1",
        "127.255.0.9",
        "0.0.0.0",
        "10.0.0.1",
        "172.16.5.4",
        "172.31.255.255",
        "192.168.1.1",
        "169.254.169.254",
        "169.254.0.1",
        "100.64.0.1",
        "100.127.255.254",
        "224.0.0.1",
        "239.1.2.3",
        "240.0.0.1",
        "255.255.255.255",
        "192.0.2.1",
        "198.18.0.1",
        "::",
        "::1",
        "fe80::1",
        "febf::1",
        "fc00::1",
        "fd12:3456::1",
        "ff02::1",
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "::ffff:10.0.0.1",  # IPv4-mapped
        "::127.0.0.1",  # IPv4-compatible (deprecated)
        "2002:7f00:1::1",
        "2002:a9fe:a9fe::1",  # 6to4 of loopback / metadata
        "64:ff9b::7f00:1",
        "64:ff9b::a9fe:a9fe",  # NAT64 of loopback / metadata
        "2001:db8::1",
        "2001::1",  # documentation, Teredo
    ],
)
def test_internal_addresses_are_not_public(addr):
    assert not is_public(ipaddress.ip_address(addr))
    assert not FetchPolicy().address_allowed(ipaddress.ip_address(addr))


@pytest.mark.parametrize(
    "addr",
    [
        "8.8.8.8",
        "1.1.1.1",
        "93.184.216.34",
        "172.15.255.255",
        "172.32.0.1",
        "100.63.255.255",
        "100.128.0.1",
        "169.253.255.255",
        "2606:4700:4700::1111",
        "2a00:1450:4001::200e",
        "::ffff:8.8.8.8",
        "2002:808:808::1",
    ],
)
def test_public_addresses_are_allowed(addr):
    assert FetchPolicy().address_allowed(ipaddress.ip_address(addr))


def test_policy_exceptions():
    policy = FetchPolicy.build(hosts={"Images.Internal."}, cidrs={"10.1.2.0/24", "127.0.0.1/32"})
    allowed = policy.address_allowed
    assert allowed(ipaddress.ip_address("10.1.2.200"))
    assert not allowed(ipaddress.ip_address("10.1.3.1"))
    assert allowed(ipaddress.ip_address("127.0.0.1"))
    assert allowed(ipaddress.ip_address("::ffff:127.0.0.1"))  # same address, IPv6 spelling
    assert not allowed(ipaddress.ip_address("127.0.0.2"))
    assert not allowed(ipaddress.ip_address("::1"))
    assert policy.host_allowed("images.internal") and policy.host_allowed("IMAGES.INTERNAL.")
    assert not policy.host_allowed("evil.images.internal") and not policy.host_allowed("internal")


def test_media_limits_validate_and_normalize_allow_lists():
    limits = MediaLimits(allowed_fetch_cidrs={"10.1.2.3/8", " fd00::/8"}, allowed_fetch_hosts={"Img.Example."})
    assert limits.allowed_fetch_cidrs == {"10.0.0.0/8", "fd00::/8"}
    assert limits.allowed_fetch_hosts == {"img.example"}
    assert MediaLimits().fetch_policy() == FetchPolicy()  # default: public only
    for bad in (
        {"allowed_fetch_cidrs": {"10.0.0.0/33"}},
        {"allowed_fetch_cidrs": {"localhost"}},
        {"allowed_fetch_hosts": {""}},
    ):
        with pytest.raises(ValidationError) as ei:
            MediaLimits(**bad)
        assert next(iter(bad)) in str(ei.value)


# --------------------------------------------------------------------------- real servers on loopback


class _Handler(QuietHandler):
    def do_GET(self):
        self.server.hits.append((self.path, self.headers.get("Host")))
        if self.path == "/ok.png":
            self._send(200, PNG, [("Content-Type", "image/png")])
        elif self.path.startswith("/to?"):  # /to?<absolute URL>: redirect anywhere
            self._send(302, headers=[("Location", self.path[4:])])
        elif self.path == "/secret":
            self._send(500, b"SECRET-BODY db password=hunter2", reason="SECRET-REASON")
        elif self.path == "/forbidden":
            self._send(403, b"SECRET-BODY", reason="SECRET-REASON")
        else:
            self._send(404, b"SECRET-BODY")


@pytest.fixture(scope="module")
def servers():
    """Two servers: one on 127.0.0.1 (the one tests allow) and one on 127.0.0.2 (never allowed)."""
    with http_server(_Handler, "127.0.0.1") as a, http_server(_Handler, "127.0.0.2") as b:
        a.hits, b.hits = [], []
        yield a, b


@pytest.fixture
def srv(servers):
    for s in servers:
        s.hits.clear()
    a, b = servers
    return a, b, a.server_address[1], b.server_address[1]


async def refused(url: str, limits: MediaLimits, client=None) -> IrisError:
    with pytest.raises(IrisError) as ei:
        await load_media_bytes(url, limits, client)
    err = ei.value
    assert err.status_code == 400 and err.code == "image_fetch_failed", err
    assert set(err.to_dict()["error"]) >= {"message", "type", "param", "code"}
    return err


def _is_refusal(err: IrisError) -> bool:
    return "not allowed" in err.message


async def test_loopback_refused_by_default_under_every_spelling(srv):
    a, _, port, _ = srv
    urls = [
        f"http://127.0.0.1:{port}/ok.png",
        f"http://localhost:{port}/ok.png",
        f"http://LocalHost:{port}/ok.png",
        f"http://127.1:{port}/ok.png",
        f"http://2130706433:{port}/ok.png",
        f"http://0x7f000001:{port}/ok.png",
        f"http://017700000001:{port}/ok.png",
        f"http://[::ffff:127.0.0.1]:{port}/ok.png",
        f"http://[::1]:{port}/ok.png",
        f"http://0.0.0.0:{port}/ok.png",
        f"https://127.0.0.1:{port}/ok.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[fd00::1]/x.png",
        "http://10.0.0.1/x.png",
        "http://192.168.0.1/x.png",
        "http://100.64.0.1/x.png",
    ]
    for url in urls:
        err = await refused(url, MediaLimits(fetch_timeout_s=2))
        assert _is_refusal(err), (url, err)
    assert a.hits == []  # nothing ever reached the server


async def test_reachable_only_when_its_cidr_is_allowed(srv):
    a, _, port, _ = srv
    url = f"http://127.0.0.1:{port}/ok.png"
    assert await load_media_bytes(url, MediaLimits(allowed_fetch_cidrs={"127.0.0.1/32"})) == PNG
    # Another loopback address is not covered by the exception.
    assert _is_refusal(await refused(url, MediaLimits(allowed_fetch_cidrs={"127.0.0.2/32"})))
    assert len(a.hits) == 1


async def test_reachable_only_when_its_host_is_allowed(srv):
    a, _, port, _ = srv
    limits = MediaLimits(allowed_fetch_hosts={"localhost"})
    assert await load_media_bytes(f"http://localhost:{port}/ok.png", limits) == PNG
    assert a.hits == [("/ok.png", f"localhost:{port}")]  # connected by address, Host header is still the name
    # The host exception is by name: the same server by address stays refused.
    assert _is_refusal(await refused(f"http://127.0.0.1:{port}/ok.png", limits))
    assert len(a.hits) == 1


async def test_redirect_from_allowed_server_to_disallowed_address_is_refused(srv):
    a, b, port, port_b = srv
    limits = MediaLimits(allowed_fetch_cidrs={"127.0.0.1/32"}, fetch_timeout_s=2)
    # Redirect to an allowed place still works...
    assert await load_media_bytes(f"http://127.0.0.1:{port}/to?http://127.0.0.1:{port}/ok.png", limits) == PNG
    # ...but not to another internal address, the metadata service, or IPv6 loopback.
    for target in (
        f"http://127.0.0.2:{port_b}/ok.png",
        "http://169.254.169.254/latest/meta-data/",
        f"http://[::1]:{port}/ok.png",
        f"http://10.0.0.1:{port}/ok.png",
    ):
        err = await refused(f"http://127.0.0.1:{port}/to?{target}", limits)
        assert _is_refusal(err), (target, err)
    assert b.hits == []
    # The allowed server saw the redirecting requests only (no fetch of the target through it).
    assert all(path.startswith("/to?") or path == "/ok.png" for path, _ in a.hits)


async def test_redirect_checked_with_a_shared_client_too(srv):
    _, b, port, port_b = srv
    limits = MediaLimits(allowed_fetch_cidrs={"127.0.0.1/32"})
    async with fetch_client(limits) as client:
        assert await load_media_bytes(f"http://127.0.0.1:{port}/ok.png", limits, client) == PNG
        assert _is_refusal(
            await refused(f"http://127.0.0.1:{port}/to?http://127.0.0.2:{port_b}/ok.png", limits, client)
        )
    assert b.hits == []


async def test_unguarded_or_mismatched_client_cannot_bypass_the_guard(srv):
    a, _, port, _ = srv
    url = f"http://127.0.0.1:{port}/ok.png"
    async with httpx.AsyncClient(trust_env=False) as plain:
        assert _is_refusal(await refused(url, MediaLimits(), plain))
    async with fetch_client(MediaLimits(allowed_fetch_cidrs={"127.0.0.0/8"})) as permissive:
        assert _is_refusal(await refused(url, MediaLimits(), permissive))
    assert a.hits == []


async def test_errors_do_not_echo_the_remote_answer(srv):
    _, _, port, _ = srv
    limits = MediaLimits(allowed_fetch_cidrs={"127.0.0.1/32"})
    for path in ("/secret", "/forbidden", "/nothing"):
        url = f"http://127.0.0.1:{port}{path}"
        err = await refused(url, limits)
        assert url in err.message, err.message
        # The URL itself is the client's own; its random port may contain "403" or "500".
        answer = err.message.replace(url, "")
        for leak in ("SECRET", "hunter2", "500", "403", "404"):
            assert leak not in answer, (path, err.message)


# --------------------------------------------------------------------------- DNS: rebinding and slow resolvers
# There is no DNS server to run here, so these tests replace the event loop's
# resolver (the one lookup the guard makes) for the duration of the test.


async def test_rebinding_name_cannot_slip_through(srv, monkeypatch):
    """A name that answers an allowed address first and an internal one after:
    the guard looks it up once and connects to the address it checked."""
    a, b, port, port_b = srv
    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo
    calls = []

    async def rebinding(host, port_, *args, **kwargs):
        if host != "rebind.test":
            return await real(host, port_, *args, **kwargs)
        calls.append(host)
        ip = "127.0.0.1" if len(calls) == 1 else "127.0.0.2"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port_))]

    monkeypatch.setattr(loop, "getaddrinfo", rebinding)
    limits = MediaLimits(allowed_fetch_cidrs={"127.0.0.1/32"})
    assert await load_media_bytes(f"http://rebind.test:{port}/ok.png", limits) == PNG
    assert calls == ["rebind.test"]  # one lookup per connection: no second answer is ever used
    assert a.hits == [("/ok.png", f"rebind.test:{port}")] and b.hits == []
    # The next connection gets the internal answer, and is refused.
    assert _is_refusal(await refused(f"http://rebind.test:{port_b}/ok.png", limits))
    assert b.hits == []


async def test_name_with_mixed_answers_is_refused(srv, monkeypatch):
    a, _, port, _ = srv
    loop = asyncio.get_running_loop()

    async def mixed(host, port_, *args, **kwargs):
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port_)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", port_)),
        ]

    monkeypatch.setattr(loop, "getaddrinfo", mixed)
    limits = MediaLimits(allowed_fetch_cidrs={"127.0.0.1/32"})
    assert _is_refusal(await refused(f"http://mixed.test:{port}/ok.png", limits))
    assert a.hits == []


async def test_slow_dns_is_bounded_by_fetch_timeout(monkeypatch):
    loop = asyncio.get_running_loop()

    async def hangs(*args, **kwargs):
        await asyncio.sleep(60)

    monkeypatch.setattr(loop, "getaddrinfo", hangs)
    t0 = time.monotonic()
    err = await refused("http://slow-dns.test/x.png", MediaLimits(fetch_timeout_s=0.3))
    assert time.monotonic() - t0 < 2 and "timed out" in err.message


async def test_unresolvable_name_is_a_fetch_error(monkeypatch):
    loop = asyncio.get_running_loop()

    async def nxdomain(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(loop, "getaddrinfo", nxdomain)
    err = await refused("http://no-such-host.test/x.png", MediaLimits(fetch_timeout_s=2))
    assert "could not connect" in err.message
