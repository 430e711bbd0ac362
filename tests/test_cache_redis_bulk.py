"""The copy-once GET client: RESP parsing at every chunk boundary, and real Redis round trips."""

import asyncio
import os
import signal
import time

import pytest
import redis
from redis.exceptions import ResponseError

from cache_service.redis_bulk import BulkClient, _ReplyReader, groups_by_size, supports
from tests.cache_fixtures import SHARED_REDIS_URL, RedisProcess, free_port


def feed(reader: _ReplyReader, data: bytes, chunk: int) -> None:
    """Deliver data the way the event loop does: into get_buffer(), chunk bytes at a time."""
    pos = 0
    while pos < len(data):
        buf = reader.get_buffer(-1)
        n = min(len(buf), chunk, len(data) - pos)
        buf[:n] = data[pos : pos + n]
        reader.buffer_updated(n)
        pos += n


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 65536, 1 << 30])
async def test_parser_handles_every_chunk_boundary(chunk):
    value = os.urandom(3000) + b"\r\n$-1\r\n" + b"x" * 100
    long_error = "ERR " + "e" * 70_000  # longer than the 64 KB header scratch
    stream = (
        b"$%d\r\n%s\r\n" % (len(value), value)
        + b"$-1\r\n"
        + b"$0\r\n\r\n"
        + b"+OK\r\n"
        + b":42\r\n"
        + b"-%s\r\n" % long_error.encode()
        + b"$5\r\nhello\r\n"
    )
    reader = _ReplyReader()
    waiter = reader.expect(7)
    feed(reader, stream, chunk)
    assert waiter.done()
    replies = waiter.result()
    assert bytes(replies[0]) == value
    assert replies[1] is None
    assert bytes(replies[2]) == b""
    assert replies[3:5] == ["OK", 42]
    assert isinstance(replies[5], ResponseError) and str(replies[5]) == long_error
    assert bytes(replies[6]) == b"hello"
    assert not memoryview(replies[0]).readonly  # decoded tensors may be written


async def test_parser_rejects_garbage():
    reader = _ReplyReader()
    waiter = reader.expect(1)
    feed(reader, b"?what\r\n", 64)
    with pytest.raises(ConnectionError):
        waiter.result()


def test_supported_urls():
    assert supports("redis://127.0.0.1:6379/0") and supports("unix:///tmp/redis.sock")
    assert not supports("rediss://example:6380/0")


async def test_round_trip_against_redis(raw_redis, namespace):
    sizes = [1, 100, 70_000, 3 << 20, 5 << 20, 5 << 20, 12 << 20, 10]  # spans several pipelines and mmap buffers
    keys = [f"{namespace}:v{i}" for i in range(len(sizes))]
    values = [os.urandom(n) for n in sizes]
    for key, value in zip(keys, values):
        raw_redis.set(key, value)
    client = BulkClient(SHARED_REDIS_URL, 1.0, 1.0)
    try:
        order = [3, 0, 8, 1, 2, 4, 5, 6, 7]  # index 8 is absent
        got = await client.get_many([keys[i] if i < len(keys) else f"{namespace}:missing" for i in order])
        for i, reply in zip(order, got):
            assert (reply is None) if i == 8 else bytes(reply) == values[i]
        [single] = await client.get_many([keys[4]])
        assert bytes(single) == values[4]
        assert await client.get_many([f"{namespace}:missing"]) == [None]
        # Concurrent callers each get a connection of their own.
        results = await asyncio.gather(*(client.get_many([k]) for k in keys))
        assert [bytes(r[0]) for r in results] == values
    finally:
        client.close()


async def test_wrong_type_is_a_response_error(raw_redis, namespace):
    raw_redis.rpush(f"{namespace}:list", "a")
    client = BulkClient(SHARED_REDIS_URL, 1.0, 1.0)
    with pytest.raises(ResponseError):
        await client.get_many([f"{namespace}:list"])
    raw_redis.set(f"{namespace}:ok", b"fine")
    assert [bytes(v) for v in await client.get_many([f"{namespace}:ok"])] == [b"fine"]  # connection still usable
    client.close()


async def test_auth_and_database_from_url():
    server = RedisProcess(free_port(), "--requirepass", "s3cret")
    server.start()
    try:
        writer = redis.Redis(port=server.port, db=3, password="s3cret")
        writer.set("k", b"in db 3")
        writer.close()
        good = BulkClient(f"redis://:s3cret@127.0.0.1:{server.port}/3", 1.0, 1.0)
        assert [bytes(v) for v in await good.get_many(["k"])] == [b"in db 3"]
        good.close()
        bad = BulkClient(f"redis://:wrong@127.0.0.1:{server.port}/3", 1.0, 1.0)
        with pytest.raises(ResponseError):
            await bad.get_many(["k"])
        bad.close()
    finally:
        server.kill()


async def test_restart_and_freeze(redis_process):
    writer = redis.Redis(port=redis_process.port)
    writer.set("k", b"v1")
    client = BulkClient(redis_process.url, 0.5, 0.2)
    assert [bytes(v) for v in await client.get_many(["k"])] == [b"v1"]

    redis_process.kill()
    redis_process.start()
    writer.set("k", b"v2")
    # The pooled connection died with the server: retried once on a fresh one.
    assert [bytes(v) for v in await client.get_many(["k"])] == [b"v2"]

    redis_process.proc.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.get_many(["k"])
        assert time.monotonic() - started < 1.0
    finally:
        redis_process.proc.send_signal(signal.SIGCONT)
    assert [bytes(v) for v in await client.get_many(["k"])] == [b"v2"]

    redis_process.kill()
    with pytest.raises(ConnectionError):
        await client.get_many(["k"])
    client.close()
    writer.close()


def test_groups_by_size():
    assert groups_by_size([], 10) == []
    assert groups_by_size([4, 4, 4, 20, 1, 9], 10) == [[0, 1], [2], [3], [4, 5]]


async def test_set_many_round_trip_with_ttl(raw_redis, namespace):
    items = [(f"{namespace}:s{i}", bytearray(os.urandom(n))) for i, n in enumerate([10, 200_000, 6 << 20, 6 << 20])]
    client = BulkClient(SHARED_REDIS_URL, 1.0, 1.0)
    try:
        assert await client.set_many(items, 30_000) == [True] * 4
        for key, value in items:
            assert raw_redis.get(key) == bytes(value)
            assert 25_000 < raw_redis.pttl(key) <= 30_000
        got = await client.get_many([k for k, _ in items])
        assert [bytes(v) for v in got] == [bytes(v) for _, v in items]
    finally:
        client.close()


async def test_set_many_reports_refused_writes_per_item():
    server = RedisProcess(free_port(), "--maxmemory", "2mb")
    server.start()
    client = BulkClient(server.url, 1.0, 1.0)
    try:
        replies = await client.set_many([("small", b"x" * 100), ("big", bytes(4 << 20)), ("small2", b"y")], 10_000)
        assert replies[0] is True
        assert isinstance(replies[1], ResponseError) or isinstance(replies[2], ResponseError)
        assert [bytes(v) for v in await client.get_many(["small"])] == [b"x" * 100]  # connection still fine
    finally:
        client.close()
        server.kill()
