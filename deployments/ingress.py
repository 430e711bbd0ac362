"""Ingress: the OpenAI-compatible HTTP API.

Routes, validation and responses. A request's images and videos are MediaFeatures'
job (deployments/media_features.py); its answer comes from LLMDecode as a DecodeStream
and goes out as vLLM's response models (pipeline/api/openai_format.py). Every request has
a deadline (`request_timeout_s`) for all its work.

Every route but /health depends on `caller` (deployments/admission.py): the API key's tenant,
or a 401 when keys are configured. Chat and completion requests then pass their tenant's limits
(429) before any media work, and give their slot back when the answer ends, however it ends.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments import tracing
from deployments.admission import Admission, caller
from deployments.config import IrisConfig
from deployments.decode_stream import DecodeStream
from deployments.failures import failure_response
from deployments.media_features import MediaFeatures, RequestMedia
from deployments.metrics import RequestMetrics
from deployments.stage_trace import mark
from pipeline.api import openai_format
from pipeline.api.body import read_json_body
from pipeline.api.chat_prompt import messages_for_template
from pipeline.api.chat_request import parse_chat_request
from pipeline.api.errors import MODEL_CHANGED, IrisError, bad_request, not_found
from pipeline.api.openai_format import Reply, json_response
from pipeline.api.sampling import check_max_tokens, validate_sampling
from pipeline.api.tokenize import parse_detokenize_request, parse_tokenize_request
from pipeline.stage_io import DecodeRequest
from pipeline.tenancy.limits import Ticket

app = FastAPI(title="Iris", description="OpenAI-compatible vision-language model serving")
app.add_middleware(tracing.RequestSpans)  # each request's root span; passes straight through with tracing off


@app.exception_handler(IrisError)
async def _refused(request: Request, err: IrisError) -> JSONResponse:
    """An IrisError raised before a route ran: the 401 of `caller`."""
    return request.app.state.ingress.error_response(err, "request refused")


# User code on the replica's own event loop (Ray Serve's throughput-optimized setting): with
# the user code in a thread of its own, each response message crosses threads, and behind
# HAProxy the first token waited for the replica's other loop (bench/results/video/README.md).
INGRESS_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


@serve.deployment(ray_actor_options={"num_cpus": 0.5, "runtime_env": {"env_vars": INGRESS_ENV}})
@serve.ingress(app)
class Ingress:
    def __init__(self, config: IrisConfig, preprocess: DeploymentHandle, encoder: DeploymentHandle,
                 decode: DeploymentHandle):
        self.config = config
        tracing.setup(config.tracing, "ingress")
        self.decode = decode
        self.metrics = RequestMetrics()
        self.admission = Admission(config, self.metrics)
        self.features = MediaFeatures(config, preprocess, encoder, self.metrics)
        # What the module-level dependency and error handler reach (one Ingress per replica process).
        app.state.ingress = self
        # Room for every image and video as base64 (4/3 of its bytes) plus 1 MiB of text.
        self.max_body_bytes = (config.max_images_per_prompt * config.media.max_image_bytes
                               + config.max_videos_per_prompt * config.media.max_video_bytes) * 4 // 3 + (1 << 20)

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "redis": await self.features.cache.ping()}

    @app.get("/v1/models", dependencies=[Depends(caller)])
    async def models(self) -> Response:
        max_model_len = self.config.engine_args.get("max_model_len")
        return json_response(openai_format.model_list(self.config.model_name, max_model_len))

    @app.get("/iris/stats", dependencies=[Depends(caller)])
    async def stats(self):
        return {"ingress": dict(self.metrics.counts), "cache": self.features.cache.stats(),
                "tenant_limits": self.admission.stats(), "model": await self.features.model()}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request, tenant: str = Depends(caller)):
        return await self._answer(self._open_chat, request, tenant, "chat completion")

    @app.post("/v1/completions")
    async def completions(self, request: Request, tenant: str = Depends(caller)):
        """Text prompts, with the chat endpoint's sampling surface (vLLM's CompletionRequest)."""
        return await self._answer(self._open_text, request, tenant, "completion")

    @app.post("/tokenize", dependencies=[Depends(caller)])
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a text prompt, or text-only chat messages through the chat template."""
        try:
            job = parse_tokenize_request(await self._body(request), self.config.max_images_per_prompt)
            self._check_model(job.model)
            result = await self.decode.tokenize.remote(job)
            if isinstance(result, IrisError):
                raise result
        except Exception as err:  # a client error, a dead replica (503), a bug (500)
            return self.error_response(err, "tokenize failed")
        return json_response(result)

    @app.post("/detokenize", dependencies=[Depends(caller)])
    async def detokenize(self, request: Request):
        try:
            req = parse_detokenize_request(await self._body(request))
            self._check_model(req.model)
            return json_response(await self.decode.detokenize.remote(req.tokens))
        except Exception as err:
            return self.error_response(err, "detokenize failed")

    async def _open_chat(self, request: Request, ticket: Ticket) -> tuple[DecodeStream, Reply]:
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        mark("ingress.received", request_id)
        with tracing.span("ingress.parse"):
            chat = parse_chat_request(await self._body(request), self.config.max_images_per_prompt,
                                      self.config.max_videos_per_prompt)
        mark("ingress.parsed", request_id)
        check_max_tokens(chat.sampling, self.config.max_tokens_limit)
        self._check_model(chat.model)
        await self.admission.admit(ticket, len(chat.media))  # before any media work
        for attempt in range(2):
            media = await self.features.resolve(chat, ticket.tenant)
            tracing.tag_request(request_id=request_id, images_cached=media.cached, images_computed=media.computed,
                                cache=tracing.cache_outcome(media.cached, media.computed))
            try:
                stream = await self._open_decode(DecodeRequest(
                    request_id, messages_for_template(chat.messages), media.keys, chat.sampling, media.delivered,
                    ticket.tenant, modalities=media.modalities, trace=tracing.carrier()), media)
                break
            except IrisError as err:
                # A rolling update: a stage already runs other weights or preprocessing than the
                # fingerprint this request was keyed with. Nothing has reached the client yet: key
                # its items again with the new fingerprint, once.
                if err.code != MODEL_CHANGED or attempt:
                    raise
                self.metrics.counts["requests_rekeyed"] += 1  # /iris/stats: requests that met a rolling update
        mark("ingress.first_token", request_id)
        model = self.config.model_name
        return stream, Reply(
            chat.stream, lambda chunks: openai_format.chat_events(chunks, request_id, model, chat.sampling.n or 1,
                                                                  chat.include_usage),
            lambda answer: answer.chat(request_id, model),
            {"x-iris-images": f"cached={media.cached},computed={media.computed}"})

    async def _open_text(self, request: Request, ticket: Ticket) -> tuple[DecodeStream, Reply]:
        req = validate_sampling(await self._body(request), "completion")
        check_max_tokens(req, self.config.max_tokens_limit)
        prompt = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
        if not isinstance(prompt, str):
            raise bad_request("prompt must be a string (token ids and batches are not supported)", param="prompt")
        self._check_model(req.model)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        await self.admission.admit(ticket, 0)
        tracing.tag_request(request_id=request_id)
        stream = await DecodeStream.open(self.decode, DecodeRequest(request_id, None, [], req, tenant=ticket.tenant,
                                                                    prompt=prompt, trace=tracing.carrier()))
        model = self.config.model_name
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        return stream, Reply(req.stream, lambda chunks: openai_format.text_events(chunks, request_id, model,
                                                                                  include_usage),
                             lambda answer: answer.text(request_id, model))

    async def _open_decode(self, request: DecodeRequest, media: RequestMedia) -> DecodeStream:
        """The decode stream, opened beside the request's encodes; again once after computing the
        features that vanished from the cache since they were looked up."""
        for attempt in range(2):
            try:
                stream = await DecodeStream.open(self.decode, request, media.take_encodes())
            except IrisError as err:
                if err.code == MODEL_CHANGED:
                    self.features.forget_model()
                raise
            if not stream.first.missing_keys:
                return stream
            stream.cancel()
            # 409 for an upload-free item; computed again once (within the request's deadline).
            await self.features.recompute(media, stream.first.missing_keys, encode=attempt == 0)
        raise IrisError("image features could not be delivered to the decoder", status_code=503,
                        code="features_unavailable")

    async def _answer(self, open_answer: Callable, request: Request, tenant: str, what: str) -> Response:
        """`open_answer(request, ticket)` within the request's deadline, then its answer, streamed or
        whole. The ticket (the tenant's limits) is given back when the answer ends, however it ends."""
        start = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        tracing.tag_request(tenant, model=self.config.model_name)
        ticket = self.admission.ticket(tenant)
        try:
            async with asyncio.timeout_at(deadline):
                stream, reply = await open_answer(request, ticket)
            self.metrics.ttft.observe(time.perf_counter() - start)
        except BaseException as err:  # a client error (4xx), past the deadline (504), a dead replica (503), a bug (500)
            await self.admission.release(ticket)
            if not isinstance(err, Exception):  # cancelled: the client left
                raise
            return self.error_response(err, f"{what} failed")
        chunks = stream.chunks(deadline)
        if ticket.backend is not None:  # a tenant with limits: its prompt tokens are charged at the end
            chunks = self.admission.charged(chunks, ticket)
        if reply.stream:
            return StreamingResponse(self._sse(reply.events(chunks), chunks, ticket), media_type="text/event-stream",
                                     headers=reply.headers)
        return await self._whole(chunks, reply.whole, reply.headers, what, ticket)

    async def _body(self, request: Request) -> dict:
        return await read_json_body(request.stream(), request.headers.get("content-length"), self.max_body_bytes)

    def _check_model(self, name: str | None) -> None:
        if name and name != self.config.model_name:
            raise not_found(f"The model `{name}` does not exist; this server serves "
                            f"`{self.config.model_name}`.", param="model", code="model_not_found")

    async def _whole(self, chunks: AsyncIterator, render: Callable, headers: dict | None, what: str,
                     ticket: Ticket) -> Response:
        """A non-streamed answer. The decode stream is closed whatever happens, also when the
        client leaves (cancellation), which aborts the decode request."""
        try:
            answer = await openai_format.Answer.gather(chunks)
        except Exception as err:
            return self.error_response(err, f"{what} failed while decoding")
        finally:
            try:
                await chunks.aclose()
            finally:
                await self.admission.release(ticket)
        self.metrics.outcome("ok")
        return json_response(render(answer), headers)

    async def _sse(self, events: AsyncIterator[str], chunks: AsyncIterator, ticket: Ticket):
        """A streamed answer's body: the events, [DONE] last. Once the stream has started, an error
        (the engine's, the deadline, a dead replica) is reported in-band, as OpenAI does. The
        ticket goes back with the last chunk (_charged), or when the stream closes otherwise."""
        try:
            try:
                async for event in events:
                    yield event
                self.metrics.outcome("ok")
            except Exception as err:
                error = self._failure(err, "stream failed")
                yield openai_format.sse(error.to_dict()) + openai_format.DONE
        finally:
            try:
                await events.aclose()
                await chunks.aclose()
            finally:
                await self.admission.release(ticket)

    def _failure(self, err: BaseException, what: str) -> IrisError:
        error = failure_response(err, what, self.config.request_timeout_s)
        self.metrics.error(error.status_code, error.code)
        return error

    def error_response(self, err: BaseException, what: str) -> JSONResponse:
        error = self._failure(err, what)
        return JSONResponse(error.to_dict(), status_code=error.status_code, headers=error.headers or None)
