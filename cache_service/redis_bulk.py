"""Batched Redis GET and SET of large values, each copied once on our side.

Why a second client for two commands: L2 reads are the cache's hot path, and
through redis-py a GET of a 4.7 MB value took 3-6 ms here with the hiredis
parser and ~8 ms with the pure-Python one (asyncio's stream buffer, the parser
and the final `bytes` each copy the value, in 64 KB steps through the event
loop). An `asyncio.BufferedProtocol` lets the event loop `recv_into` a buffer
sized from the RESP header, so each value is copied once, from the kernel into
the buffer it is decoded from; that buffer is writable, so tensors decoded
from it are too. Writes send the encoded value as its own chunk (no
concatenation with the command).

Timeouts count silence, not duration: a request fails after `reply_timeout_s`
without any byte received or sent. A frozen Redis is detected as fast as with
redis-py's per-reply timeout, but a batch of large values on a busy 2-core
machine is not mistaken for one (with redis-py, a 16 MB pipeline of SETs
timed out at 250 ms under CPU load here).

Scope: GET, STRLEN and SET ... PX, RESP2, over TCP or a unix socket, with AUTH
and SELECT from the URL. TLS (rediss://) and every other command go through
redis-py (see redis_tier.py). Errors surface as OSError subclasses
(ConnectionError, TimeoutError) or redis.exceptions.ResponseError, which the
tier handles like redis-py's.
"""
from __future__ import annotations

import asyncio
import mmap
from collections.abc import Sequence

from redis.asyncio.connection import UnixDomainSocketConnection, parse_url
from redis.exceptions import ResponseError

Buffer = bytes | bytearray | memoryview | mmap.mmap

_SCRATCH_BYTES = 64 * 1024
PIPELINE_BYTES = 10 << 20  # see BulkClient
_SEPARATE_ARG_BYTES = 64 * 1024
_MMAP_MIN_BYTES = 1 << 20
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux only


def value_buffer(size: int) -> bytearray | mmap.mmap:
    """A writable buffer for one value, freed when the last tensor using it goes.

    Large ones are mapped with MAP_POPULATE: one system call maps and faults in
    every page. Measured here (a VM, where page faults are dear), 8 values of
    4.7 MB kept alive cost 10.8 ms that way against 24 ms as bytearrays that
    fault their pages in one by one.
    """
    if size >= _MMAP_MIN_BYTES and _MAP_POPULATE:
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)
    return bytearray(size)


def supports(url: str) -> bool:
    """True for redis:// and unix:// URLs (not TLS)."""
    params = parse_url(url)
    return params.get("connection_class") in (None, UnixDomainSocketConnection)


