"""Who a request is and whether it may start, for the ingress's routes.

- `caller`, a FastAPI dependency of every route but /health (as `vllm serve --api-key`
  checks keys before any route runs): the request's tenant, or a 401 when API keys are
  configured and the request carries none of them (pipeline/tenancy/auth.py).
- `unrouted`, the handler of what no route takes (an unknown path: 404, a route's wrong method: 405):
  the same 401 first, so without a key no answer tells which routes exist.
- `Admission`: the tenant's limits (pipeline/tenancy/limits.py). A chat or completion request
  holds a ticket from its admission (429 when over a limit, before any media work) until its
  answer ends, however it ends; its prompt tokens are charged with LLMDecode's last message.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from deployments.config import IrisConfig
from deployments.metrics import RequestMetrics, TenantMetrics
from pipeline.errors import IrisError
from pipeline.tenancy.auth import KeyRing, unauthorized
from pipeline.tenancy.limits import TenantLimiter, TenantLimits, Ticket
from pipeline.tenancy.tenant import bearer_token, tenant_of


async def caller(request: Request) -> str:
    """FastAPI dependency: the request's tenant (401 IrisError without a configured key). Async,
    so FastAPI runs it on the event loop: a plain function would cost a threadpool hop per request."""
    return request.app.state.ingress.admission.tenant(request)


async def unrouted(request: Request, err: HTTPException) -> JSONResponse:
    """Starlette's 404 (no route has the path) and 405 (a route's wrong method): a 401 without a
    configured key, as on every route but /health; else the error in OpenAI's shape."""
    ingress = request.app.state.ingress
    try:
        ingress.admission.tenant(request)
    except IrisError as refused:
        return ingress.error_response(refused, "request refused")
    what = "Invalid URL" if err.status_code == 404 else "Method not allowed"
    error = IrisError(
        f"{what} ({request.method} {request.url.path})",
        status_code=err.status_code,
        code="not_found" if err.status_code == 404 else "method_not_allowed",
        headers=err.headers,
    )
    return ingress.error_response(error, "no route")


class Admission:
    def __init__(self, config: IrisConfig, metrics: RequestMetrics, own_limits: dict[str, TenantLimits] | None = None):
        """`own_limits`: the models (of an app of several) whose requests count against limits of their own."""
        self.keys = KeyRing.load(config.auth)  # None: no keys configured, requests need none
        self.tenant_header = config.tenant_header
        timeout = config.request_timeout_s
        # "" -> the app's limits; a model's name -> its own
        self.limiters = {"": TenantLimiter(config.tenant_limits, config.cache, timeout)} | {
            model: TenantLimiter(limits, config.cache, timeout, scope=model)
            for model, limits in (own_limits or {}).items()
        }
        self.metrics = TenantMetrics(metrics.counts)
        self._releasing: set[asyncio.Task] = set()

    def tenant(self, request: Request) -> str:
        owner = None
        if self.keys is not None:
            owner = self.keys.tenant(bearer_token(request.headers))
            if owner is None:
                self.metrics.unauthorized()
                raise unauthorized()
        return tenant_of(request.headers, self.tenant_header, owner)

    def ticket(self, tenant: str) -> Ticket:
        return self.limiters[""].ticket(tenant)

    def route(self, ticket: Ticket, model: str) -> None:
        """Before admission: count the ticket under `model`'s own limits, where it has them."""
        limiter = self.limiters.get(model)
        if limiter is not None:
            ticket.scope, ticket.limits = model, limiter.limits.of(ticket.tenant)

    async def admit(self, ticket: Ticket, images: int) -> None:
        """Take the ticket's place within its tenant's limits; a 429 IrisError when over one."""
        try:
            await self.limiters[ticket.scope].admit(ticket, images)
        except IrisError as err:
            if err.status_code == 429:  # not the 400 of a request with more images than a minute allows
                self.metrics.rate_limited(ticket.tenant, err.extra["limit"])
            raise
        self.metrics.admitted(ticket.tenant)

    async def release(self, ticket: Ticket) -> None:
        """Give the ticket back, and charge its prompt tokens. Shielded: a client that leaves
        (cancellation) does not stop it half way."""
        if ticket.backend is None or ticket.released:
            return
        self.metrics.charged(ticket.tenant, ticket.prompt_tokens)
        task = asyncio.ensure_future(self.limiters[ticket.scope].release(ticket))
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)
        await asyncio.shield(task)

    def stats(self) -> dict:
        stats = dict(self.limiters[""].stats)
        for model, limiter in self.limiters.items():
            if model:
                stats[model] = dict(limiter.stats)
        return stats
