"""Ingress: the OpenAI-compatible HTTP API.

Per request: parse and validate, fetch image and video bytes, compute cache keys,
ask the cache which are present, send only the misses to Preprocess -> VisionEncoder,
then stream the answer from LLMDecode. Upload-free items (uuid only) that are
not cached end the request with 409 `mm_cache_miss` before any work is done.

Single-flight: concurrent requests with the same new image or clip share one
Preprocess + VisionEncoder run. Keys this replica saw computed or present are
remembered (`_known`), so a repeated image costs no presence check; should one
be gone by the time LLMDecode reads it, the decode says so and the ingress
recomputes it (or answers 409 for an upload-free image).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.serve import metrics
from ray.serve.handle import DeploymentHandle

from cache_service.feature_cache import FeatureCache
from cache_service.keys import content_key, uuid_key
from deployments.config import IrisConfig
from deployments.metrics import CacheMetrics, latency_histogram
from pipeline import openai_format
from pipeline.chat_prompt import template_messages
from pipeline.chat_request import ParsedChat, parse_chat_request
from pipeline.errors import IrisError, bad_request, not_found, server_error
from pipeline.json_body import parse_json_body
from pipeline.logprobs import extend_completion_logprobs
from pipeline.media import fetch_client, load_media_bytes
from pipeline.stage_io import DecodeChunk, DecodeRequest, EncodedMedia, MediaJob
from pipeline.stage_trace import mark
from pipeline.tenant import tenant_of
from pipeline.tokenize import parse_detokenize_request, parse_tokenize_request
from pipeline.vllm_sampling import check_max_tokens, validate_sampling

logger = logging.getLogger("ray.serve")
app = FastAPI(title="Iris", description="OpenAI-compatible vision-language model serving")


JSON_IN_THREAD_BYTES = 256 * 1024

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
    # 400 invalid_json for bad UTF-8, syntax or nesting; a large body parses in a
    # thread, so it does not stall the streams on this replica.
    if len(raw) >= JSON_IN_THREAD_BYTES:
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


def _too_large(max_bytes: int) -> IrisError:
    return IrisError(f"request body larger than {max_bytes} bytes", status_code=413, code="request_too_large")


# Keys remembered as present; ~100 bytes each. Being wrong costs one retry (see _start_decode).
KNOWN_KEYS = 100_000
# Images at least this large are hashed in a thread; below, the thread hop costs more than the hash.
HASH_IN_THREAD_BYTES = 256 * 1024


@dataclass
class RequestMedia:
    keys: list[str]  # cache key per image or video, in request order
    datas: list[bytes | None]  # uploaded bytes per item; None when sent by uuid only
    names: list[str] = field(default_factory=list)  # per item, for errors: image[0], video[0], ...
    modalities: list[str] = field(default_factory=list)  # per item
    delivered: dict = field(default_factory=dict)  # key -> ObjectRef of features computed for this request
    cached: int = 0  # distinct items found in the cache (or computed by a concurrent request)
    computed: int = 0  # distinct items sent to Preprocess + VisionEncoder by this request


def _cache_miss(indexes: list[int], names: list[str]) -> IrisError:
    """`indexes`: positions among the request's images and videos; `names` say which."""
    what = "image(s)" if all(n.startswith("image[") for n in names) else f"item(s) {names} at"
    return IrisError(
        f"{what} {indexes} were sent by uuid only and are not in the feature cache; "
        "send the bytes with the same uuid again",
        status_code=409, param="messages", code="mm_cache_miss", extra={"missing": indexes})


def _stage_failed(err: BaseException | None) -> bool:
    """Whether `err` says a replica of a downstream stage died or became unreachable
    (killed, crashed, its node lost), as opposed to a bug."""
    for _ in range(8):  # causes nest: a task error caused by an actor's death, ...
        if err is None:
            return False
        if isinstance(err, (RayActorError, WorkerCrashedError, ObjectLostError, NodeDiedError)):
            return True
        err = err.cause if isinstance(err, RayTaskError) else err.__cause__
    return False


