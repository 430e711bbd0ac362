"""LLMDecode: vLLM AsyncLLM fed image and video features as embeddings.

Features computed for this request arrive as object-store references (kept in
this replica's L1 for the next request); others are read from the cache.
`multi_modal_uuids` are set to the cache keys, so vLLM's prefix cache knows an
image or clip it has seen before, whichever replica computed the features.
For a modality vLLM takes no embeddings for, the engine gets the item itself (from
the bytes the features carry) and Iris's EC connector in the engine takes the
features from a staging folder this replica writes (pipeline/model/ec_connector.py).

Token deltas are merged into one chunk per `stream_interval_s` (the first is
sent at once): one Ray message per token costs more than the token on a busy node.
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
from deployments.config import REQUIRED_ENGINE_ARGS, IrisConfig
from deployments.cpu_binding import omp_threads_bind
from deployments.metrics import CacheMetrics
from deployments.stage_trace import mark
from pipeline.api.errors import IrisError, bad_request
from pipeline.api.logprobs import (
    chat_logprobs,
    completion_logprobs,
    extend_completion_logprobs,
    next_text_offset,
)
from pipeline.api.sampling import max_tokens_of
from pipeline.api.stream_merge import merged_outputs
from pipeline.api.tokenize import TokenizeJob
from pipeline.model.ec_connector import (
    FeatureStaging,
    connector_counts,
    ec_transfer_config,
)
from pipeline.model.vision_model import CONNECTOR
from pipeline.stage_io import DecodeChunk, DecodeRequest, EncodedMedia
from pipeline.tenancy.tenant import cache_salt

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
            **{**config.engine_args, **REQUIRED_ENGINE_ARGS, **connector},
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self.max_model_len = self.engine.model_config.max_model_len
        self.min_prompt_tokens = _min_prompt_tokens(self.engine.model_config)
        # The checkpoint's generation_config defaults, as `vllm serve` applies them.
        self.default_sampling_params = self.engine.model_config.get_diff_sampling_param()
        self.system_fingerprint = _system_fingerprint(self.engine.vllm_config)
        self.stream_interval_s = config.stream_interval_s
        self.max_tokens_limit = config.max_tokens_limit  # larger requests were refused by the ingress
        # Values read from Redis must carry the fingerprint of their key and look like this
        # model's features: a forged or stale entry is a miss, never an input.
        self.cache = FeatureCache(config.cache, check=ValueCheck(self.vision.feature_problem))
        self.cache_metrics = CacheMetrics(self.cache)
        self.prefix_hit_tokens = metrics.Counter(
            "iris_vllm_prefix_cache_hit_tokens", description="Prompt tokens served from vLLM's prefix cache")
        self.prompt_tokens = metrics.Counter("iris_vllm_prompt_tokens", description="Prompt tokens prefilled or cached")
        self.generating = 0  # generate() calls in progress on this replica
        await self._warm_up_logprobs()
        if "image" in connector_widths:
            await self._check_connector()

    async def _warm_up_logprobs(self) -> None:
        """vLLM compiles its logprobs kernel (torch.compile, `batched_count_greater_than`) on the
        first request that asks for logprobs, and its engine serves nobody while it compiles:
        17 s on this 2-core machine with a cold compile cache, 1 s with a warm one. One token with
        logprobs here moves that stall into start-up, before the replica takes traffic."""
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
        prompt = {"prompt_token_ids": self._prompt_token_ids(None, messages, False)}
        key, staged = f"iris-connector-check-{os.getpid()}-{time.monotonic_ns()}", []
        try:
            prompt.update(await self._media_input([key], [self.vision.sample_features], ["image"], staged))
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
        started, sent = time.monotonic(), False
        try:
            async with aclosing(self._generate(request)) as chunks:
                async for chunk in chunks:
                    sent = True
                    yield chunk
        finally:  # also when the caller cancels or leaves: closing _merged aborted the engine request
            self.generating -= 1
            waited = time.monotonic() - started
            if not sent and waited > SLOW_FIRST_OUTPUT_S:
                # Says whether a first token the client never saw left this replica at all.
                logger.warning("request %s ended after %.1f s without a first chunk from this replica "
                               "(requests vLLM holds now: %s)", request.request_id, waited, self._unfinished())

    async def _generate(self, request: DecodeRequest) -> AsyncIterator[DecodeChunk]:
        mark("decode.start", request.request_id)
        keys = request.media_keys
        modalities = request.modalities or ["image"] * len(keys)
        if any(fingerprint_of(k) != self.fingerprint for k in keys):
            # Keyed for other weights by an ingress that has not seen the update yet.
            yield DecodeChunk(error=IrisError("the model was updated while this request was in flight; retry",
                                              status_code=503, code="model_changed"))
            return
        delivered = await self._delivered(request.delivered)
        for key, f in delivered.items():
            if isinstance(f, IrisError):  # the encode failed: the ingress answers with its error
                yield DecodeChunk(error=f)
                return
            self.cache.remember(key, f)
        features = [delivered.get(k) for k in keys]
        lookup = [k for k, f in zip(keys, features) if f is None]
        if lookup:
            found = dict(zip(lookup, await self.cache.get_many(lookup)))
            self.cache_metrics.export()
            features = [f if f is not None else found[k] for k, f in zip(keys, features)]
            # A stored value of another modality than its key's (forged) counts as absent.
            missing = [k for k, f, m in zip(keys, features, modalities)
                       if f is None or f.modality != m]
            if missing:
                yield DecodeChunk(missing_keys=missing)
                return
        mark("decode.features_in", request.request_id)

        req = request.sampling
        # /v1/completions: vLLM adds the tokenizer's special tokens (BOS); chat: the template holds them.
        # vLLM expands each image placeholder into its feature tokens.
        token_ids = self._prompt_token_ids(request.prompt, request.messages, req.add_special_tokens)
        n_prompt = len(token_ids) + sum(f.num_tokens - 1 for f in features)
        if 0 < n_prompt < self.min_prompt_tokens:  # an empty prompt gets vLLM's own error
            yield DecodeChunk(error=bad_request(
                f"The prompt is {n_prompt} token long; this model needs at least {self.min_prompt_tokens} on this "
                "server (vLLM's CPU kernel for its linear-attention layers fails on a shorter one)",
                param="prompt" if request.prompt is not None else "messages", code="prompt_too_short"))
            return
        error = self._check_length(n_prompt, max_tokens_of(req))
        if error:
            yield DecodeChunk(error=bad_request(error, param="messages", code="context_length_exceeded"))
            return
        # Per-tenant salt: prefix-cache hits (and so TTFT) never depend on other tenants' prompts.
        engine_prompt: dict = {"prompt_token_ids": token_ids, "cache_salt": cache_salt(request.tenant)}
        staged: list[str] = []
        try:
            try:
                engine_prompt.update(await self._media_input(keys, features, modalities, staged))
            except IrisError as err:
                yield DecodeChunk(error=err)
                return
            async with aclosing(self._engine_chunks(request, engine_prompt, n_prompt)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            if staged:  # the engine took the features in its prefill (or never will: the request ended)
                self.staging.release(staged)

    async def _media_input(self, keys: list[str], features: list, modalities: list[str], staged: list[str]) -> dict:
        """The engine prompt's `multi_modal_data` and `multi_modal_uuids` (the cache keys). Items of
        a modality vLLM takes no embeddings for go as themselves, decoded from their bytes, and their
        features to the staging folder (their keys appended to `staged`), where the engine's EC
        connector reads them."""
        data, uuids = {}, {}
        for modality in dict.fromkeys(modalities):  # vLLM counts each modality's items apart, in prompt order
            mine = [i for i, m in enumerate(modalities) if m == modality]
            uuids[modality] = [keys[i] for i in mine]
            items = [features[i] for i in mine]
            if self.vision.forms[modality].delivery != CONNECTOR:
                data[modality] = self.vision.embedding_input(items, modality)
                continue
            try:  # decoding an image or a clip is CPU work: off the event loop
                data[modality] = await asyncio.to_thread(self.vision.source_items, items, modality)
            except Exception as err:  # bytes Iris's own checks let through but vLLM's loader refuses
                raise bad_request(f"vLLM cannot decode this {modality}: {err}", param="messages",
                                  code=f"invalid_{modality}") from None
            for key, f in zip(uuids[modality], items):
                self.staging.stage(key, f)
                staged.append(key)
        return {"multi_modal_data": data, "multi_modal_uuids": uuids} if data else {}

    async def _engine_chunks(self, request: DecodeRequest, engine_prompt: dict, n_prompt: int
                             ) -> AsyncIterator[DecodeChunk]:
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineGenerateError

        req = request.sampling
        tokenizer = self.processor.tokenizer
        try:  # as vLLM's serving_chat: the max_tokens default and generation_config come in here
            max_tokens = get_max_tokens(self.max_model_len, max_tokens_of(req), n_prompt, self.default_sampling_params,
                                        override_max_tokens=self.max_tokens_limit)  # also caps the default
            params = req.to_sampling_params(max_tokens, self.default_sampling_params)
        except (ValueError, VLLMClientError) as err:
            yield DecodeChunk(error=bad_request(str(err), param=getattr(err, "parameter", None), code="invalid_request"))
            return
        params.output_kind = RequestOutputKind.DELTA  # Iris streams internally, and merges deltas itself
        # Chat: `logprobs` is a flag and `top_logprobs` the count; completions: `logprobs` is the count.
        text_api = request.prompt is not None
        top_n = req.logprobs if text_api else (req.top_logprobs if req.logprobs else None)
        text_offsets: dict[int, int] = {}  # choice -> where its next token starts in its text (completions)
        completion_tokens = 0
        mark("decode.engine_call", request.request_id)
        try:
            async with aclosing(merged_outputs(self.engine.generate(engine_prompt, params, request.request_id),
                                               self.stream_interval_s)) as merged:
                async for outs in merged:
                    if completion_tokens == 0:
                        mark("decode.first_output", request.request_id)
                    choices: dict[int, DecodeChunk] = {}
                    for o in outs:
                        for c in o.outputs:
                            ch = choices.setdefault(c.index, DecodeChunk(index=c.index))
                            ch.text += c.text
                            completion_tokens += len(c.token_ids)
                            if c.logprobs is not None and top_n is not None and text_api:
                                lp = completion_logprobs(c.token_ids, c.logprobs, tokenizer, top_n,
                                                         text_offsets.get(c.index, 0))
                                text_offsets[c.index] = next_text_offset(lp, text_offsets.get(c.index, 0))
                                ch.logprobs = extend_completion_logprobs(ch.logprobs, lp)
                            elif c.logprobs is not None and top_n is not None:
                                ch.logprobs = (ch.logprobs or []) + chat_logprobs(c.token_ids, c.logprobs,
                                                                                  tokenizer, top_n)
                            if c.finish_reason:
                                ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
                                ch.system_fingerprint = self.system_fingerprint
                    out = outs[-1]
                    chunks = [choices[i] for i in sorted(choices)] or [DecodeChunk()]
                    if out.finished:
                        last = chunks[-1]
                        last.done = True
                        last.prompt_tokens = len(out.prompt_token_ids or [])
                        last.completion_tokens = completion_tokens
                        last.cached_tokens = out.num_cached_tokens or 0
                        if last.prompt_tokens:
                            self.prompt_tokens.inc(last.prompt_tokens)
                        if last.cached_tokens:
                            self.prefix_hit_tokens.inc(last.cached_tokens)
                    for ch in chunks:
                        yield ch
        except (ValueError, VLLMClientError) as err:  # vLLM's input validation, e.g. prompt too long, bad schema
            yield DecodeChunk(error=bad_request(str(err), param=getattr(err, "parameter", None) or "messages",
                                                code="invalid_prompt"))
        except EngineGenerateError as err:
            # vLLM asserts that the prompt has a placeholder for every item (`vllm serve` answers 500):
            # a chat template that places no videos, say. The request's input, not a fault.
            cause = err.__cause__
            while cause is not None and "Failed to apply prompt replacement" not in str(cause):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            yield DecodeChunk(error=bad_request(f"this model's chat template places no token for an item of the "
                                                f"request, so the model cannot take it ({cause})", param="messages",
                                                code="invalid_prompt"))

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

    def _prompt_token_ids(self, prompt: str | None, messages: list[dict] | None, add_special_tokens: bool,
                          add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        """A text prompt's tokens, or the chat template's over `messages`, tokenized once as `vllm serve` does."""
        if prompt is None:
            prompt = self.processor.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False)
        return self.processor.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]

    def tokenize(self, job: TokenizeJob) -> TokenizeResponse | IrisError:
        """/tokenize: vLLM's TokenizeResponse, or the 400 the chat template raised."""
        from jinja2 import TemplateError

        try:
            tokens = self._prompt_token_ids(job.prompt, job.messages, job.add_special_tokens,
                                            job.add_generation_prompt, job.continue_final_message)
        except (ValueError, TemplateError) as err:  # e.g. continue_final_message with a generation prompt
            return bad_request(str(err), param="messages")
        strs = self.processor.tokenizer.convert_ids_to_tokens(tokens) if job.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens, token_strs=strs)

    def detokenize(self, tokens: list[int]) -> DetokenizeResponse:
        """/detokenize: the tokenizer's plain decode, as vLLM's."""
        return DetokenizeResponse(prompt=self.processor.tokenizer.decode(tokens))

    def stats(self) -> dict:
        # engine_unfinished: requests vLLM still holds (running or waiting); 0 once every caller
        # finished or went away, since a cancelled generate() aborts its engine request.
        stats = {"replica": serve.get_replica_context().replica_id.unique_id, "cache": self.cache.stats(),
                 "generating": self.generating, "engine_unfinished": self.engine.get_num_unfinished_requests()}
        if self.staging is not None:  # items the connector supplied and items the engine's tower encoded
            stats["ec_connector"] = {**connector_counts(), "staged": self.staging.staged}
        return stats

    def _check_length(self, n_prompt: int, max_tokens: int | None) -> str | None:
        """vLLM would silently cut max_tokens; OpenAI answers 400 instead."""
        wanted = n_prompt + (max_tokens or 1)
        if wanted > self.max_model_len:
            return (f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{wanted} tokens ({n_prompt} in the messages, {max_tokens or 1} in the completion). "
                    "Please reduce the length of the messages or completion.")
        return None

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


def _min_prompt_tokens(model_config) -> int:
    """2 for hybrid (linear-attention) models on vLLM's CPU build, else 1: its causal_conv1d
    kernel there (Qwen3.5's Gated DeltaNet) fails on a 1-token prefill and takes the engine
    down with it (vLLM 0.32; `vllm serve` dies the same way). GPUs run another kernel."""
    from vllm.platforms import current_platform

    return 2 if current_platform.is_cpu() and model_config.is_hybrid else 1


def _system_fingerprint(vllm_config) -> str | None:
    """What `vllm serve` stamps on its answers as `system_fingerprint`, for this engine."""
    from vllm.entrypoints.serve.utils.fingerprint import get_system_fingerprint

    try:
        return get_system_fingerprint(vllm_config)
    except Exception:  # as vLLM: never fail start-up over it
        return None


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
