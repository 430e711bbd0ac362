"""What LLMDecode gives vLLM's engine for one request, as `vllm serve`'s chat preprocessing builds it:
the prompt's tokens (the chat template's, tokenized once), its images and videos
(`multi_modal_data`, keyed by the cache keys as `multi_modal_uuids`), and the SamplingParams;
with the checks `vllm serve` makes before the engine sees a request (length, empty prompt).

Items of a modality vLLM takes no embeddings for go as themselves, decoded from the bytes their
features carry; their features go to the replica's staging folder, where the engine's EC
connector reads them (pipeline/model/ec_connector.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from pipeline.api.errors import bad_request, vllm_refusal
from pipeline.api.sampling import max_tokens_of
from pipeline.model.embedding_form import CONNECTOR
from pipeline.model.vision_model import VisionModel
from pipeline.stage_io import DecodeRequest
from pipeline.tenancy.tenant import cache_salt


class EnginePromptBuilder:
    def __init__(self, vision: VisionModel, processor, staging, model_config, default_sampling_params: dict,
                 max_tokens_limit: int | None):
        from vllm.platforms import current_platform

        self.vision = vision
        self.processor = processor  # the checkpoint's HF processor: chat template and tokenizer
        self.staging = staging  # FeatureStaging, where some modality goes through the EC connector
        self.max_model_len = model_config.max_model_len
        # vLLM's CPU kernel for hybrid (linear-attention) layers, Qwen3.5's Gated DeltaNet, fails on a
        # 1-token prefill and takes the engine down with it (vLLM 0.32; `vllm serve` dies the same
        # way); GPUs run another kernel.
        self.min_prompt_tokens = 2 if current_platform.is_cpu() and model_config.is_hybrid else 1
        self.default_sampling_params = default_sampling_params  # the checkpoint's generation_config
        self.max_tokens_limit = max_tokens_limit  # larger requests were refused by the ingress

    def token_ids(self, prompt: str | None, messages: list[dict] | None, add_special_tokens: bool,
                  add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        """A text prompt's tokens, or the chat template's over `messages`, tokenized once as `vllm serve` does."""
        if prompt is None:
            prompt = self.processor.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=False)
        return self.processor.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]

    async def build(self, request: DecodeRequest, features: list, staged: list[str]) -> tuple[dict, Any]:
        """(engine prompt, SamplingParams); IrisError 400 for a request the engine must
        not see. Keys of features staged for the connector are appended to `staged`."""
        from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
        from vllm.exceptions import VLLMClientError
        from vllm.sampling_params import RequestOutputKind

        req = request.sampling
        # /v1/completions: vLLM adds the tokenizer's special tokens (BOS); chat: the template holds them.
        # vLLM expands each image placeholder into its feature tokens.
        token_ids = self.token_ids(request.prompt, request.messages, req.add_special_tokens)
        n_prompt = len(token_ids) + sum(f.num_tokens - 1 for f in features)
        if 0 < n_prompt < self.min_prompt_tokens:  # an empty prompt gets vLLM's own error
            raise bad_request(
                f"The prompt is {n_prompt} token long; this model needs at least {self.min_prompt_tokens} on this "
                "server (vLLM's CPU kernel for its linear-attention layers fails on a shorter one)",
                param="prompt" if request.prompt is not None else "messages", code="prompt_too_short")
        self._check_length(n_prompt, max_tokens_of(req))
        try:  # as vLLM's serving_chat: the max_tokens default and generation_config come in here
            max_tokens = get_max_tokens(self.max_model_len, max_tokens_of(req), n_prompt, self.default_sampling_params,
                                        override_max_tokens=self.max_tokens_limit)  # also caps the default
            params = req.to_sampling_params(max_tokens, self.default_sampling_params)
        except (ValueError, VLLMClientError) as err:
            raise vllm_refusal(err, code="invalid_request") from None
        params.output_kind = RequestOutputKind.DELTA  # Iris streams internally, and merges deltas itself
        # Per-tenant salt: prefix-cache hits (and so TTFT) never depend on other tenants' prompts.
        prompt: dict = {"prompt_token_ids": token_ids, "cache_salt": cache_salt(request.tenant)}
        keys = request.media_keys
        prompt.update(await self.media_input(keys, features, request.modalities or ["image"] * len(keys), staged))
        return prompt, params

    async def media_input(self, keys: list[str], features: list, modalities: list[str], staged: list[str]) -> dict:
        """The engine prompt's `multi_modal_data` and `multi_modal_uuids` (the cache keys)."""
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

    def _check_length(self, n_prompt: int, max_tokens: int | None) -> None:
        """vLLM would silently cut max_tokens; OpenAI answers 400 instead."""
        wanted = n_prompt + (max_tokens or 1)
        if wanted > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{wanted} tokens ({n_prompt} in the messages, {max_tokens or 1} in the completion). "
                "Please reduce the length of the messages or completion.", param="messages",
                code="context_length_exceeded")
