"""Ingress: the OpenAI-compatible HTTP API, answered by vLLM's own serving layer on LLMDecode.

What is Iris's stays here: keys and tenant limits, request deadlines (`request_timeout_s`), and
each image and video (deployments/media_features.py: fetched behind the SSRF guard, keyed,
looked up in the feature cache, computed by Preprocess and VisionEncoder when missing, 409 for
an upload-free item nobody has). The body is parsed once, by vLLM's own request models; every
media part is replaced by a part that names its key (pipeline/model/keyed_media.py), and the
request goes to LLMDecode, whose vLLM answers it: its bodies, SSE chunks and errors. Text-only
requests reach vLLM untouched. An app of several models routes each request to the stages of the
model it names (deployments/model_routing.py).

Every route but /health depends on `caller` (deployments/admission.py): the API key's tenant,
or a 401 when keys are configured. Generation requests then pass their tenant's limits (429)
before any media work, and give their slot back when the answer ends, however it ends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from deployments import tracing
from deployments.admission import Admission, caller, unrouted
from deployments.config import IrisConfig
from deployments.decode_stream import DecodeStream
from deployments.failures import failure_response
from deployments.media_features import EncodeLost, MediaFeatures, RequestMedia
from deployments.metrics import RequestMetrics
from deployments.model_routing import ModelRouter, ModelStages, ServedModel
from deployments.request_parsing import RequestParser, VLLMAnswer, answer_id, forwarded_headers
from deployments.stage_trace import mark
from deployments.vllm_args import adapter_names
from pipeline.errors import MODEL_CHANGED, IrisError
from pipeline.stage_io import DecodeCall, DecodeDone
from pipeline.tenancy.limits import Ticket

# No /docs, /redoc or /openapi.json: every route but /health needs a key, so do unknown paths (docs/security.md).
app = FastAPI(
    title="Iris",
    description="OpenAI-compatible vision-language model serving",
    docs_url=None,
    redoc_url=None,
    openapi_url=None,
    exception_handlers={404: unrouted, 405: unrouted},
)
app.add_middleware(tracing.RequestSpans)  # each request's root span; passes straight through with tracing off


@app.exception_handler(IrisError)
async def _refused(request: Request, err: IrisError) -> JSONResponse:
    """An IrisError raised before a route ran: the 401 of `caller`."""
    return request.app.state.ingress.error_response(err, "request refused")


# User code on the replica's own event loop (Ray Serve's throughput-optimized setting): with
# the user code in a thread of its own, each response message crosses threads, and behind
# HAProxy the first token waited for the replica's other loop (bench/results/video/README.md).
INGRESS_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
HEALTH_TIMEOUT_S = 10.0  # a decode replica that does not answer its health check this fast counts as down


@serve.deployment(ray_actor_options={"num_cpus": 0.5, "runtime_env": {"env_vars": INGRESS_ENV}})
@serve.ingress(app)
class Ingress:
    def __init__(self, config: IrisConfig, stages: list[ModelStages]):
        """`stages`: each served model's settings and its deployments' handles (no Preprocess and
        VisionEncoder for a text-only model), the first one answering requests that name no model."""
        self.config = config
        tracing.setup(config.tracing, "ingress")
        self.metrics = RequestMetrics()
        self.router = ModelRouter(
            [
                ServedModel(
                    model,
                    decode,
                    MediaFeatures(model, preprocess, encoder, self.metrics),
                    RequestParser(model, decode),
                    (model.model_name, *adapter_names(model.engine_args)),
                )
                for model, preprocess, encoder, decode in stages
            ]
        )
        self.admission = Admission(config, self.metrics, config.own_tenant_limits())
        # What the module-level dependency and error handlers reach (one Ingress per replica process);
        # vLLM's validation handler reads `args`.
        app.state.ingress = self
        app.state.args = SimpleNamespace(log_error_stack=False)

    @app.get("/health")
    async def health(self) -> Response:
        """200 while every model's decode engine answers vLLM's health check, else 503; needs no key."""
        models = self.router.models
        checks = [asyncio.wait_for(model.decode.health.remote(), HEALTH_TIMEOUT_S) for model in models]
        for model, outcome in zip(models, await asyncio.gather(*checks, return_exceptions=True)):
            if isinstance(outcome, BaseException):
                error = f"{type(outcome).__name__}: {outcome}"[:500]
                unhealthy = {"status": "unhealthy", "error": error} | ({"model": model.name} if len(models) > 1 else {})
                return JSONResponse(unhealthy, status_code=503)
        return JSONResponse({"status": "ok", "redis": await models[0].features.cache.ping()})

    @app.get("/v1/models", dependencies=[Depends(caller)])
    async def list_models(self) -> Response:
        """vLLM's model list: each model's served name and its LoRA adapters."""
        lists = await asyncio.gather(*(model.decode.models.remote() for model in self.router.models))
        if len(lists) == 1:
            return Response(lists[0], media_type="application/json")
        return JSONResponse({"object": "list", "data": [card for text in lists for card in json.loads(text)["data"]]})

    @app.get("/iris/stats", dependencies=[Depends(caller)])
    async def stats(self):
        """The first model's cache and model under `cache` and `model`; with several, each under `models`."""
        models = {
            model.name: {"cache": model.features.cache.stats(), "model": await model.features.model()}
            for model in self.router.models
        }
        first = next(iter(models.values()))
        return {
            "ingress": dict(self.metrics.counts),
            "tenant_limits": self.admission.stats(),
            **first,
            **({"models": models} if len(models) > 1 else {}),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request, tenant: str = Depends(caller)):
        return await self._answer("chat", request, tenant)

    @app.post("/v1/completions")
    async def completions(self, request: Request, tenant: str = Depends(caller)):
        return await self._answer("completion", request, tenant)

    @app.post("/v1/responses")
    async def responses(self, request: Request, tenant: str = Depends(caller)):
        return await self._answer("responses", request, tenant)

    @app.post("/tokenize", dependencies=[Depends(caller)])
    async def tokenize(self, request: Request):
        return await self._text_route("tokenize", request)

    @app.post("/detokenize", dependencies=[Depends(caller)])
    async def detokenize(self, request: Request):
        return await self._text_route("detokenize", request)

    async def _text_route(self, route: str, request: Request) -> Response:
        """vLLM's /tokenize and /detokenize, answered by a decode replica's tokenizer."""
        try:
            model, body, _ = await self.router.parse(route, request)
            opened = await model.decode.text.remote(route, body)
        except VLLMAnswer as answer:
            return answer.response
        except Exception as err:  # a client error, a dead replica (503), a bug (500)
            return self.error_response(err, f"{route} failed")
        return Response(opened.body, status_code=opened.status, media_type="application/json")

    async def _answer(self, route: str, request: Request, tenant: str) -> Response:
        """A generation request within its deadline: parsed, admitted, its media keyed and computed,
        then vLLM's answer, streamed or whole. The ticket (the tenant's limits) is given back when
        the answer ends, however it ends."""
        start = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        tracing.tag_request(tenant)
        ticket = self.admission.ticket(tenant)
        try:
            async with asyncio.timeout_at(deadline):
                stream, media = await self._open(route, request, ticket)
            self.metrics.ttft.observe(time.perf_counter() - start)
        except BaseException as err:  # a client error (4xx), past the deadline (504), a dead replica (503), a bug (500)
            await self.admission.release(ticket)
            if isinstance(err, VLLMAnswer):
                return err.response
            if not isinstance(err, Exception):  # cancelled: the client left
                raise
            return self.error_response(err, f"{route} failed")
        headers = {"x-iris-images": f"cached={media.cached},computed={media.computed}"} if media.items else {}
        if stream.first.body is not None:
            return await self._whole(stream, deadline, headers, ticket)
        return StreamingResponse(
            self._sse(stream.messages(deadline), ticket), media_type="text/event-stream", headers=headers
        )

    async def _open(self, route: str, request: Request, ticket: Ticket) -> tuple[DecodeStream, RequestMedia]:
        """The decode stream, once LLMDecode's first message says the answer is ready: opened beside
        the request's encodes, and again, once, after a rolling update (the items keyed anew) or
        after features vanished from the cache since they were looked up (computed again)."""
        with tracing.span("ingress.parse"):
            model, body, items = await self.router.parse(route, request)
        mark("ingress.parsed")
        forwarded = forwarded_headers(request, body)
        tracing.tag_request(model=model.name, request_id=answer_id(route, body, forwarded))
        self.admission.route(ticket, model.name)
        await self.admission.admit(ticket, len(items))  # before any media work
        features = model.features
        media = await features.resolve(items, ticket.tenant)
        rekeyed = recomputed = False
        while True:
            features.key_parts(media.items)
            tracing.tag_request(
                images_cached=media.cached,
                images_computed=media.computed,
                cache=tracing.cache_outcome(media.cached, media.computed),
            )
            call = DecodeCall(
                route, body, media.keys, media.modalities, media.delivered, ticket.tenant, forwarded, tracing.carrier()
            )
            try:
                stream = await DecodeStream.open(model.decode, call, media.take_encodes())
            except EncodeLost:
                # An encoder or Preprocess replica died under this request's encode (killed,
                # OOM, its node lost): computed again once, on a replica that lives.
                if recomputed:
                    raise
                self.metrics.counts["encodes_lost"] += 1  # /iris/stats
                recomputed = True
                await features.encode_again(media)
                continue
            first = stream.first
            if first.error is None and first.missing_keys is None:
                mark("ingress.first_token")
                return stream, media
            stream.cancel()
            if first.error is not None and first.error.code == MODEL_CHANGED and not rekeyed:
                # A rolling update: a stage already runs other weights or preprocessing than the
                # fingerprint this request was keyed with. Nothing has reached the client yet: key
                # its items again with the new fingerprint, once.
                features.forget_model()
                self.metrics.counts["requests_rekeyed"] += 1  # /iris/stats: requests that met a rolling update
                rekeyed = True
                media = await features.resolve(items, ticket.tenant)
            elif first.missing_keys is not None:
                # 409 for an upload-free item; computed again once (within the request's deadline).
                await features.recompute(media, first.missing_keys, encode=not recomputed)
                if recomputed:
                    raise IrisError(
                        "image features could not be delivered to the decoder",
                        status_code=503,
                        code="features_unavailable",
                    )
                recomputed = True
            else:
                raise first.error

    async def _whole(self, stream: DecodeStream, deadline: float, headers: dict, ticket: Ticket) -> Response:
        """A non-streamed answer: its body came first; the last message's token counts are charged.
        The decode stream is closed whatever happens, also when the client leaves."""
        first = stream.first
        messages = stream.messages(deadline)
        try:
            async for message in messages:
                if isinstance(message, DecodeDone):
                    ticket.prompt_tokens = message.prompt_tokens
        except Exception as err:
            return self.error_response(err, "answer failed")
        finally:
            try:
                await messages.aclose()
            finally:
                await self.admission.release(ticket)
        if first.status == 200:
            self.metrics.outcome("ok")
        else:  # vLLM refused the request
            self.metrics.error(first.status, None)
        return Response(first.body, status_code=first.status, media_type="application/json", headers=headers)

    async def _sse(self, messages: AsyncIterator, ticket: Ticket):
        """A streamed answer's body: vLLM's events. Once the stream has started, an error of Iris's
        (the deadline, a dead replica) is reported in-band, as vLLM does its own. The ticket goes
        back, charged, with LLMDecode's DecodeDone, which comes before the text that holds vLLM's
        [DONE] (the client's next request may follow at once), or when the stream closes otherwise;
        the outcome is counted then too, so that a client reading /iris/stats after [DONE] sees it."""
        counted = False
        try:
            try:
                async for message in messages:
                    if isinstance(message, DecodeDone):
                        ticket.prompt_tokens = message.prompt_tokens
                        await self.admission.release(ticket)
                        self.metrics.outcome("ok")
                        counted = True
                    elif isinstance(message, str):
                        yield message
                if not counted:
                    self.metrics.outcome("ok")
            except Exception as err:
                error = self._failure(err, "stream failed")
                yield f"data: {json.dumps(error.to_dict())}\n\ndata: [DONE]\n\n"
        finally:
            try:
                await messages.aclose()
            finally:
                await self.admission.release(ticket)

    def _failure(self, err: BaseException, what: str) -> IrisError:
        error = failure_response(err, what, self.config.request_timeout_s)
        self.metrics.error(error.status_code, error.code)
        return error

    def error_response(self, err: BaseException, what: str) -> JSONResponse:
        error = self._failure(err, what)
        return JSONResponse(error.to_dict(), status_code=error.status_code, headers=error.headers or None)
