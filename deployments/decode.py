"""LLMDecode: vLLM AsyncLLM fed image and video features as embeddings.

Features computed for this request arrive as object-store references (kept in
this replica's L1 for the next request); others are read from the cache.
`multi_modal_uuids` are set to the cache keys, so vLLM's prefix cache knows an
image or clip it has seen before, whichever replica computed the features.
For a modality vLLM takes no embeddings for, the engine gets the item itself (from
the bytes the features carry) and Iris's EC connector in the engine takes the
features from a staging folder this replica writes (pipeline/model/ec_staging.py).

The engine prompt is built by deployments/engine_prompt.py, the engine's outputs become
DecodeChunks in deployments/engine_output.py.
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
from ray.exceptions import ObjectLostError
from ray.serve.exceptions import RayServeException
from vllm.entrypoints.serve.tokenize.protocol import (
    DetokenizeResponse,
    TokenizeResponse,
)

from cache_service.feature_cache import FeatureCache
from cache_service.keys import fingerprint_of
from cache_service.validation import ValueCheck
from deployments import tracing
from deployments.config import REQUIRED_ENGINE_ARGS, IrisConfig
from deployments.cpu_binding import omp_threads_bind
from deployments.engine_output import OutputAdapter
from deployments.engine_prompt import EnginePromptBuilder
from deployments.metrics import CacheMetrics
from deployments.stage_trace import mark
from pipeline.api.errors import IrisError, bad_request, model_changed
from pipeline.api.tokenize import TokenizeJob
from pipeline.model.ec_connector import connector_counts, ec_transfer_config
from pipeline.model.ec_staging import FeatureStaging
from pipeline.model.embedding_form import CONNECTOR
from pipeline.stage_io import DecodeChunk, DecodeRequest, EncodedMedia

logger = logging.getLogger("ray.serve")
# A request that ends without its first chunk after this long is logged (a deadline, a client that left).
SLOW_FIRST_OUTPUT_S = 5.0


@serve.deployment(ray_actor_options={"num_cpus": 1})
class LLMDecode:
    async def __init__(self, config: IrisConfig):  # async: the engine's warm-up runs a request
        from ray.serve import metrics
        from transformers import AutoProcessor
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        _bind_engine_cores()
        _model_in_engine_process()
        tracing.setup(config.tracing, "decode")
        # vLLM's view of the checkpoint's images: the embedding form, the feature checks, and
        # the encoder's fingerprint (computed before the engine takes the device's memory).
        self.vision = config.vision_model()
        checkpoint = self.vision.checkpoint
        self.processor = AutoProcessor.from_pretrained(checkpoint)
        # Keys of other weights (a rolling update) are refused.
        self.fingerprint = self.vision.expected_fingerprint()
        # Modalities vLLM takes no embeddings for: the engine's EC connector reads their features
        # from a staging folder of this replica's.
        connector_widths = {m: form.width for m, form in self.vision.forms.items() if form.delivery == CONNECTOR}
        self.staging = FeatureStaging() if connector_widths else None
        connector = {"ec_transfer_config": ec_transfer_config(self.staging.dir, connector_widths)} if self.staging else {}
        args = AsyncEngineArgs(
            model=checkpoint, served_model_name=[config.model_name], dtype=str(self.vision.dtype).removeprefix("torch."),
            limit_mm_per_prompt={m: self.vision.limits[m] for m in self.vision.modalities},
            **{**tracing.vllm_engine_args(config.tracing, config.engine_args), **config.engine_args,
               **REQUIRED_ENGINE_ARGS, **connector},
        )
        self.engine = AsyncLLM.from_engine_args(args)
        model_config = self.engine.model_config
        # The checkpoint's generation_config defaults, as `vllm serve` applies them.
        self.prompts = EnginePromptBuilder(self.vision, self.processor, self.staging, model_config,
                                           model_config.get_diff_sampling_param(), config.max_tokens_limit)
        self.outputs = OutputAdapter(self.processor.tokenizer, _system_fingerprint(self.engine.vllm_config),
                                     config.stream_interval_s, self._count_tokens)
        # Values read from Redis must carry the fingerprint of their key and look like this
        # model's features: a forged or stale entry is a miss, never an input.
        self.cache = FeatureCache(config.cache, check=ValueCheck(self.vision.feature_problem))
        self.cache_metrics = CacheMetrics(self.cache)
        self.prefix_hit_tokens = metrics.Counter(
            "iris_vllm_prefix_cache_hit_tokens", description="Prompt tokens served from vLLM's prefix cache")
        self.prompt_tokens = metrics.Counter("iris_vllm_prompt_tokens", description="Prompt tokens prefilled or cached")
        self.generating = 0  # generate() calls in progress on this replica
        self.left_early = 0  # generate() calls whose caller went away before the last chunk (client gone, deadline)
        await self._warm_up_logprobs()
        if "image" in connector_widths:
            await self._check_connector()

    async def _warm_up_logprobs(self) -> None:
        """vLLM compiles its logprobs kernel (torch.compile, `batched_count_greater_than`) on the
        first request that asks for logprobs, and its engine serves nobody while it compiles
        (seconds). One token with logprobs here moves that stall into start-up, before the
        replica takes traffic."""
        from vllm import SamplingParams

        started = time.monotonic()
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
        # 16 tokens, not 1: vLLM's CPU conv1d of hybrid models (Qwen3.5) fails on a 1-token prefill.
        tokens = [self.processor.tokenizer.bos_token_id or 0] * 16
        async for _ in self.engine.generate({"prompt_token_ids": tokens}, params, "iris-logprobs-warm-up"):
            pass
        logger.info("LLMDecode: vLLM's logprobs path warmed up in %.1f s", time.monotonic() - started)

    async def _check_connector(self) -> None:
        """One image through the EC connector before the replica takes traffic: the engine must
        take the features the encoder computed for it and never run its own tower. A family
        neither vLLM's embedding input nor the connector serves is refused here, naming why."""
        from vllm import SamplingParams

        arch = self.engine.model_config.architecture
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
        prompt = {"prompt_token_ids": self.prompts.token_ids(None, messages, False)}
        key, staged = f"iris-connector-check-{os.getpid()}-{time.monotonic_ns()}", []
        try:
            prompt.update(await self.prompts.media_input([key], [self.vision.sample_features], ["image"], staged))
            async for _ in self.engine.generate(prompt, SamplingParams(max_tokens=1), "iris-connector-check"):
                pass
        except Exception as err:
            raise RuntimeError(f"{arch}: its engine failed on an image through Iris's EC connector, the one way "
                               f"to it where vLLM takes no image embeddings ({type(err).__name__}: {err}); Iris "
                               "cannot serve it") from err
        finally:
            self.staging.release(staged)
        for _ in range(50):  # vLLM's stat loggers record a step's connector stats just after its outputs
            counts = connector_counts()
            if counts["loaded"] + counts["encoded"]:
                break
            await asyncio.sleep(0.05)
        if counts != {"loaded": 1, "encoded": 0}:
            raise RuntimeError(f"{arch}: its engine did not take the encoder's features through Iris's EC "
                               f"connector, the one way to it where vLLM takes no image embeddings ({counts}); "
                               "Iris cannot serve it")
        logger.info("LLMDecode: %s's features reach vLLM through Iris's EC connector", arch)

    async def generate(self, request: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        self.generating += 1
        started, sent, ended = time.monotonic(), False, False
        # Not the current span: it spans yields. vLLM's llm_request span is its child (trace_headers).
        span = tracing.start_span("decode", request.trace)
        try:
            async with aclosing(self._generate(request, tracing.carrier(span))) as chunks:
                async for chunk in chunks:
                    sent = True
                    if chunk.done and span.is_recording():
                        span.set_attributes({"iris.prompt_tokens": chunk.prompt_tokens,
                                             "iris.completion_tokens": chunk.completion_tokens,
                                             "iris.cached_tokens": chunk.cached_tokens})
                    yield chunk
            ended = True
        finally:  # also when the caller cancels or leaves: closing _merged aborted the engine request
            span.end()
            self.generating -= 1
            self.left_early += not ended
            waited = time.monotonic() - started
            if not sent and waited > SLOW_FIRST_OUTPUT_S:
                # Says whether a first token the client never saw left this replica at all.
                logger.warning("request %s ended after %.1f s without a first chunk from this replica "
                               "(requests vLLM holds now: %s)", request.request_id, waited, self._unfinished())

    async def _generate(self, request: DecodeRequest, trace: dict[str, str] | None = None
                        ) -> AsyncIterator[DecodeChunk]:
        """`trace`: the decode span's context, the parent of this call's spans and vLLM's."""
        mark("decode.start", request.request_id)
        if any(fingerprint_of(k) != self.fingerprint for k in request.media_keys):
            yield DecodeChunk(error=model_changed())  # keyed by an ingress that has not seen the update yet
            return
        with tracing.span("decode.features", trace):  # waits for this request's encodes, reads the cache
            features = await self._features(request)
        if isinstance(features, DecodeChunk):  # an encode's error, or keys to compute again
            yield features
            return
        mark("decode.features_in", request.request_id)
        staged: list[str] = []
        try:
            try:
                prompt, params = await self.prompts.build(request, features, staged)
            except IrisError as err:
                yield DecodeChunk(error=err)
                return
            outputs = self.engine.generate(prompt, params, request.request_id, trace_headers=trace)
            async with aclosing(self.outputs.chunks(outputs, request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            if staged:  # the engine took the features in its prefill (or never will: the request ended)
                self.staging.release(staged)

    async def _features(self, request: DecodeRequest) -> list | DecodeChunk:
        """The features of the request's items in prompt order: those computed for it (kept in L1 for
        the next request), the rest from the cache. Else the chunk that ends the request: an encode's
        error, or the keys no longer in the cache (the ingress computes them again)."""
        keys = request.media_keys
        delivered = await self._delivered(request.delivered)
        for key, f in delivered.items():
            if isinstance(f, IrisError):  # the encode failed: the ingress answers with its error
                return DecodeChunk(error=f)
            self.cache.remember(key, f)
        features = [delivered.get(k) for k in keys]
        lookup = [k for k, f in zip(keys, features) if f is None]
        if not lookup:
            return features
        found = dict(zip(lookup, await self.cache.get_many(lookup)))
        self.cache_metrics.export()
        features = [f if f is not None else found[k] for k, f in zip(keys, features)]
        # A stored value of another modality than its key's (forged) counts as absent.
        modalities = request.modalities or ["image"] * len(keys)
        missing = [k for k, f, m in zip(keys, features, modalities) if f is None or f.modality != m]
        return DecodeChunk(missing_keys=missing) if missing else features

    def _count_tokens(self, last: DecodeChunk) -> None:
        if last.prompt_tokens:
            self.prompt_tokens.inc(last.prompt_tokens)
        if last.cached_tokens:
            self.prefix_hit_tokens.inc(last.cached_tokens)

    async def _delivered(self, refs: dict) -> dict:
        """Key -> Features (or the encode's IrisError), from the references of the VisionEncoder
        calls the ingress made for this request, once they are done. A reference that cannot be
        fetched is left out: that key is read from the cache like any other."""
        encoded = await asyncio.gather(*refs.values(), return_exceptions=True)
        fetched = iter(await asyncio.gather(*(e.features_ref for e in encoded if isinstance(e, EncodedMedia)),
                                            return_exceptions=True))
        delivered = {}
        for key, e in zip(refs, encoded):
            f = next(fetched) if isinstance(e, EncodedMedia) else e
            if isinstance(f, ObjectLostError):
                # The reference is a shortcut, the cache the record: under heavy load Ray has
                # answered ReferenceCountingAssertionError for a live reference, and an
                # encoder replica may have died since.
                logger.warning("features of %s could not be fetched from the object store (%s); "
                               "reading the cache", key, type(f).__name__)
                continue
            if isinstance(f, BaseException) and not isinstance(f, IrisError):
                raise f
            delivered[key] = f
        return delivered

    def _unfinished(self) -> int | str:
        try:
            return self.engine.get_num_unfinished_requests()
        except Exception as err:  # a dead engine: say so rather than mask why the request ended
            return f"unknown ({type(err).__name__})"

    def tokenize(self, job: TokenizeJob) -> TokenizeResponse | IrisError:
        """/tokenize: vLLM's TokenizeResponse, or the 400 the chat template raised."""
        from jinja2 import TemplateError

        try:
            tokens = self.prompts.token_ids(job.prompt, job.messages, job.add_special_tokens,
                                            job.add_generation_prompt, job.continue_final_message)
        except (ValueError, TemplateError) as err:  # e.g. continue_final_message with a generation prompt
            return bad_request(str(err), param="messages")
        strs = self.processor.tokenizer.convert_ids_to_tokens(tokens) if job.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.prompts.max_model_len, tokens=tokens,
                                token_strs=strs)

    def detokenize(self, tokens: list[int]) -> DetokenizeResponse:
        """/detokenize: the tokenizer's plain decode, as vLLM's."""
        return DetokenizeResponse(prompt=self.processor.tokenizer.decode(tokens))

    def stats(self) -> dict:
        # engine_unfinished: requests vLLM still holds (running or waiting); 0 once every caller
        # finished or went away, since a cancelled generate() aborts its engine request.
        stats = {"replica": serve.get_replica_context().replica_id.unique_id, "cache": self.cache.stats(),
                 "generating": self.generating, "left_early": self.left_early,
                 "engine_unfinished": self.engine.get_num_unfinished_requests()}
        if self.staging is not None:  # items the connector supplied and items the engine's tower encoded
            stats["ec_connector"] = {**connector_counts(), "staged": self.staging.staged}
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


def _system_fingerprint(vllm_config) -> str | None:
    """What `vllm serve` stamps on its answers as `system_fingerprint`, for this engine."""
    from vllm.entrypoints.serve.utils.fingerprint import get_system_fingerprint

    try:
        return get_system_fingerprint(vllm_config)
    except Exception:  # as vLLM: never fail start-up over it
        return None


def _model_in_engine_process() -> None:
    """On a CPU-only node, run the model in vLLM's engine-core process, as vLLM does on one GPU.
    vLLM's CPU default adds a worker process that busy-waits on a shared-memory queue for a second
    after every step: with it the engine used 58-88 ms of CPU per new-image request at 4 clients on
    the tiny LLaVA, without it 24-31, the rest left to the replica and the node
    (bench/results/host_cost/README.md). Same kernels, same answers. VLLM_ENABLE_V1_MULTIPROCESSING
    set by the user wins; with tensor parallelism vLLM keeps its worker processes either way."""
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _bind_engine_cores() -> None:
    """On a CPU-only node, give this replica's engine cores of its own: by default every
    engine on a node binds the same cores (deployments/cpu_binding.py). The replica's place
    is its local rank; the engines that may share the node, the deployment's replica
    count (its autoscaling maximum). A VLLM_CPU_OMP_THREADS_BIND set by the user wins."""
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
    if bind:
        logger.info("LLMDecode replica %d of %d on this node: vLLM's OpenMP threads on cores %s",
                    local_rank, engines, bind)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
