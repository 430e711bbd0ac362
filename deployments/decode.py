"""LLMDecode: vLLM's own OpenAI serving layer over an AsyncLLM, fed Iris's image and video features.

vLLM's serving objects (chat completions, completions, the Responses API, tokenize, models with
LoRA adapters) are built in process from the engine, as `vllm serve` builds them
(`init_app_state`, with vLLM's own parsed command line: deployments/vllm_args.py), so tools,
reasoning parsers, chat templates and vLLM's errors are vLLM's. The ingress hands each request
over with its images and videos replaced by parts that name their cache keys; this replica
resolves them (pipeline/model/keyed_media.py) to the features the ingress's encoder calls
computed for the request (object-store references, kept in this replica's L1 for the next
request) or to what the cache holds. The keys are the parts' uuids, vLLM's `multi_modal_uuids`,
so its prefix cache knows an image or clip it has seen before, whichever replica computed it.
For a modality vLLM takes no embeddings for, the engine gets the item itself (from the bytes the
features carry) and Iris's EC connector in the engine takes the features from a staging folder
this replica writes (pipeline/model/ec_staging.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

import torch
from ray import serve
from ray.serve.exceptions import RayServeException

from cache_service.feature_cache import FeatureCache
from cache_service.keys import fingerprint_of
from cache_service.validation import ValueCheck
from deployments import engine_usage, tracing
from deployments.config import IrisConfig
from deployments.cpu_binding import omp_threads_bind, rank_binds
from deployments.metrics import CacheMetrics
from deployments.placement import Placement, group_problem
from deployments.stage_trace import mark
from deployments.vllm_args import REQUIRED, serve_args
from pipeline.api.stream_merge import merged_outputs
from pipeline.errors import IrisError, model_changed
from pipeline.model import keyed_media
from pipeline.model.ec_connector import connector_counts, ec_transfer_config
from pipeline.model.ec_staging import FeatureStaging
from pipeline.model.embedding_form import CONNECTOR
from pipeline.model.engine_settings import model_differences
from pipeline.model.source import resolve_model
from pipeline.stage_io import DecodeCall, DecodeDone, DecodeOpened, EncodedMedia
from pipeline.tenancy.tenant import cache_salt

logger = logging.getLogger("ray.serve")
# A request that ends without its first chunk after this long is logged (a deadline, a client that left).
SLOW_FIRST_OUTPUT_S = 5.0
PLACEHOLDER_MISSING = "Failed to apply prompt replacement"  # vLLM's words for an item its prompt has no place for
# Iris's defaults for vLLM flags a user may still set: usage reports prefix-cache hits
# (`prompt_tokens_details.cached_tokens`), which is what Iris's caches are for.
DEFAULT_FLAGS = {"enable_prompt_tokens_details": True}
# Iris's routes -> vLLM's serving object, its method, and the API's name in vLLM's refusal.
VLLM_ROUTES = {
    "chat": ("openai_serving_chat", "create_chat_completion", "Chat Completions"),
    "completion": ("openai_serving_completion", "create_completion", "Completions"),
    "responses": ("openai_serving_responses", "create_responses", "Responses"),
    "tokenize": ("serving_tokenization", "create_tokenize", "Tokenize"),
    "detokenize": ("serving_tokenization", "create_detokenize", "Detokenize"),
}


def engine_flags(config: IrisConfig, vision, connector: dict) -> dict:
    """LLMDecode's `vllm serve` flags: the user's engine_args (whose model part every stage loads),
    Iris's defaults and requirements, and what Iris sets itself. `vision` None: a text-only model
    (no media limits; config.dtype, "auto" resolved by vLLM)."""
    iris_flags = {"served_model_name": [config.model_name], "dtype": config.dtype}
    if vision is not None:
        iris_flags["dtype"] = str(vision.dtype).removeprefix("torch.")
        iris_flags["limit_mm_per_prompt"] = {m: vision.limits[m] for m in vision.modalities}
    return {
        **DEFAULT_FLAGS,
        **tracing.vllm_engine_args(config.tracing, config.engine_args),
        **config.engine_args,
        **config.decode_ranks().engine_flags(),
        **REQUIRED,
        **connector,
        **iris_flags,
    }


@serve.deployment(ray_actor_options={"num_cpus": 1})
class LLMDecode:
    async def __init__(self, config: IrisConfig):  # async: the engine's warm-up runs a request
        from ray.serve import metrics
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import PrometheusStatLogger
        from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

        ranks = config.decode_ranks()  # vLLM's ranks of this replica and the group Serve reserved for them
        _check_group(ranks)
        _bind_engine_cores(ranks.world_size)
        _model_in_engine_process()
        os.environ["VLLM_MEDIA_CONNECTOR"] = keyed_media.CONNECTOR_NAME  # media parts resolve to Iris's items
        tracing.setup(config.tracing, "decode")
        self.config = config
        # Where the model takes images or videos (vLLM's config says so: the one place that decides),
        # vLLM's view of them: the embedding form, the feature checks, and the encoder's fingerprint
        # (computed before the engine takes the device's memory). A text-only model is served here
        # alone: no features, no staging, no connector; a call with media keys is refused (`_generate`).
        self.vision = config.vision_model() if config.takes_media() else None
        self.fingerprint, self.staging, connector_widths = None, None, {}
        checkpoint, feature_problem = resolve_model(config.model), _takes_no_features
        if self.vision is not None:
            # Keys of other weights (a rolling update) are refused.
            self.fingerprint = self.vision.expected_fingerprint()
            # Modalities vLLM takes no embeddings for: the engine's EC connector reads their features
            # from a staging folder of this replica's.
            forms = self.vision.forms.items()
            connector_widths = {m: form.width for m, form in forms if form.delivery == CONNECTOR}
            self.staging = FeatureStaging() if connector_widths else None
            checkpoint, feature_problem = self.vision.checkpoint, self.vision.feature_problem
        connector = (
            {"ec_transfer_config": ec_transfer_config(self.staging.dir, connector_widths)} if self.staging else {}
        )
        self.args = serve_args(checkpoint, engine_flags(config, self.vision, connector))
        engine_args = AsyncEngineArgs.from_cli_args(self.args)
        # The engine loads what the other stages load (one set of model settings: engine_settings.py).
        differences = (
            model_differences(self.vision.vllm_config.model_config, engine_args.create_model_config())
            if self.vision is not None
            else []
        )
        if differences:
            raise RuntimeError(
                "LLMDecode's engine would load another model than Preprocess and the "
                "VisionEncoder: " + "; ".join(differences)
            )
        # vLLM's engine metrics as Ray metrics (what Ray Serve LLM exports), and in this process's
        # Prometheus registry, where the EC connector's counters are read (connector_counts).
        self.engine = AsyncLLM.from_engine_args(
            engine_args, stat_loggers=[RayPrometheusStatLogger, PrometheusStatLogger]
        )
        self.engine.generate = engine_usage.counting(self.engine.generate)
        self.state = State()
        tasks = await self.engine.get_supported_tasks()
        await init_app_state(self.engine, self.state, self.args, supported_tasks=tasks)
        self._cap_max_tokens(config.max_tokens_limit)
        # Values read from Redis must carry the fingerprint of their key and look like this
        # model's features: a forged or stale entry is a miss, never an input.
        self.cache = FeatureCache(config.cache, check=ValueCheck(feature_problem))
        self.cache_metrics = CacheMetrics(self.cache)
        self.prefix_hit_tokens = metrics.Counter(
            "iris_vllm_prefix_cache_hit_tokens", description="Prompt tokens served from vLLM's prefix cache"
        )
        self.prompt_tokens = metrics.Counter("iris_vllm_prompt_tokens", description="Prompt tokens prefilled or cached")
        self.generating = 0  # generate() calls in progress on this replica
        self.left_early = 0  # generate() calls whose caller went away before the last chunk (client gone, deadline)
        await self._warm_up_logprobs()
        if "image" in connector_widths:
            await self._check_connector()

    def _cap_max_tokens(self, limit: int | None) -> None:
        """Iris's `max_tokens_limit` also bounds a request that names no max_tokens: vLLM's own
        override of the default (a generation_config's max_new_tokens), lowered to it."""
        if limit is None:
            return
        for name in ("openai_serving_chat", "openai_serving_completion", "openai_serving_responses"):
            serving = getattr(self.state, name, None)
            if serving is not None:
                serving.override_max_tokens = min(serving.override_max_tokens or limit, limit)

    async def _warm_up_logprobs(self) -> None:
        """vLLM compiles its logprobs kernel (torch.compile, `batched_count_greater_than`) on the
        first request that asks for logprobs, and its engine serves nobody while it compiles
        (seconds). One token with logprobs here moves that stall into start-up, before the
        replica takes traffic."""
        from vllm import SamplingParams

        started = time.monotonic()
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
        # 16 tokens, not 1: vLLM's CPU conv1d of hybrid models (Qwen3.5) fails on a 1-token prefill.
        tokens = [self.engine.renderer.tokenizer.bos_token_id or 0] * 16
        async for _ in self.engine.generate({"prompt_token_ids": tokens}, params, "iris-logprobs-warm-up"):
            pass
        logger.info("LLMDecode: vLLM's logprobs path warmed up in %.1f s", time.monotonic() - started)

    async def _check_connector(self) -> None:
        """One image through the EC connector before the replica takes traffic: the engine must
        take the features the encoder computed for it and never run its own tower. A family
        neither vLLM's embedding input nor the connector serves is refused here, naming why."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        arch = self.engine.model_config.architecture
        key = f"iris-connector-check-{os.getpid()}-{time.monotonic_ns()}"
        parts = [keyed_media.keyed_part("image", key, as_embeddings=False), {"type": "text", "text": "Describe."}]
        request = ChatCompletionRequest(
            model=self.config.model_name, max_tokens=1, messages=[{"role": "user", "content": parts}]
        )
        staged: list[str] = []
        try:
            items = await self._media_items([key], [self.vision.sample_features], ["image"], staged)
            with keyed_media.request_media(items):
                answer = await self.state.openai_serving_chat.create_chat_completion(request, None)
            if not hasattr(answer, "choices"):
                raise RuntimeError(answer.model_dump_json() if hasattr(answer, "model_dump_json") else repr(answer))
        except Exception as err:
            raise RuntimeError(
                f"{arch}: its engine failed on an image through Iris's EC connector, the one way "
                f"to it where vLLM takes no image embeddings ({type(err).__name__}: {err}); Iris "
                "cannot serve it"
            ) from err
        finally:
            self.staging.release(staged)
        for _ in range(50):  # vLLM's stat loggers record a step's connector stats just after its outputs
            counts = connector_counts()
            if counts["loaded"] + counts["encoded"]:
                break
            await asyncio.sleep(0.05)
        if (counts["loaded"], counts["encoded"]) != (1, 0):
            raise RuntimeError(
                f"{arch}: its engine did not take the encoder's features through Iris's EC "
                f"connector, the one way to it where vLLM takes no image embeddings ({counts}); "
                "Iris cannot serve it"
            )
        logger.info("LLMDecode: %s's features reach vLLM through Iris's EC connector", arch)

    async def generate(self, call: DecodeCall) -> AsyncIterator[DecodeOpened | str | DecodeDone]:
        """DecodeOpened; then, for a streamed answer, vLLM's SSE text (events merged per
        `stream_interval_s`, the first at once); then DecodeDone."""
        self.generating += 1
        started, sent, ended = time.monotonic(), False, False
        # Not the current span: it spans yields. vLLM's llm_request span is its child (trace_headers).
        span = tracing.start_span("decode", call.trace)
        usage = engine_usage.track()  # in this call's own context (Serve runs each call in a task of its own)
        try:
            async with aclosing(self._generate(call, tracing.carrier(span))) as messages:
                async for message in messages:
                    sent = True
                    yield message
            if span.is_recording():
                span.set_attributes(
                    {
                        "iris.prompt_tokens": usage.prompt_tokens,
                        "iris.completion_tokens": usage.completion_tokens,
                        "iris.cached_tokens": usage.cached_tokens,
                    }
                )
            ended = True
        finally:  # also when the caller cancels or leaves: closing vLLM's stream aborted the engine request
            span.end()
            self.generating -= 1
            self.left_early += not ended
            waited = time.monotonic() - started
            if not sent and waited > SLOW_FIRST_OUTPUT_S:
                # Says whether a first token the client never saw left this replica at all.
                logger.warning(
                    "a %s request ended after %.1f s without a first message from this replica "
                    "(requests vLLM holds now: %s)",
                    call.route,
                    waited,
                    self._unfinished(),
                )

    async def _generate(self, call: DecodeCall, trace: dict[str, str] | None) -> AsyncIterator:
        """`trace`: the decode span's context, the parent of this call's spans and vLLM's."""
        if call.media_keys and self.vision is None:  # the ingress never sends one: a text-only model
            yield DecodeOpened(error=_no_media(self.config.model_name, call.modalities))
            return
        if any(fingerprint_of(k) != self.fingerprint for k in call.media_keys):
            yield DecodeOpened(error=model_changed())  # keyed by an ingress that has not seen the update yet
            return
        with tracing.span("decode.features", trace):  # waits for this request's encodes, reads the cache
            features = await self._features(call)
        if isinstance(features, DecodeOpened):  # an encode's error, or keys to compute again
            yield features
            return
        staged: list[str] = []
        try:
            try:
                items = await self._media_items(call.media_keys, features, call.modalities, staged)
            except IrisError as err:
                yield DecodeOpened(error=err)
                return
            with keyed_media.request_media(items):
                answer = await self._serve(call, trace)
            if asyncio.current_task().cancelling():
                # vLLM's whole-answer path turns its caller's cancellation into a "Client disconnected"
                # error (its engine request aborted): the caller left, so end as a cancelled call does.
                raise asyncio.CancelledError
            usage = engine_usage.current()
            if not hasattr(answer, "__aiter__"):
                yield answer
            else:
                yield DecodeOpened()
                async with aclosing(
                    merged_outputs(answer, self.config.stream_interval_s, last=lambda event: "data: [DONE]" in event)
                ) as merged:
                    async for events in merged:
                        text = "".join(events)
                        if "data: [DONE]" in text:  # the engine is done: its counts go before the client's [DONE]
                            self._count_tokens(usage)
                            yield usage
                            yield text
                            return
                        yield text
        finally:
            if staged:  # the engine took the features in its prefill (or never will: the request ended)
                self.staging.release(staged)
        self._count_tokens(usage)
        yield usage

    async def _serve(self, call: DecodeCall, trace: dict[str, str] | None):
        """vLLM's answer: DecodeOpened with its JSON body or error, or its SSE stream."""
        from starlette.requests import Request

        headers = {**call.headers, **(trace or {})}
        # What vLLM reads of the HTTP request: X-Request-Id, the trace context.
        raw = Request(
            {
                "type": "http",
                "method": "POST",
                "path": "/",
                "query_string": b"",
                "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
            }
        )
        call.body.cache_salt = _salted(call.tenant, getattr(call.body, "cache_salt", None))
        mark("decode.engine_call")
        answer = await self._vllm(call.route, call.body, raw)
        if hasattr(answer, "__aiter__") and call.route == "responses":
            return _responses_sse(answer)
        return answer

    async def _vllm(self, route: str, body, raw=None):
        """vLLM's serving object for `route` answers `body`: DecodeOpened with its JSON body or its
        error (what vLLM's exception handlers answer with), or its stream."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

        serving, method, api = VLLM_ROUTES[route]
        try:
            handler = getattr(self.state, serving, None)
            if handler is None:
                raise NotImplementedError(f"The model does not support {api} API")
            answer = await getattr(handler, method)(body, raw)
        except Exception as err:
            answer = create_error_response(err)
        if hasattr(answer, "__aiter__"):
            return answer
        if isinstance(answer, ErrorResponse):
            if answer.error.code == 500 and PLACEHOLDER_MISSING in answer.error.message:
                # A chat template that places no token for an item (one that takes no video, say):
                # the request's input, not a fault of the server (`vllm serve` answers 500).
                answer.error.code, answer.error.type = 400, "BadRequestError"
            return DecodeOpened(status=answer.error.code, body=answer.model_dump_json())
        return DecodeOpened(body=answer.model_dump_json())

    async def _media_items(self, keys: list[str], features: list, modalities: list[str], staged: list[str]) -> dict:
        """key -> what vLLM's parser gets for the item's keyed part: its embedding input, or the item
        decoded from the bytes its features carry, with the features staged for the EC connector."""
        items = {}
        for key, f, modality in zip(keys, features, modalities):
            if key in items:
                continue
            if self.vision.forms[modality].delivery != CONNECTOR:
                items[key] = self.vision.embedding_item(f, modality)
                continue
            try:  # decoding an image or a clip is CPU work: off the event loop
                (items[key],) = await asyncio.to_thread(self.vision.source_items, [f], modality)
            except Exception as err:  # bytes Iris's own checks let through but vLLM's loader refuses
                raise IrisError(
                    f"vLLM cannot decode this {modality}: {err}", param="messages", code=f"invalid_{modality}"
                ) from None
            if self.staging.stage(key, f):  # else (/dev/shm full, say) the engine runs its own tower
                staged.append(key)
        return items

    async def _features(self, call: DecodeCall) -> list | DecodeOpened:
        """The features of the call's items in prompt order: those computed for it (kept in L1 for
        the next request), the rest from the cache. Else the message that ends the call: an encode's
        error, or the keys no longer in the cache (the ingress computes them again)."""
        keys = call.media_keys
        delivered = await self._delivered(call.delivered)
        for key, f in delivered.items():
            if isinstance(f, IrisError):  # the encode failed: the ingress answers with its error
                return DecodeOpened(error=f)
            self.cache.remember(key, f)
        features = [delivered.get(k) for k in keys]
        lookup = [k for k, f in zip(keys, features) if f is None]
        if not lookup:
            return features
        found = dict(zip(lookup, await self.cache.get_many(lookup)))
        self.cache_metrics.export()
        features = [f if f is not None else found[k] for k, f in zip(keys, features)]
        # A stored value of another modality than its key's (forged) counts as absent.
        missing = [k for k, f, m in zip(keys, features, call.modalities) if f is None or f.modality != m]
        return DecodeOpened(missing_keys=missing) if missing else features

    def _count_tokens(self, usage: DecodeDone) -> None:
        if usage.prompt_tokens:
            self.prompt_tokens.inc(usage.prompt_tokens)
        if usage.cached_tokens:
            self.prefix_hit_tokens.inc(usage.cached_tokens)

    async def _delivered(self, refs: dict) -> dict:
        """Key -> Features (or the encode's IrisError), from the references of the VisionEncoder
        calls the ingress made for this request, once they are done. A reference that cannot be
        fetched is left out: that key is read from the cache like any other."""
        encoded = await asyncio.gather(*refs.values(), return_exceptions=True)
        fetched = iter(
            await asyncio.gather(
                *(e.features_ref for e in encoded if isinstance(e, EncodedMedia)), return_exceptions=True
            )
        )
        delivered = {}
        for key, e in zip(refs, encoded):
            f = next(fetched) if isinstance(e, EncodedMedia) else e
            if isinstance(f, BaseException) and not isinstance(f, IrisError):
                # The reference is a shortcut, the cache the record: under heavy load Ray has
                # answered ReferenceCountingAssertionError for a live reference, an encoder
                # replica may have died since, or the ingress stopped that encode (it computes
                # it again when one of the request's encodes was lost with its replica).
                logger.warning(
                    "features of %s could not be fetched from the object store (%s); reading the cache",
                    key,
                    type(f).__name__,
                )
                continue
            delivered[key] = f
        return delivered

    def _unfinished(self) -> int | str:
        try:
            return self.engine.get_num_unfinished_requests()
        except Exception as err:  # a dead engine: say so rather than mask why the request ended
            return f"unknown ({type(err).__name__})"

    async def text(self, route: str, body) -> DecodeOpened:
        """vLLM's /tokenize and /detokenize (text prompts, text-only chat messages)."""
        return await self._vllm(route, body)

    def limits(self) -> dict:
        """What the ingress bounds a request's text by before parsing it (deployments/request_parsing.py)."""
        return {"max_model_len": self.engine.model_config.max_model_len}

    async def models(self) -> str:
        """vLLM's /v1/models: the served name and its LoRA adapters."""
        return (await self.state.openai_serving_models.show_available_models()).model_dump_json()

    async def health(self) -> None:
        """Raises when the engine is dead (vLLM's check_health), for the ingress's /health."""
        await self.engine.check_health()

    def stats(self) -> dict:
        # engine_unfinished: requests vLLM still holds (running or waiting); 0 once every caller
        # finished or went away, since a cancelled generate() aborts its engine request.
        stats = {
            "replica": serve.get_replica_context().replica_id.unique_id,
            "cache": self.cache.stats(),
            "generating": self.generating,
            "left_early": self.left_early,
            "engine_unfinished": self.engine.get_num_unfinished_requests(),
        }
        if self.staging is not None:  # items the connector supplied and items the engine's tower encoded
            stats["ec_connector"] = {
                **connector_counts(),
                "staged": self.staging.staged,
                "staging_failed": self.staging.failed,
            }
        return stats

    def forget_features(self, keys: list[str]) -> int:
        """Drop `keys` from this replica's memory; how many it held. With the keys deleted from Redis
        too, the cache has lost them (tests/test_client.py makes its upload-free misses so)."""
        return sum(self.cache.forget(key) for key in keys)

    def check_health(self) -> None:
        if self.engine.errored:
            raise RuntimeError(f"vLLM engine is dead: {self.engine.dead_error}")

    def __del__(self):
        # Serve calls this on graceful shutdown; without it vLLM's engine processes outlive the replica.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if getattr(self, "staging", None) is not None:
            self.staging.close()


def _takes_no_features(features) -> str:
    """A text-only model's cache check: no value read from the cache is ever its input."""
    return "this model takes no images or videos"


def _no_media(model: str, modalities: list[str]) -> IrisError:
    kinds = " and ".join(sorted({f"{m}s" for m in modalities})) or "media"
    return IrisError(
        f"The model {model!r} is text-only: it takes no images or videos, and this request has {kinds}",
        param="messages",
        code="media_not_supported",
    )


async def _responses_sse(events) -> AsyncIterator[str]:
    """The Responses API's stream of event objects as `vllm serve` writes it: named SSE events."""
    async with aclosing(events):
        async for event in events:
            data = event.model_dump_json(indent=None, by_alias=True)
            yield f"event: {getattr(event, 'type', 'unknown')}\ndata: {data}\n\n"


def _salted(tenant: str, own: str | None) -> str:
    """The request's vLLM `cache_salt`: the tenant's, combined with the client's own, never replaced by it,
    so prefix-cache hits (and so TTFT) never depend on other tenants' prompts."""
    return f"{cache_salt(tenant)}:{own}" if own else cache_salt(tenant)


def _model_in_engine_process() -> None:
    """On a CPU-only node, run the model in vLLM's engine-core process, as vLLM does on one GPU.
    vLLM's CPU default adds a worker process that busy-waits on a shared-memory queue for a second
    after every step: with it the engine used 58-88 ms of CPU per new-image request at 4 clients on
    the tiny LLaVA, without it 24-31, the rest left to the replica and the node
    (bench/results/host_cost/README.md). Same kernels, same answers. VLLM_ENABLE_V1_MULTIPROCESSING
    set by the user wins; with tensor parallelism vLLM keeps its worker processes either way."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _check_group(ranks: Placement) -> None:
    """A replica of several vLLM ranks starts only in a placement group that holds them (Iris's, from
    decode_placement, or serve_config.yaml's own placement_group_bundles): else it says why, not hangs."""
    if ranks.bundles is None:
        return
    from ray.util import get_current_placement_group

    group = get_current_placement_group()
    problem = group_problem(ranks, group.bundle_specs if group else None)
    if problem:
        raise RuntimeError(f"LLMDecode cannot place its {ranks.world_size} vLLM ranks: {problem}")


def _bind_engine_cores(ranks: int = 1) -> None:
    """On a CPU-only node, give this replica's engine cores of its own: by default every
    engine on a node binds the same cores (deployments/cpu_binding.py). The replica's place
    is its local rank; the engines that may share the node, the deployment's replica
    count (its autoscaling maximum). With several vLLM ranks (tensor or pipeline parallel) the
    replica's cores are split between them, one list per rank. A VLLM_CPU_OMP_THREADS_BIND set by the user wins."""
    if torch.cuda.is_available() or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return
    try:
        context = serve.get_replica_context()
    except RayServeException:  # not in a replica
        return
    autoscaling = getattr(getattr(context, "_deployment_config", None), "autoscaling_config", None)
    engines = autoscaling.max_replicas if autoscaling else (context.world_size or 1)
    local_rank = context.rank.local_rank if context.rank is not None else 0
    bind = omp_threads_bind(local_rank, engines, list(os.sched_getaffinity(0)))
    if ranks > 1:  # this replica's cores (all the node's when it is the only engine), one list per rank
        cores = [int(c) for c in bind.split(",")] if bind else list(os.sched_getaffinity(0))
        bind = rank_binds(cores, ranks, reserve=0 if bind else 1)
    if bind:
        logger.info(
            "LLMDecode replica %d of %d on this node: vLLM's OpenMP threads on cores %s", local_rank, engines, bind
        )
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
