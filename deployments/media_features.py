"""MediaFeatures: the ingress's one owner of a request's image and video features.

Per request: fetch the bytes, key each item (content hash, or the client's uuid),
ask the cache which keys are present, and send only the misses to Preprocess ->
VisionEncoder. Upload-free items (uuid only) that are not cached end the request
with 409 `mm_cache_miss` before any work is done.

LLMDecode is called as soon as the VisionEncoder calls are routed, with their result
references: it waits for the features itself, so its call and the prompt's tokenization
overlap the forward pass instead of following it (bench/results/video/README.md).
Serve routes an encoder call once Preprocess's pixels exist, so a request holds one of
LLMDecode's slots (`max_ongoing_requests`, what its autoscaling counts) while its pixels
cross to the encoder and are encoded, never while they wait in Preprocess.

Each key is computed once across concurrent requests on this replica (the encoder's
cache adds the same across replicas). Keys seen computed or present are remembered,
so a repeated image costs no presence check; should one be gone by the time LLMDecode
reads it, the decode says so and the ingress has it `recompute`d once (or answers 409
for an upload-free item).

The fingerprint of the encoder's weights is part of every key; it comes from the
VisionEncoder, and is asked again after a stage says the model changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections import OrderedDict
from dataclasses import dataclass, field

from ray.serve.handle import DeploymentHandle

from cache_service.feature_cache import FeatureCache
from cache_service.keys import InvalidContentUuid, item_key, parse_content_uuid
from deployments import tracing
from deployments.config import IrisConfig
from deployments.failures import stage_failed
from deployments.metrics import CacheMetrics, RequestMetrics
from deployments.stage_trace import mark
from pipeline.api.media_parts import MediaItem
from pipeline.errors import MODEL_CHANGED, IrisError, bad_request
from pipeline.media.fetch import fetch_client, load_media_bytes
from pipeline.model.embedding_form import CONNECTOR
from pipeline.model.keyed_media import keyed_part
from pipeline.stage_io import EncodedMedia, MediaJob

# Keys remembered as present; ~100 bytes each. Being wrong costs one retry (see recompute).
KNOWN_KEYS = 100_000
# Items at least this large are hashed in a thread; below, the thread hop costs more than the hash.
HASH_IN_THREAD_BYTES = 256 * 1024


@dataclass
class RequestMedia:
    """A request's images and videos, in prompt order (each with its bytes and key), and how
    their features were obtained."""

    items: list[MediaItem] = field(default_factory=list)
    tenant: str = "default"
    # key -> ObjectRef of the VisionEncoder call computing it for this request (EncodedMedia or IrisError)
    delivered: dict = field(default_factory=dict)
    encodes: asyncio.Future | None = None  # this request's encodes (own and joined); None: nothing to wait for
    encodings: dict = field(default_factory=dict)  # key -> the Encoding this request waits for
    cached: int = 0  # distinct items found in the cache (or computed by a concurrent request)
    computed: int = 0  # distinct items sent to Preprocess + VisionEncoder by this request

    @property
    def keys(self) -> list[str]:
        return [item.key for item in self.items]

    @property
    def modalities(self) -> list[str]:
        return [item.modality for item in self.items]

    def take_encodes(self) -> asyncio.Future | None:
        """The encodes started since the last call, for the decode call to wait beside."""
        encodes, self.encodes = self.encodes, None
        return encodes


@dataclass
class Encoding:
    """One key's encode in flight on this replica, shared by the requests that need it."""

    submitted: asyncio.Task  # -> the ObjectRef of the VisionEncoder call's result, once Serve has routed it
    done: asyncio.Task  # -> its EncodedMedia


