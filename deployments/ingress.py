"""Ingress: the OpenAI-compatible HTTP API.

Per request: parse and validate, fetch image bytes, compute cache keys, ask the
cache which are present, send only the misses to Preprocess -> VisionEncoder,
then stream the answer from LLMDecode. Upload-free images (uuid only) that are
not cached end the request with 409 `mm_cache_miss` before any work is done.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve import metrics
from ray.serve.handle import DeploymentHandle

from cache_service.codec import Features
from cache_service.feature_cache import FeatureCache
from cache_service.keys import content_key, uuid_key
from deployments.config import IrisConfig
from deployments.metrics import CacheMetrics, latency_histogram
from pipeline import openai_format
from pipeline.chat_prompt import template_messages
from pipeline.chat_request import ParsedChat, parse_chat_request
from pipeline.errors import IrisError, bad_request, not_found, server_error
from pipeline.json_body import parse_json_body
from pipeline.media import fetch_client, load_image_bytes
from pipeline.stage_io import DecodeChunk, DecodeRequest, ImageJob
from pipeline.tenant import tenant_of

logger = logging.getLogger("ray.serve")
app = FastAPI(title="Iris", description="OpenAI-compatible vision-language model serving")


# Helpers come before the class: @serve.ingress pickles the FastAPI app at class
# definition, so names defined after it would be missing in the replicas.
async def _json_body(request: Request, max_bytes: int) -> dict:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    raw = bytearray()
    async for piece in request.stream():  # stop reading as soon as the limit is passed
        raw += piece
        if len(raw) > max_bytes:
            raise _too_large(max_bytes)
    return parse_json_body(raw)  # 400 invalid_json for bad UTF-8, syntax or nesting


def _too_large(max_bytes: int) -> IrisError:
    return IrisError(f"request body larger than {max_bytes} bytes", status_code=413, code="request_too_large")


@dataclass
class RequestImages:
    keys: list[str]  # cache key per image, in request order
    datas: list[bytes | None]  # uploaded bytes per image; None when sent by uuid only
    inline: dict[str, Features] = field(default_factory=dict)  # features not retrievable from the cache
    cached: int = 0  # distinct images found in the cache
    computed: int = 0  # distinct images sent to Preprocess + VisionEncoder


def _cache_miss(indexes: list[int]) -> IrisError:
    return IrisError(
        f"image(s) {indexes} were sent by uuid only and are not in the feature cache; "
        "send the image bytes with the same uuid again",
        status_code=409, param="messages", code="mm_cache_miss", extra={"missing": indexes})


async def _none():
    return None


async def _prepend(first, stream):
    try:
        yield first
        async for chunk in stream:
            yield chunk
    finally:
        stream.cancel()


@serve.deployment(ray_actor_options={"num_cpus": 0.5})
@serve.ingress(app)
class Ingress:
    def __init__(self, config: IrisConfig, preprocess: DeploymentHandle, encoder: DeploymentHandle,
                 decode: DeploymentHandle):
        self.config = config
        self.preprocess = preprocess
        self.encoder = encoder
        self.decode = decode
        # The ingress only asks which keys exist; it never holds features.
        self.cache = FeatureCache(config.cache.model_copy(update={"l1_max_bytes": 0}))
        self.cache_metrics = CacheMetrics(self.cache)
        self.http = fetch_client(config.media)  # SSRF-guarded: public addresses unless allowed
        self._fingerprint: str | None = None
        # Room for every image as base64 (4/3 of its bytes) plus 1 MiB of text.
        self.max_body_bytes = config.max_images_per_prompt * config.media.max_image_bytes * 4 // 3 + (1 << 20)
        self.counts: Counter[str] = Counter()
        self.requests = metrics.Counter("iris_requests", description="Chat requests by outcome",
                                        tag_keys=("outcome",))
        self.images = metrics.Counter("iris_images", description="Images by how their features were obtained "
                                      "(cached: feature-cache hit; computed: preprocess + encoder ran)",
                                      tag_keys=("source",))
        self.ttft = latency_histogram("iris_ttft_seconds", "Seconds from request arrival to the first token")

    # --- routes ---------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "redis": await self.cache.ping()}

    @app.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": self.config.model_name, "object": "model", "created": 0, "owned_by": "iris"}]}

    @app.get("/iris/stats")
    async def stats(self) -> dict:
        return {"ingress": dict(self.counts), "cache": self.cache.stats()}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        start = time.perf_counter()
        try:
            body = await _json_body(request, self.max_body_bytes)
            chat = parse_chat_request(body, self.config.max_images_per_prompt)
            if chat.model and chat.model != self.config.model_name:
                raise not_found(f"The model `{chat.model}` does not exist; this server serves "
                                f"`{self.config.model_name}`.", param="model", code="model_not_found")
            tenant = tenant_of(request.headers, self.config.tenant_header)
            images = await asyncio.wait_for(self._features(chat, tenant), self.config.request_timeout_s)
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            chunks = await self._start_decode(chat, images, request_id, start)
        except IrisError as err:
            return self._error(err)
        except asyncio.TimeoutError:
            return self._error(server_error("image processing timed out", code="timeout", status_code=504))
        except Exception:  # a bug or a dead replica: log it, answer 500, keep serving
            logger.exception("chat completion failed")
            return self._error(server_error("internal error", code="internal_error"))
        headers = {"x-iris-images": f"cached={images.cached},computed={images.computed}"}
        if chat.stream:
            return StreamingResponse(self._stream(chat, request_id, chunks), media_type="text/event-stream",
                                     headers=headers)
        return await self._collect(request_id, chunks, headers)

    # --- images ---------------------------------------------------------------
    async def _get_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = await self.encoder.get_fingerprint.remote()
        return self._fingerprint

    async def _features(self, chat: ParsedChat, tenant: str) -> RequestImages:
        """Keys of the request's images; runs Preprocess + VisionEncoder for the misses only."""
        if not chat.images:
            return RequestImages([], [])
        fingerprint = await self._get_fingerprint()
        namespace = self.config.cache.namespace
        datas = list(await asyncio.gather(*(
            load_image_bytes(img.url, self.config.media, self.http, param=f"image[{img.index}]")
            if img.url is not None else _none() for img in chat.images)))
        keys = []
        for img, data in zip(chat.images, datas):
            try:
                keys.append(uuid_key(fingerprint, tenant, img.uuid, namespace) if img.uuid
                            else content_key(fingerprint, data, namespace))
            except ValueError as err:
                raise bad_request(str(err), param=f"image[{img.index}].uuid", code="invalid_uuid") from err
        images = RequestImages(keys, datas)
        unique = list(dict.fromkeys(keys))
        present = dict(zip(unique, await self.cache.contains_many(unique)))
        self.cache_metrics.export()
        missing = [img.index for img, key in zip(chat.images, keys) if img.url is None and not present[key]]
        if missing:
            raise _cache_miss(missing)
        misses = [key for key in unique if not present[key]]
        if misses:
            await self._encode(images, misses)
        images.cached = len(unique) - len(misses)
        for source, n in (("cached", images.cached), ("computed", len(misses))):
            if n:
                self.images.inc(n, tags={"source": source})
                self.counts[f"images_{source}"] += n
        return images

    async def _encode(self, images: RequestImages, keys: list[str], inline: bool = False) -> None:
        """Preprocess + encode the images with these keys (each once); features that
        could not be shared through the cache (or all, with `inline`) land in `images.inline`."""
        jobs = []
        for key in keys:
            index = images.keys.index(key)
            jobs.append(ImageJob(index, key, images.datas[index]))
        result = await self.preprocess.encode_images.remote(jobs, inline)
        if isinstance(result, IrisError):
            raise result
        images.computed += len(jobs)
        images.inline.update({r.key: r.features for r in result if r.features is not None})

    # --- decode ---------------------------------------------------------------
    async def _start_decode(self, chat: ParsedChat, images: RequestImages, request_id: str, start: float):
        """The decode stream with its first chunk already received, so that errors
        become a proper status code even for streaming requests."""
        messages = template_messages(chat)
        for attempt in range(2):
            request = DecodeRequest(request_id, messages, images.keys, chat.sampling, images.inline)
            stream = self.decode.options(stream=True).generate.remote(request)
            first: DecodeChunk = await stream.__anext__()
            if first.error:
                raise bad_request(first.error["message"], param=first.error.get("param"), code=first.error["code"])
            if not first.missing_keys:
                self.ttft.observe(time.perf_counter() - start)
                return _prepend(first, stream)
            # Evicted between our presence check and the decode's read: recompute the
            # ones we have bytes for and pass them inline; uuid-only ones are a miss.
            gone = set(first.missing_keys)
            upload_free = [i for i, (key, data) in enumerate(zip(images.keys, images.datas))
                           if key in gone and data is None]
            if upload_free:
                raise _cache_miss(upload_free)
            if attempt == 0:
                await self._encode(images, [k for k in dict.fromkeys(images.keys) if k in gone], inline=True)
        raise IrisError("image features could not be delivered to the decoder", status_code=503,
                        code="features_unavailable")

    async def _collect(self, request_id, chunks, headers):
        text, finish, usage = [], None, openai_format.Usage()
        async for c in chunks:
            if c.error:
                return self._error(bad_request(c.error["message"], param=c.error.get("param"), code=c.error["code"]))
            text.append(c.text)
            finish = c.finish_reason or finish
            if c.finish_reason:
                usage = openai_format.Usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
        self._outcome("ok")
        body = openai_format.completion(request_id, self.config.model_name, "".join(text), finish, usage)
        return JSONResponse(body, headers=headers)

    async def _stream(self, chat, request_id, chunks):
        model = self.config.model_name
        yield openai_format.chunk(request_id, model, {"role": "assistant", "content": ""})
        try:
            async for c in chunks:
                if c.error:  # the engine rejected the request after the stream started
                    self._outcome("client_error")
                    yield openai_format.sse(bad_request(c.error["message"], code=c.error["code"]).to_dict())
                    break
                if c.text or c.finish_reason:
                    delta = {"content": c.text} if c.text else {}
                    yield openai_format.chunk(request_id, model, delta, c.finish_reason)
                if c.finish_reason and chat.include_usage:
                    usage = openai_format.Usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
                    yield openai_format.chunk(request_id, model, {}, usage=usage, choices=False)
            else:
                self._outcome("ok")
            yield openai_format.DONE
        except Exception:  # the stream has started: report in-band, as OpenAI does
            logger.exception("stream failed")
            self._outcome("server_error")
            yield openai_format.sse(server_error("internal error", code="internal_error").to_dict())
            yield openai_format.DONE
        finally:
            await chunks.aclose()

    def _error(self, err: IrisError) -> JSONResponse:
        self._outcome("cache_miss" if err.code == "mm_cache_miss" else
                      "client_error" if err.status_code < 500 else "server_error")
        return JSONResponse(err.to_dict(), status_code=err.status_code)

    def _outcome(self, outcome: str) -> None:
        self.counts[f"requests_{outcome}"] += 1
        self.requests.inc(tags={"outcome": outcome})