class _ReplyReader(asyncio.BufferedProtocol):
    """One connection: parses simple, error, integer and bulk replies as they arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.received = 0  # bytes so far; the silence timeout watches it
        self._scratch = bytearray(_SCRATCH_BYTES)  # reply headers land here
        self._start = 0  # first unparsed byte in scratch
        self._end = 0  # end of received bytes in scratch
        self._scanned = 0  # scratch[_start:_scanned] holds no CRLF (no rescans of a long line)
        self._bulk: bytearray | mmap.mmap | None = None  # value being received, with its trailing CRLF
        self._bulk_filled = 0
        self._replies: list = []
        self._expected = 0
        self._waiter: asyncio.Future[list] | None = None
        self._lost: Exception | None = None

    # -- asyncio.BufferedProtocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = ConnectionError(f"redis closed the connection: {exc!r}" if exc else "redis closed the connection")
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(self._lost)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._bulk is not None:
            return memoryview(self._bulk)[self._bulk_filled :]
        if self._end == len(self._scratch):
            # A header line longer than the free space: move it to the front,
            # or into a larger scratch (never resized in place: the transport
            # may still hold a view of the old one).
            pending = bytes(self._scratch[self._start : self._end])
            if self._start == 0:
                self._scratch = bytearray(2 * len(self._scratch))
            self._scratch[: len(pending)] = pending
            self._scanned -= self._start
            self._start, self._end = 0, len(pending)
        return memoryview(self._scratch)[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self._bulk is not None:
            self._bulk_filled += nbytes
            if self._bulk_filled == len(self._bulk):
                self._finish_bulk()
                self._parse()  # headers may already wait in scratch
            return
        self._end += nbytes
        self._parse()

    def eof_received(self) -> bool:
        return False  # close the transport

    # -- replies --

    def expect(self, count: int) -> asyncio.Future[list]:
        if self._lost is not None:
            raise self._lost
        self._replies, self._expected = [], count
        self._waiter = asyncio.get_running_loop().create_future()
        return self._waiter

    def _parse(self) -> None:
        scratch = self._scratch
        while self._bulk is None and self._start < self._end:
            eol = scratch.find(b"\r\n", max(self._start, self._scanned - 1), self._end)
            if eol < 0:
                self._scanned = self._end
                break
            kind, line = scratch[self._start], bytes(scratch[self._start + 1 : eol])
            self._start = eol + 2
            if kind == 0x24:  # '$' bulk string
                length = int(line)
                if length < 0:
                    self._add(None)
                    continue
                bulk = value_buffer(length + 2)
                ready = min(self._end - self._start, length + 2)
                bulk[:ready] = scratch[self._start : self._start + ready]
                self._start += ready
                self._bulk, self._bulk_filled = bulk, ready
                if ready == len(bulk):
                    self._finish_bulk()
            elif kind == 0x2B:  # '+' simple string
                self._add(line.decode())
            elif kind == 0x3A:  # ':' integer
                self._add(int(line))
            elif kind == 0x2D:  # '-' error
                self._add(ResponseError(line.decode(errors="replace")))
            else:
                self._protocol_error(f"unexpected reply type {chr(kind)!r}")
                return
        if self._start == self._end:
            self._start = self._end = self._scanned = 0

    def _finish_bulk(self) -> None:
        bulk, self._bulk = self._bulk, None
        if bulk[-2:] != b"\r\n":
            self._protocol_error("bulk reply without CRLF")
            return
        self._add(memoryview(bulk)[:-2])

    def _add(self, reply: object) -> None:
        self._replies.append(reply)
        if len(self._replies) == self._expected and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(self._replies)

    def _protocol_error(self, message: str) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionError(f"redis protocol error: {message}"))
        if self.transport is not None:
            self.transport.close()


class _Connection:
    def __init__(self, transport: asyncio.Transport, reader: _ReplyReader):
        self.transport = transport
        self.reader = reader

    @property
    def usable(self) -> bool:
        return not self.transport.is_closing()

    async def request(self, commands: Sequence[Sequence[Buffer]], timeout_s: float) -> list:
        """Send commands in one go; wait for all replies.

        Times out only after timeout_s without progress (nothing received and
        nothing more sent): a large value on the move is slow, not stuck.
        """
        waiter = self.reader.expect(len(commands))
        for chunk in _pack(commands):
            self.transport.write(chunk)
        seen = (self.reader.received, self.transport.get_write_buffer_size())
        while True:
            done, _ = await asyncio.wait([waiter], timeout=timeout_s)
            if done:
                return waiter.result()
            progress = (self.reader.received, self.transport.get_write_buffer_size())
            if progress == seen:
                raise TimeoutError(f"no progress from redis for {timeout_s} s")
            seen = progress

    def close(self) -> None:
        self.transport.close()


class BulkClient:
    """GET and SET of many values over a small pool of connections.

    Values move in pipelines of at most PIPELINE_BYTES, one after another:
    Redis answers pipelined GETs of several large values much slower than the
    same GETs in sequence (measured: 8 x 4.7 MB in ~45 ms pipelined against
    ~15 ms in turn), and buffers a whole pipeline of SETs before answering.
    """

    def __init__(self, url: str, connect_timeout_s: float, reply_timeout_s: float):
        if not supports(url):
            raise ValueError(f"BulkClient does not support {url.split(':', 1)[0]}:// URLs")
        self._params = parse_url(url)
        self._connect_timeout_s = connect_timeout_s
        self._reply_timeout_s = reply_timeout_s
        # Concurrency is bounded by the caller (RedisTier's semaphore), so the
        # idle list never holds more than the pool size.
        self._idle: list[_Connection] = []

    async def get_many(self, keys: Sequence[str]) -> list[memoryview | None]:
        """Values in key order, None where absent; raises ResponseError on any error reply."""
        return await self._on_connection(self._get_many, keys)

    async def set_many(self, items: Sequence[tuple[str, Buffer]], ttl_ms: int) -> list[bool | ResponseError]:
        """SET ... PX ttl_ms for each item; per item True or the error Redis replied (e.g. OOM)."""
        return await self._on_connection(self._set_many, items, ttl_ms)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()

    async def _on_connection(self, work, *args):
        conn = self._take_idle()
        if conn is not None:
            try:
                return await self._run(conn, work, *args)
            except ConnectionError:
                pass  # the pooled connection was stale (e.g. Redis restarted); GET and SET can be repeated
        return await self._run(await self._connect(), work, *args)

    def _take_idle(self) -> _Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable:
                return conn
        return None

    async def _run(self, conn: _Connection, work, *args):
        try:
            result = await work(conn, *args)
        except ResponseError:
            self._idle.append(conn)  # every reply was read: the connection is in a clean state
            raise
        except BaseException:
            conn.close()  # mid-reply state unknown (error, timeout, cancellation)
            raise
        self._idle.append(conn)
        return result

    async def _get_many(self, conn: _Connection, keys: Sequence[str]) -> list[memoryview | None]:
        if len(keys) == 1:
            return _raise_errors(await conn.request([(b"GET", keys[0].encode())], self._reply_timeout_s))
        # One STRLEN round trip sizes the pipelines and skips absent keys.
        sizes = _raise_errors(await conn.request([(b"STRLEN", k.encode()) for k in keys], self._reply_timeout_s))
        values: list[memoryview | None] = [None] * len(keys)
        present = [i for i, size in enumerate(sizes) if size > 0]  # no value this cache writes is empty
        for group in groups_by_size([sizes[i] for i in present], PIPELINE_BYTES):
            indexes = [present[j] for j in group]
            replies = await conn.request([(b"GET", keys[i].encode()) for i in indexes], self._reply_timeout_s)
            for i, reply in zip(indexes, _raise_errors(replies)):
                values[i] = reply
        return values

    async def _set_many(self, conn: _Connection, items: Sequence[tuple[str, Buffer]], ttl_ms: int) -> list:
        ttl = str(ttl_ms).encode()
        results: list[bool | ResponseError] = []
        for group in groups_by_size([memoryview(v).nbytes for _, v in items], PIPELINE_BYTES):
            commands = [(b"SET", items[i][0].encode(), items[i][1], b"PX", ttl) for i in group]
            replies = await conn.request(commands, self._reply_timeout_s)
            results += [r if isinstance(r, ResponseError) else r == "OK" for r in replies]
        return results

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        params = self._params
        if "path" in params:
            opening = loop.create_unix_connection(_ReplyReader, params["path"])
        else:
            opening = loop.create_connection(_ReplyReader, params.get("host", "localhost"), params.get("port", 6379))
        transport, reader = await asyncio.wait_for(opening, self._connect_timeout_s)
        conn = _Connection(transport, reader)
        handshake = []
        if params.get("password"):
            user = params.get("username")
            handshake.append((b"AUTH", user.encode(), params["password"].encode()) if user else (b"AUTH", params["password"].encode()))
        if params.get("db"):
            handshake.append((b"SELECT", str(params["db"]).encode()))
        if handshake:
            try:
                _raise_errors(await conn.request(handshake, self._connect_timeout_s))
            except BaseException:
                conn.close()
                raise
        return conn


def groups_by_size(sizes: Sequence[int], budget: int) -> list[list[int]]:
    """Indexes into sizes, in order, grouped so each group adds up to at most budget (or is one item)."""
    groups: list[list[int]] = []
    total = budget + 1
    for i, size in enumerate(sizes):
        if total + size > budget:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


def _raise_errors(replies: list) -> list:
    for reply in replies:
        if isinstance(reply, ResponseError):
            raise reply
    return replies


def _pack(commands: Sequence[Sequence[Buffer]]) -> list[Buffer]:
    """RESP arrays; large arguments stay separate chunks so they are never concatenated."""
    chunks: list[Buffer] = []
    small = bytearray()
    for args in commands:
        small += b"*%d\r\n" % len(args)
        for arg in args:
            size = memoryview(arg).nbytes
            if size < _SEPARATE_ARG_BYTES:
                small += b"$%d\r\n%s\r\n" % (size, arg)
            else:
                small += b"$%d\r\n" % size
                chunks += [bytes(small), arg]
                small = bytearray(b"\r\n")
    chunks.append(bytes(small))
    return chunks