class EncodeLost(Exception):
    """A replica of Preprocess or VisionEncoder died under the encode of `key` (its cause says
    how): nothing is wrong with the item, so the request may compute it again, once."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the encode of {key} was lost with its replica")
        self.key = key


def cache_miss(indexes: list[int], names: list[str]) -> IrisError:
    """`indexes`: positions among the request's images and videos; `names` say which."""
    what = "image(s)" if all(n.startswith("image[") for n in names) else f"item(s) {names} at"
    return IrisError(
        f"{what} {indexes} were sent by uuid only and are not in the feature cache; "
        "send the bytes with the same uuid again",
        status_code=409,
        param="messages",
        code="mm_cache_miss",
        extra={"missing": indexes},
    )


async def all_or_none(aws: list) -> list:
    """The results of `aws`, run together. At the first error the others are cancelled (and
    awaited: their fetches and encodes have stopped) and that error is raised, so a request with
    one bad item does no more work for the others; also when the request itself is cancelled."""
    tasks = [asyncio.ensure_future(aw) for aw in aws]
    if not tasks:
        return []
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [task for task in tasks if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
    errors = [task.exception() for task in tasks if not task.cancelled() and task.exception() is not None]
    if errors:
        raise errors[0]
    return [task.result() for task in tasks]


class MediaFeatures:
    def __init__(
        self,
        config: IrisConfig,
        preprocess: DeploymentHandle | None,
        encoder: DeploymentHandle | None,
        metrics: RequestMetrics,
    ):
        """`preprocess` and `encoder` None: a text-only model, whose requests may hold no media."""
        self.config = config
        self.preprocess = preprocess
        self.encoder = encoder
        self.metrics = metrics
        # The ingress only asks which keys exist; it never holds features.
        self.cache = FeatureCache(config.cache.model_copy(update={"l1_max_bytes": 0}))
        self.cache_metrics = CacheMetrics(self.cache)
        self.http = fetch_client(config.media)  # SSRF-guarded: public addresses unless allowed
        self._fingerprint: str | None = None
        self._modalities: dict[str, str] = {}  # what the model takes -> delivery, asked with the fingerprint
        self._inflight: dict[str, Encoding] = {}  # key -> its running encode
        self._waiters: dict[str, int] = {}  # key -> requests waiting for its running encode
        self._known: OrderedDict[str, None] = OrderedDict()  # LRU of keys known to be stored

    async def resolve(self, items: list[MediaItem], tenant: str) -> RequestMedia:
        """Keys of the request's items, with the misses computed (their references in `delivered`)."""
        if not items:
            return RequestMedia()
        fingerprint = await self._get_fingerprint()
        for item in items:
            if item.modality not in self._modalities:
                takes = ", ".join(self._modalities) or "text only"
                raise bad_request(
                    f"this model takes no {item.modality} input (it takes {takes})",
                    param=item.name,
                    code=f"unsupported_{item.modality}",
                )
        with tracing.span("ingress.fetch"):
            self.metrics.fetched(sum(item.url is not None for item in items))
            fetched = iter(
                await all_or_none(
                    [  # one refused: the others' fetches stop
                        load_media_bytes(
                            item.url, self.config.media, self.http, param=item.name, modality=item.modality
                        )
                        for item in items
                        if item.url is not None
                    ]
                )
            )
            datas = [next(fetched) if item.url is not None else None for item in items]
        with tracing.span("ingress.cache_lookup") as lookup:
            for item, data in zip(items, datas):
                item.data = data
                item.key = await self._key(fingerprint, tenant, item, data)
            keys = [item.key for item in items]
            media = RequestMedia(items, tenant)
            unique = list(dict.fromkeys(keys))
            unknown = [k for k in unique if k not in self._known and k not in self._inflight]
            present = dict(zip(unknown, await self.cache.contains_many(unknown))) if unknown else {}
            if lookup.is_recording():  # by where each distinct item was found
                hits = sum(present.values())
                lookup.set_attributes(
                    {
                        "iris.cache.items": len(unique),
                        "iris.cache.upload_free": datas.count(None),
                        "iris.cache.known": sum(k in self._known for k in unique),  # remembered present: not asked
                        "iris.cache.in_flight": sum(k in self._inflight for k in unique),  # being computed here
                        "iris.cache.redis_hits": hits,
                        "iris.cache.misses": len(present) - hits,
                    }
                )
        mark("ingress.looked_up")
        self.cache_metrics.export()
        missing = [item for item in items if item.url is None and item.key in present and not present[item.key]]
        if missing:
            raise cache_miss([item.index for item in missing], [item.name for item in missing])
        for key in unknown:
            if present[key]:
                self._remember(key)
        to_compute = [k for k in unknown if not present[k]]
        await self._encode(media, to_compute, joined=[k for k in unique if k in self._inflight and k not in to_compute])
        media.cached = len(unique) - media.computed
        self.metrics.media(media.cached, media.computed)
        return media

    async def recompute(self, media: RequestMedia, gone: list[str], encode: bool = True) -> None:
        """Forget `gone` keys, which vanished from the cache since they were looked up (evicted, or
        this replica's memory was stale), and compute their features again (`encode`); 409 for
        items sent by uuid only."""
        gone = set(gone)
        for key in gone:
            self._known.pop(key, None)
        upload_free = [item for item in media.items if item.key in gone and item.data is None]
        if upload_free:
            raise cache_miss([item.index for item in upload_free], [item.name for item in upload_free])
        if encode:
            await self._encode(media, [k for k in dict.fromkeys(media.keys) if k in gone])

    async def encode_again(self, media: RequestMedia) -> None:
        """After an EncodeLost: start again every encode of this request that did not finish (the
        lost one, and those stopped with it when the request stopped waiting)."""
        unfinished = [
            k for k, e in media.encodings.items() if not e.done.done() or e.done.cancelled() or e.done.exception()
        ]
        await self._encode(media, unfinished)

    def forget_model(self) -> None:
        """A stage said the model changed: later requests key their items for the new weights."""
        self._fingerprint = None

    def key_parts(self, items: list[MediaItem]) -> None:
        """Each media part, in place, becomes the part that names its key for LLMDecode's vLLM: its
        embeddings where vLLM takes them, else the item itself (Iris's EC connector brings the features)."""
        for item in items:
            item.part.clear()
            item.part.update(keyed_part(item.modality, item.key, self._modalities.get(item.modality) != CONNECTOR))

    async def model(self) -> dict:
        """The encoder's fingerprint (what a plain `vllm serve` with Iris's EC connector needs to
        read these keys: docs/families.md) and how each modality's features reach the decoder."""
        return {"fingerprint": await self._get_fingerprint() or None, "features_to_decoder": dict(self._modalities)}

    async def _get_fingerprint(self) -> str:
        if self.encoder is None:  # a text-only model: no key is made, every item is refused
            return ""
        if self._fingerprint is None:
            self._fingerprint, self._modalities = await asyncio.gather(
                self.encoder.get_fingerprint.remote(), self.encoder.get_modalities.remote()
            )
        return self._fingerprint

    async def _key(self, fingerprint: str, tenant: str, item, data: bytes | None) -> str:
        """The item's key (cache_service/keys.py item_key): its uuid's, or the content key of its
        bytes or of the `blake3:<hash>` content uuid it names (checked against bytes sent with it)."""
        # Content keys private to the tenant unless sharing is configured (docs/security.md).
        owner = None if self.config.share_content_cache_across_tenants else tenant
        key = functools.partial(
            item_key,
            fingerprint,
            tenant,
            item.uuid,
            data,
            namespace=self.config.cache.namespace,
            modality=item.modality,
            content_owner=owner,
        )
        try:
            hashes = data is not None and (not item.uuid or parse_content_uuid(item.uuid) is not None)
            if hashes and len(data) >= HASH_IN_THREAD_BYTES:  # keep the event loop free for other streams
                return await asyncio.to_thread(key)
            return key()
        except InvalidContentUuid as err:
            raise bad_request(str(err), param=f"{item.name}.uuid", code="invalid_content_uuid") from err
        except ValueError as err:  # an over-long uuid or tenant header
            if item.uuid:
                raise bad_request(str(err), param=f"{item.name}.uuid", code="invalid_uuid") from err
            raise bad_request(str(err), param=None, code="invalid_tenant") from err

    def _remember(self, key: str) -> None:
        if not self.cache.redis_available:
            return  # features live in some replica's memory only: ask every time (a 409 stays a 409)
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > KNOWN_KEYS:
            self._known.popitem(last=False)

    async def _encode(self, media: RequestMedia, keys: list[str], joined: list[str] = ()) -> None:
        """Start Preprocess + VisionEncoder for the items with these keys, each once across
        concurrent requests; `joined` keys are being computed for another request. Returns once
        every call is routed, with their result references in `media.delivered`; the encodes
        themselves finish in `media.encodes`."""
        joined, own = list(joined), []
        for key in keys:  # another request may have started or finished a key while we awaited
            if key in self._inflight:
                joined.append(key)
            elif key not in self._known:
                item = next(item for item in media.items if item.key == key)
                job = MediaJob(
                    item.name,
                    key,
                    item.data,
                    item.modality,
                    media.tenant,
                    keep_source=self._modalities.get(item.modality) == CONNECTOR,
                    trace=tracing.carrier(),
                )
                self._inflight[key] = self._start(job)
                own.append(key)
        if not own and not joined:
            return
        media.computed += len(own)
        waiting = own + joined
        encodings = [self._inflight[k] for k in waiting]
        media.encodings.update(zip(waiting, encodings))
        # One encode's error is the request's answer: the request stops waiting for the others
        # (each stops when no other request waits for it).
        media.encodes = asyncio.ensure_future(all_or_none([self._join(k, e) for k, e in zip(waiting, encodings)]))
        try:
            refs = await asyncio.gather(*(asyncio.shield(e.submitted) for e in encodings))
        except BaseException:
            media.encodes.cancel()  # the waiters leave: encodes nobody else waits for stop
            with contextlib.suppress(BaseException):
                await media.encodes
            raise
        media.delivered.update(zip(waiting, refs))

    def _start(self, job: MediaJob) -> Encoding:
        # A context of its own: Serve cancels the calls a request made when the request is
        # cancelled, but other requests may join this work. It stops when its last waiter leaves.
        context, loop = contextvars.Context(), asyncio.get_running_loop()
        # Serve passes Preprocess's pending result into the encoder call (model composition):
        # the pixels go through the object store, and Preprocess is free once they are made.
        pixels = context.run(self.preprocess.pixels.remote, job)
        self.metrics.preprocess_called()
        encoded = context.run(self.encoder.encode.remote, job.key, pixels, job.tenant, job.trace, job.name)
        submitted = loop.create_task(encoded._to_object_ref(), context=context)
        return Encoding(submitted, loop.create_task(self._finish(job, pixels, encoded, submitted), context=context))

    async def _join(self, key: str, encoding: Encoding) -> EncodedMedia:
        """Wait for the running encode of `key`; the last waiter to leave (timeout,
        disconnect) cancels it, so no stage keeps working for nobody."""
        task = encoding.done
        self._waiters[key] = self._waiters.get(key, 0) + 1
        try:
            return await asyncio.shield(task)  # one waiter leaving must not cancel it for the others
        finally:
            self._waiters[key] -= 1
            if not self._waiters[key]:
                del self._waiters[key]
                task.cancel()  # a no-op once it is done

    async def _finish(self, job: MediaJob, pixels, encoded, submitted: asyncio.Task) -> EncodedMedia:
        try:
            try:
                await submitted
                result = await encoded
            except asyncio.CancelledError:
                encoded.cancel()  # stop the replicas' work too (queued encoder batches drop it)
                pixels.cancel()
                raise
            except Exception as err:
                if stage_failed(err):
                    raise EncodeLost(job.key) from err
                raise
            if isinstance(result, IrisError):
                if result.code == MODEL_CHANGED:
                    self.forget_model()
                raise result
            self._remember(job.key)
            return result
        finally:
            del self._inflight[job.key]
