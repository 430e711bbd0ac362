"""IrisClient and AsyncIrisClient: the official openai clients, whose chat.completions.create
sends images upload-free when it can and resends on 409 mm_cache_miss, once.

Everything but `chat.completions.create` is the openai client's own (`client.models.list()`,
`client.completions.create(...)`, ...). Each answer carries `.iris`, a Report of what was saved.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import openai
from blake3 import blake3

from iris_client.errors import CacheMissError, missing_of
from iris_client.plan import Plan
from iris_client.report import Report, Totals
from iris_client.sent import PROCESS_SENT_KEYS, SentKeys


class _Base:
    def __init__(
        self, openai_client, *, fetch_urls: bool, sent: SentKeys | None, on_report: Callable[[Report], None] | None
    ):
        self.openai = openai_client
        self.fetch_urls = fetch_urls  # http(s) images: fetched and hashed here (True) or passed to the server
        self.sent = PROCESS_SENT_KEYS if sent is None else sent
        self.on_report = on_report
        self.totals = Totals()
        # Ids are per server and tenant: another base URL, key or header set starts afresh.
        headers = sorted((k.lower(), v) for k, v in (getattr(openai_client, "_custom_headers", None) or {}).items())
        self.scope = blake3(repr((str(openai_client.base_url), openai_client.api_key, headers)).encode()).hexdigest()[
            :32
        ]

    def __getattr__(self, name: str):
        if name == "openai":  # not set yet
            raise AttributeError(name)
        return getattr(self.openai, name)

    def _plan(self, messages, http) -> Plan:
        return Plan(list(messages), self.scope, self.sent, self.fetch_urls, http)

    def _answered(self, plan: Plan, response):
        report = plan.answered()
        self.totals.add(report)
        if self.on_report is not None:
            self.on_report(report)
        try:
            response.iris = report
        except AttributeError:  # no __dict__ (openai's Stream): wrapped
            response = _Reported(response, report)
        return response

    @staticmethod
    def _miss(plan: Plan, err: openai.ConflictError, second: bool) -> None:
        """Prepare the resend after a 409, or raise what the caller must see."""
        missing = missing_of(err)
        if missing is None:
            raise err
        hopeless = missing if second else plan.resend(missing)
        if hopeless:
            why = "after one resend" if second else "and the client has no bytes for them"
            raise CacheMissError(f"images {hopeless} are not in the server's cache {why}", hopeless, err) from err


class _Reported:
    """A stream, with `.iris`: iterates, closes and answers attributes as the stream does."""

    def __init__(self, stream, report: Report):
        self._stream, self.iris = stream, report

    def __getattr__(self, name: str):
        return getattr(self._stream, name)

    def __iter__(self):
        return iter(self._stream)

    def __aiter__(self):
        return self._stream.__aiter__()

    def __enter__(self):
        self._stream.__enter__()
        return self

    def __exit__(self, *exc):
        return self._stream.__exit__(*exc)

    async def __aenter__(self):
        await self._stream.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self._stream.__aexit__(*exc)


class IrisClient(_Base):
    """`openai.OpenAI`, with upload-free images. Arguments are openai.OpenAI's (or an
    `openai_client`), plus `fetch_urls` (fetch http(s) images here to name them by content),
    `sent` (the ids known sent; the process's shared LRU by default) and `on_report`."""

    def __init__(
        self,
        *,
        openai_client: openai.OpenAI | None = None,
        fetch_urls: bool = False,
        sent: SentKeys | None = None,
        on_report: Callable[[Report], None] | None = None,
        **kwargs,
    ):
        super().__init__(
            openai_client or openai.OpenAI(**kwargs), fetch_urls=fetch_urls, sent=sent, on_report=on_report
        )
        self._http = httpx.Client(timeout=60, follow_redirects=True) if fetch_urls else None
        self.chat = _Chat(_Completions(self))

    def create(self, messages, **kwargs):
        plan = self._plan(messages, self._http)
        for second in (False, True):
            try:
                response = self.openai.chat.completions.create(messages=plan.messages(), **kwargs)
            except openai.ConflictError as err:
                self._miss(plan, err, second)
                continue
            return self._answered(plan, response)

    def close(self) -> None:
        self.openai.close()
        if self._http is not None:
            self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncIrisClient(_Base):
    """`openai.AsyncOpenAI`, with upload-free images; as IrisClient. Loading and hashing images
    runs in a thread, off the event loop."""

    def __init__(
        self,
        *,
        openai_client: openai.AsyncOpenAI | None = None,
        fetch_urls: bool = False,
        sent: SentKeys | None = None,
        on_report: Callable[[Report], None] | None = None,
        **kwargs,
    ):
        super().__init__(
            openai_client or openai.AsyncOpenAI(**kwargs), fetch_urls=fetch_urls, sent=sent, on_report=on_report
        )
        self._http = httpx.Client(timeout=60, follow_redirects=True) if fetch_urls else None
        self.chat = _Chat(_AsyncCompletions(self))

    async def create(self, messages, **kwargs):
        plan = await asyncio.to_thread(self._plan, messages, self._http)
        for second in (False, True):
            try:
                wire = await asyncio.to_thread(plan.messages)  # a resend loads and encodes bytes
                response = await self.openai.chat.completions.create(messages=wire, **kwargs)
            except openai.ConflictError as err:
                self._miss(plan, err, second)
                continue
            return self._answered(plan, response)

    async def close(self) -> None:
        await self.openai.close()
        if self._http is not None:
            self._http.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()


class _Chat:
    def __init__(self, completions):
        self.completions = completions


class _Completions:
    def __init__(self, client: IrisClient):
        self._client = client

    def create(self, *, messages, **kwargs):
        """openai's chat.completions.create; `messages` may hold `image` parts."""
        return self._client.create(messages, **kwargs)


class _AsyncCompletions(_Completions):
    async def create(self, *, messages, **kwargs):
        return await self._client.create(messages, **kwargs)