def _replica_unavailable() -> IrisError:
    return server_error("a serving replica failed while handling this request; retry it",
                        code="replica_unavailable", status_code=503)


def _timed_out(timeout_s: float) -> IrisError:
    return server_error(f"the request took longer than the server's limit of {timeout_s:g} s",
                        code="timeout", status_code=504)


async def _none():
    return None


async def _until(deadline: float, items):
    """`items` while the event loop's clock is before `deadline`; TimeoutError after.
    Closing it closes `items`. (The timeout scope never spans a yield: the consumer awaits
    other things in between, e.g. sending to the client.)"""
    try:
        while True:
            async with asyncio.timeout_at(deadline):
                try:
                    item = await anext(items)
                except StopAsyncIteration:
                    return
            yield item
    finally:
        await items.aclose()


async def _first_chunk(stream):
    """The decode stream's first chunk; a caller that stops waiting (timeout, disconnect)
    cancels the decode request with it."""
    try:
        return await stream.__anext__()
    except BaseException:
        stream.cancel()
        raise


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
        self._modalities: list[str] = []  # what the model serves, with the fingerprint
        self._inflight: dict[str, asyncio.Task[EncodedMedia]] = {}  # key -> its running encode
        self._waiters: Counter[str] = Counter()  # key -> requests waiting for its running encode
        self._known: OrderedDict[str, None] = OrderedDict()  # LRU of keys known to be stored
        # Room for every image and video as base64 (4/3 of its bytes) plus 1 MiB of text.
        self.max_body_bytes = (config.max_images_per_prompt * config.media.max_image_bytes
                               + config.max_videos_per_prompt * config.media.max_video_bytes) * 4 // 3 + (1 << 20)
        self.counts: Counter[str] = Counter()
        self.requests = metrics.Counter("iris_requests", description="Chat requests by outcome",
                                        tag_keys=("outcome",))
        self.images = metrics.Counter("iris_images", description="Images and videos by how their features were obtained "
                                      "(cached: feature-cache hit; computed: preprocess + encoder ran)",
                                      tag_keys=("source",))
        self.ttft = latency_histogram("iris_ttft_seconds", "Seconds from request arrival to the first token")

    # --- routes ---------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok", "redis": await self.cache.ping()}

    @app.get("/v1/models")
    async def models(self) -> dict:
        # The fields `vllm serve` lists, so clients that read them (vllm bench serve) see the same.
        name = self.config.model_name
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm", "root": name,
            "parent": None, "max_model_len": self.config.engine_args.get("max_model_len"),
            "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                            "created": int(time.time()), "allow_create_engine": False, "allow_sampling": True,
                            "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                            "allow_fine_tuning": False, "organization": "*", "group": None,
                            "is_blocking": False}]}]}

    @app.get("/iris/stats")
    async def stats(self) -> dict:
        return {"ingress": dict(self.counts), "cache": self.cache.stats()}

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        start = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                request_id = f"chatcmpl-{uuid.uuid4().hex}"
                mark("ingress.received", request_id)
                body = await _json_body(request, self.max_body_bytes)
                chat = parse_chat_request(body, self.config.max_images_per_prompt, self.config.max_videos_per_prompt)
                mark("ingress.parsed", request_id)
                check_max_tokens(chat.sampling, self.config.max_tokens_limit)
                self._check_model(chat.model)
                tenant = tenant_of(request.headers, self.config.tenant_header)
                media = await self._features(chat, tenant)
                mark("ingress.features_ready", request_id)
                chunks = await self._start_decode(chat, media, request_id, start, tenant)
                mark("ingress.first_token", request_id)
        except IrisError as err:
            return self._error(err)
        except Exception as err:  # past the deadline (504), a dead replica (503), a bug (500)
            return self._error(self._failure(err, "chat completion failed"))
        headers = {"x-iris-images": f"cached={media.cached},computed={media.computed}"}
        chunks = _until(deadline, chunks)
        if chat.stream:
            return StreamingResponse(self._sse(self._stream(chat, request_id, chunks), chunks),
                                     media_type="text/event-stream", headers=headers)
        return await self._collect(request_id, chunks, headers)

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        """Text prompts, with the chat endpoint's sampling surface (vLLM's CompletionRequest)."""
        start = time.perf_counter()
        deadline = asyncio.get_running_loop().time() + self.config.request_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                body = await _json_body(request, self.max_body_bytes)
                req = validate_sampling(body, "completion")
                check_max_tokens(req, self.config.max_tokens_limit)
                prompt = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
                if not isinstance(prompt, str):
                    raise bad_request("prompt must be a string (token ids and batches are not supported)",
                                      param="prompt")
                self._check_model(req.model)
                request_id = f"cmpl-{uuid.uuid4().hex}"
                tenant = tenant_of(request.headers, self.config.tenant_header)
                stream = self.decode.options(stream=True).generate.remote(
                    DecodeRequest(request_id, None, [], req, tenant=tenant, prompt=prompt))
                first: DecodeChunk = await _first_chunk(stream)
                if first.error:
                    raise bad_request(first.error["message"], param=first.error.get("param"),
                                      code=first.error["code"])
                self.ttft.observe(time.perf_counter() - start)
                chunks = _prepend(first, stream)
        except IrisError as err:
            return self._error(err)
        except Exception as err:  # past the deadline (504), a dead replica (503), a bug (500)
            return self._error(self._failure(err, "completion failed"))
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        chunks = _until(deadline, chunks)
        if req.stream:
            return StreamingResponse(self._sse(self._text_stream(request_id, chunks, include_usage), chunks),
                                     media_type="text/event-stream")
        return await self._text_collect(request_id, chunks)

    @app.post("/tokenize")
    async def tokenize(self, request: Request):
        """vLLM's /tokenize: a text prompt, or text-only chat messages through the chat template."""
        try:
            job = parse_tokenize_request(await _json_body(request, self.max_body_bytes),
                                         self.config.max_images_per_prompt)
            self._check_model(job.model)
            result = await self.decode.tokenize.remote(job)
            if isinstance(result, IrisError):
                raise result
        except IrisError as err:
            return self._error(err)
        except Exception as err:  # a dead replica (503), a bug (500)
            return self._error(self._failure(err, "tokenize failed"))
        return JSONResponse(result)

    @app.post("/detokenize")
    async def detokenize(self, request: Request):
        try:
            req = parse_detokenize_request(await _json_body(request, self.max_body_bytes))
            self._check_model(req.model)
            return JSONResponse(await self.decode.detokenize.remote(req.tokens))
        except IrisError as err:
            return self._error(err)
        except Exception as err:  # a dead replica (503), a bug (500)
            return self._error(self._failure(err, "detokenize failed"))

    def _check_model(self, name: str | None) -> None:
        if name and name != self.config.model_name:
            raise not_found(f"The model `{name}` does not exist; this server serves "
                            f"`{self.config.model_name}`.", param="model", code="model_not_found")

    # --- images and videos -------------------------------------------------------
    async def _get_fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint, self._modalities = await asyncio.gather(
                self.encoder.get_fingerprint.remote(), self.encoder.get_modalities.remote())
        return self._fingerprint

    async def _features(self, chat: ParsedChat, tenant: str) -> RequestMedia:
        """Keys of the request's images and videos; runs Preprocess + VisionEncoder for the misses only."""
        if not chat.media:
            return RequestMedia([], [])
        fingerprint = await self._get_fingerprint()
        for item in chat.media:
            if item.modality not in self._modalities:
                raise bad_request(f"this model takes no {item.modality} input (it takes "
                                  f"{', '.join(self._modalities)})", param=item.name, code=f"unsupported_{item.modality}")
        datas = list(await asyncio.gather(*(
            load_media_bytes(item.url, self.config.media, self.http, param=item.name, modality=item.modality)
            if item.url is not None else _none() for item in chat.media)))
        keys = [await self._key(fingerprint, tenant, item, data) for item, data in zip(chat.media, datas)]
        media = RequestMedia(keys, datas, [item.name for item in chat.media], [item.modality for item in chat.media])
        unique = list(dict.fromkeys(keys))
        unknown = [k for k in unique if k not in self._known and k not in self._inflight]
        present = dict(zip(unknown, await self.cache.contains_many(unknown))) if unknown else {}
        mark("ingress.looked_up")
        self.cache_metrics.export()
        missing = [item for item, key in zip(chat.media, keys)
                   if item.url is None and key in present and not present[key]]
        if missing:
            raise _cache_miss([item.index for item in missing], [item.name for item in missing])
        for key in unknown:
            if present[key]:
                self._remember(key)
        to_compute = [k for k in unknown if not present[k]]
        await self._encode(media, to_compute, joined=[k for k in unique if k in self._inflight
                                                       and k not in to_compute])
        media.cached = len(unique) - media.computed
        for source, n in (("cached", media.cached), ("computed", media.computed)):
            if n:
                self.images.inc(n, tags={"source": source})
                self.counts[f"images_{source}"] += n
        return media

    async def _key(self, fingerprint: str, tenant: str, item, data: bytes | None) -> str:
        namespace = self.config.cache.namespace
        try:
            if item.uuid:
                return uuid_key(fingerprint, tenant, item.uuid, namespace, item.modality)
        except ValueError as err:
            raise bad_request(str(err), param=f"{item.name}.uuid", code="invalid_uuid") from err
        # Content keys private to the tenant unless sharing is configured (threat model in README).
        owner = None if self.config.share_content_cache_across_tenants else tenant
        try:
            if len(data) >= HASH_IN_THREAD_BYTES:  # keep the event loop free for other streams
                return await asyncio.to_thread(content_key, fingerprint, data, namespace, owner, item.modality)
            return content_key(fingerprint, data, namespace, owner, item.modality)
        except ValueError as err:  # e.g. an over-long tenant header
            raise bad_request(str(err), param=None, code="invalid_tenant") from err

    def _remember(self, key: str) -> None:
        if not self.cache.redis_available:
            return  # features live in some replica's memory only: ask every time (a 409 stays a 409)
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    async def _encode(self, media: RequestMedia, keys: list[str], joined: list[str] = ()) -> None:
        """Preprocess + encode the images and videos with these keys, each once across concurrent requests;
        `joined` keys are being computed for another request: wait for those. The features'
        references land in `media.delivered`."""
        joined, own = list(joined), []
        for key in keys:  # another request may have started or finished a key while we awaited
            if key in self._inflight:
                joined.append(key)
            elif key not in self._known:
                index = media.keys.index(key)
                self._start_encode(MediaJob(media.names[index], key, media.datas[index], media.modalities[index]))
                own.append(key)
        names = own + joined
        results = await asyncio.gather(*(self._join(k) for k in names), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        media.computed += len(own)
        media.delivered.update({r.key: r.features_ref for r in results})

    def _start_encode(self, job: MediaJob) -> None:
        # A context of its own: Serve cancels the calls a request made when the request is
        # cancelled, but other requests may join this work. It stops when its last waiter leaves.
        self._inflight[job.key] = asyncio.get_running_loop().create_task(
            self._encode_one(job), context=contextvars.Context())

    async def _join(self, key: str) -> EncodedMedia:
        """Wait for the running encode of `key`; the last waiter to leave (timeout,
        disconnect) cancels it, so no stage keeps working for nobody."""
        task = self._inflight[key]
        self._waiters[key] += 1
        try:
            return await asyncio.shield(task)  # one waiter leaving must not cancel it for the others
        finally:
            self._waiters[key] -= 1
            if not self._waiters[key]:
                del self._waiters[key]
                task.cancel()  # a no-op once it is done

    async def _encode_one(self, job: MediaJob) -> EncodedMedia:
        try:
            # Serve passes Preprocess's pending result into the encoder call (model composition):
            # the pixels go through the object store, and Preprocess is free once they are made.
            pixels = self.preprocess.pixels.remote(job)
            encoded = self.encoder.encode.remote(job.key, pixels)
            try:
                result = await encoded
            except asyncio.CancelledError:
                encoded.cancel()  # stop the replicas' work too (queued encoder batches drop it)
                pixels.cancel()
                raise
            if isinstance(result, IrisError):
                if result.code == "model_changed":
                    self._fingerprint = None  # keys of later requests use the new weights' fingerprint
                raise result
            self._remember(job.key)
            return result
        finally:
            del self._inflight[job.key]

    # --- decode ---------------------------------------------------------------
    async def _start_decode(self, chat: ParsedChat, media: RequestMedia, request_id: str, start: float,
                            tenant: str):
        """The decode stream with its first chunk already received, so that errors
        become a proper status code even for streaming requests."""
        messages = template_messages(chat)
        for attempt in range(2):
            request = DecodeRequest(request_id, messages, media.keys, chat.sampling, media.delivered, tenant,
                                    modalities=media.modalities)
            stream = self.decode.options(stream=True).generate.remote(request)
            first: DecodeChunk = await _first_chunk(stream)
            if first.error and first.error["code"] == "model_changed":
                self._fingerprint = None  # later requests key their images for the new weights
                raise IrisError(first.error["message"], status_code=503, code="model_changed")
            if first.error:
                raise bad_request(first.error["message"], param=first.error.get("param"), code=first.error["code"])
            if not first.missing_keys:
                self.ttft.observe(time.perf_counter() - start)
                return _prepend(first, stream)
            # Evicted since we saw it (or our memory of it was stale): recompute the ones
            # we have bytes for and hand them over directly; uuid-only ones are a miss.
            gone = set(first.missing_keys)
            for key in gone:
                self._known.pop(key, None)
            upload_free = [i for i, (key, data) in enumerate(zip(media.keys, media.datas))
                           if key in gone and data is None]
            if upload_free:
                raise _cache_miss(upload_free, [media.names[i] for i in upload_free])
            if attempt == 0:  # (within the request's deadline, like all its work)
                await self._encode(media, [k for k in dict.fromkeys(media.keys) if k in gone])
        raise IrisError("image features could not be delivered to the decoder", status_code=503,
                        code="features_unavailable")

    async def _gather(self, chunks, join_logprobs, what: str) -> tuple[dict, openai_format.Usage] | JSONResponse:
        """A non-streamed answer's choices by index ({"text": [...], "finish", "stop", "logprobs"})
        and usage, or the error response. The decode stream is closed whatever happens, also
        on cancellation (the client left), which aborts the decode request."""
        choices: dict[int, dict] = {}
        usage = openai_format.Usage()
        try:
            async for c in chunks:
                if c.error:
                    return self._error(bad_request(c.error["message"], param=c.error.get("param"),
                                                   code=c.error["code"]))
                ch = choices.setdefault(c.index, {"text": [], "finish": None, "stop": None, "logprobs": None})
                ch["text"].append(c.text)
                if c.logprobs is not None:
                    ch["logprobs"] = join_logprobs(ch["logprobs"], c.logprobs)
                if c.finish_reason:
                    ch["finish"], ch["stop"] = c.finish_reason, c.stop_reason
                if c.done:
                    usage = openai_format.Usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
        except Exception as err:
            return self._error(self._failure(err, f"{what} failed while decoding"))
        finally:
            await chunks.aclose()
        self._outcome("ok")
        return choices, usage

    async def _collect(self, request_id, chunks, headers):
        gathered = await self._gather(chunks, lambda old, new: (old or []) + new, "chat completion")
        if isinstance(gathered, JSONResponse):
            return gathered
        choices, usage = gathered
        body = openai_format.completion(request_id, self.config.model_name, [
            openai_format.choice(i, "".join(ch["text"]), ch["finish"], ch["stop"], ch["logprobs"])
            for i, ch in sorted(choices.items())], usage)
        return JSONResponse(body, headers=headers)

    async def _stream(self, chat, request_id, chunks):
        model = self.config.model_name
        for i in range(chat.sampling.n or 1):
            yield openai_format.chunk(request_id, model, {"role": "assistant", "content": ""}, index=i)
        async for c in chunks:
            if c.error:  # the engine rejected the request after the stream started
                self._outcome("client_error")
                yield openai_format.sse(bad_request(c.error["message"], code=c.error["code"]).to_dict())
                return
            if c.text or c.finish_reason or c.logprobs:
                delta = {"content": c.text} if c.text else {}
                yield openai_format.chunk(request_id, model, delta, c.finish_reason, index=c.index,
                                          logprobs=c.logprobs, stop_reason=c.stop_reason)
            if c.done and chat.include_usage:
                usage = openai_format.Usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
                yield openai_format.chunk(request_id, model, {}, usage=usage, choices=False)
        self._outcome("ok")

    async def _text_collect(self, request_id, chunks):
        gathered = await self._gather(chunks, extend_completion_logprobs, "completion")
        if isinstance(gathered, JSONResponse):
            return gathered
        choices, usage = gathered
        return JSONResponse(openai_format.text_completion(request_id, self.config.model_name, [
            openai_format.text_choice(i, "".join(ch["text"]), ch["finish"], ch["stop"], ch["logprobs"])
            for i, ch in sorted(choices.items())], usage))

    async def _text_stream(self, request_id, chunks, include_usage: bool):
        model = self.config.model_name
        async for c in chunks:
            if c.error:
                self._outcome("client_error")
                yield openai_format.sse(bad_request(c.error["message"], code=c.error["code"]).to_dict())
                return
            if c.text or c.finish_reason or c.logprobs:
                yield openai_format.text_chunk(request_id, model, [
                    openai_format.text_choice(c.index, c.text, c.finish_reason, c.stop_reason, c.logprobs)])
            if c.done and include_usage:
                usage = openai_format.Usage(c.prompt_tokens, c.completion_tokens, c.cached_tokens)
                yield openai_format.text_chunk(request_id, model, [], usage=usage)
        self._outcome("ok")

    async def _sse(self, events, chunks):
        """The body of a streamed answer: the events, then [DONE]. Once the stream has
        started, a failure (the deadline, a dead replica) is reported in-band, as OpenAI
        does; the decode stream is closed whatever happens (a client that leaves aborts it)."""
        try:
            async for event in events:
                yield event
            yield openai_format.DONE
        except Exception as err:
            error = self._failure(err, "stream failed")
            self._outcome("server_error")
            yield openai_format.sse(error.to_dict())
            yield openai_format.DONE
        finally:
            await chunks.aclose()

    def _failure(self, err: BaseException, what: str) -> IrisError:
        """What the client sees of an unexpected exception: 504 past the request's deadline,
        503 when a replica of a stage died under it, 500 for anything else (a bug)."""
        if isinstance(err, TimeoutError):
            return _timed_out(self.config.request_timeout_s)
        if _stage_failed(err):
            logger.warning("%s: a replica failed: %r", what, err)
            return _replica_unavailable()
        logger.error("%s", what, exc_info=err)
        return server_error("internal error", code="internal_error")

    def _error(self, err: IrisError) -> JSONResponse:
        self._outcome("cache_miss" if err.code == "mm_cache_miss" else
                      "client_error" if err.status_code < 500 else "server_error")
        return JSONResponse(err.to_dict(), status_code=err.status_code)

    def _outcome(self, outcome: str) -> None:
        self.counts[f"requests_{outcome}"] += 1
        self.requests.inc(tags={"outcome": outcome})
