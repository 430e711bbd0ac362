"""IrisConfig: the application `args` of serve_config.yaml, validated once at build time.

Per-deployment resources, replica counts and autoscaling are not here: they
are Serve's own `deployments:` options in serve_config.yaml.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cache_service.config import CacheConfig
from deployments.placement import DecodePlacement, Placement, plan
from deployments.tracing import TracingConfig
from deployments.vllm_args import adapter_names, check_engine_args, model_settings
from pipeline.media.limits import MediaLimits
from pipeline.model.engine_settings import takes_media
from pipeline.model.source import builtin_engine_args, resolve_model
from pipeline.model.vision_model import VisionModel
from pipeline.tenancy.auth import AuthConfig
from pipeline.tenancy.fair_gate import FairSharing
from pipeline.tenancy.limits import TenantLimits

# What belongs to one model of an app: with `models`, each entry sets these (tenant_limits may be
# set at the top level too, for every model that sets none); the other fields are the app's.
MODEL_FIELDS = (
    "model",
    "served_model_name",
    "max_images_per_prompt",
    "max_videos_per_prompt",
    "encoder_batch_size",
    "encoder_batch_wait_s",
    "encoder_batch_max_tokens",
    "stream_interval_s",
    "encoder_cpu_threads",
    "preprocess_cpu_threads",
    "dtype",
    "decoder_features",
    "engine_args",
    "decode_placement",
    "max_tokens_limit",
    "max_text_bytes_per_token",
    "tenant_limits",
)


def deployment_suffix(served_name: str) -> str:
    """What a model's deployment names end with in an app of several (`<Stage>:<this>`): its served
    name as Ray Serve LLM writes it into its own ("/" -> "--", "." -> "_"), and no character Serve
    refuses ("#")."""
    return re.sub(r"[^\w:@+=-]", "_", served_name.replace("/", "--"))


class IrisConfig(BaseModel):
    # Errors name the field and the rule, not the value: a value may hold a secret (a Redis password
    # in a URL, a key where auth wants a file name).
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    model: str = Field(
        "builtin:tiny-llava",
        description="builtin:<size>-<family> (docs/families.md), a local checkpoint folder of any "
        "family served, or a hub id.",
    )
    served_model_name: str | None = Field(
        None, description="Name clients pass as `model` and /v1/models lists; defaults to `model`."
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Encoder-feature cache (L1 + Redis).")
    media: MediaLimits = Field(default_factory=MediaLimits, description="Image and video download and decoding limits.")
    max_images_per_prompt: int = Field(
        4, ge=1, le=64, description="Images accepted in one request (like vLLM's --limit-mm-per-prompt)."
    )
    max_videos_per_prompt: int = Field(
        1,
        ge=0,
        le=16,
        description="Videos accepted in one request, for models that take video (like vLLM's "
        "--limit-mm-per-prompt); 0 refuses video. Frame sampling: engine_args.media_io_kwargs "
        "(vLLM's --media-io-kwargs, e.g. {video: {num_frames: 16}}); size limits: media.max_video_*.",
    )
    encoder_batch_size: Annotated[int, Field(ge=1, le=1024)] | Literal["auto"] = Field(
        "auto",
        description="Most images per vision-encoder forward pass. auto: 8 on a GPU, where a batch costs "
        "little more than one image; 1 on the CPU, where a batch costs nearly the sum of its images, "
        "so batching would mostly hold finished images back.",
    )
    encoder_batch_wait_s: float = Field(
        0.005, ge=0, le=1, description="How long the encoder waits to fill a batch before running it."
    )
    encoder_batch_max_tokens: int | None = Field(
        16384,
        ge=1,
        description="Most image tokens (encoder output tokens, summed over the batch) per vision-encoder "
        "forward pass, so that a batch of large images cannot exhaust device memory; an image above it "
        "runs alone. None batches by encoder_batch_size only.",
    )
    stream_interval_s: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Token deltas produced within this interval travel to the client as one chunk "
        "(the first token at once, the last as soon as it is out); 0 sends every delta as it comes. "
        "50 ms, as Ray Serve LLM's stream batching: each chunk is a Ray message per hop.",
    )
    encoder_cpu_threads: int | None = Field(
        None,
        ge=1,
        le=512,
        description="CPU only: torch threads for the vision tower. Ray gives an actor with fractional "
        "num_cpus one thread; set this to the cores the encoder may really use.",
    )
    preprocess_cpu_threads: int | None = Field(
        None,
        ge=1,
        le=512,
        description="Torch threads for Preprocess's image and video processing (vLLM's processor). Ray "
        "gives an actor with fractional num_cpus one thread; set this to the cores Preprocess may really use.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype of the vision encoder and of vLLM (vLLM's --dtype); auto takes the "
        "checkpoint's. One setting for both, so features equal vLLM's own.",
    )
    decoder_features: Literal["auto", "connector"] = Field(
        "auto",
        description="How features reach vLLM on the decode replicas. auto: as image/video embeddings where "
        "vLLM takes them back for the model, else through Iris's EC connector (the engine gets the item, "
        "its processor lays out the placeholders, and the connector fills its encoder cache: docs/families.md). "
        "connector: through the connector for every family (to compare the two paths).",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=lambda: {"max_model_len": 4096},
        description="LLMDecode's `vllm serve` command line, flag by flag with underscores: engine flags "
        "(max_model_len, gpu_memory_utilization, enable_lora, ...) and frontend flags (tool_call_parser, "
        "enable_auto_tool_choice, reasoning_parser, chat_template, default_chat_template_kwargs, lora_modules, "
        "response_role, ...), checked by vLLM's own parser at start-up. Its model part (revision, tokenizer, "
        "trust_remote_code, hf_overrides, mm_processor_kwargs, load_format, ...: what vLLM's ModelConfig and "
        "LoadConfig take) is what Preprocess and the VisionEncoder load too. Iris's own settings (model, "
        "served_model_name, dtype, media limits, auth, the server's address) are refused here.",
    )
    decode_placement: DecodePlacement = Field(
        default_factory=DecodePlacement,
        description="Where an LLMDecode replica's vLLM ranks run when engine_args ask for several "
        "(tensor_parallel_size × pipeline_parallel_size): each replica holds a placement group, one bundle per rank "
        "(docs/deployment.md).",
    )
    auth: AuthConfig = Field(
        default_factory=AuthConfig,
        description="API keys: with any configured, every request but /health needs one (401 otherwise), "
        "and a key mapped to a tenant name makes that its tenant.",
    )
    tenant_limits: TenantLimits = Field(
        default_factory=TenantLimits,
        description="Per-tenant limits (requests in flight, images and prompt tokens per minute), cluster-wide "
        "through the cache's Redis; all off by default.",
    )
    tenant_header: str | None = Field(
        None,
        description="Header naming the tenant, honoured only when set here: set it only when a trusted "
        "gateway authenticates callers, sets this header and drops any copy a client sent. None (the "
        "default) ignores the header; the tenant is then the one of the API key (its configured name, "
        "else its hash), or `default`.",
    )
    share_content_cache_across_tenants: bool = Field(
        False,
        description="Whether tenants share features of byte-identical images (content-hash keys). "
        "False (the default) keys them per tenant, so neither `x-iris-images` nor timing tells a tenant "
        "whether another sent an image; true saves encoder work when all tenants trust each other.",
    )
    fair_sharing: FairSharing = Field(
        default_factory=FairSharing,
        description="Tenants served in turn in Preprocess and the VisionEncoder (docs/security.md: fair sharing).",
    )
    request_timeout_s: float = Field(
        300,
        gt=0,
        description="Upper bound on one request, from arrival to its last token (image work, queueing, "
        "decoding). Past it the client gets 504 `timeout` (in-band once a stream has started) and the "
        "request's work is cancelled in every stage.",
    )
    max_tokens_limit: int | None = Field(
        4096,
        ge=1,
        description="Most tokens one request may generate: a larger `max_tokens` / `max_completion_tokens` "
        "is a 400 naming the parameter, and a request without one generates at most this many. "
        "None: bounded by the context length only, as in vLLM.",
    )
    max_text_bytes_per_token: int = Field(
        16,
        ge=1,
        le=1024,
        description="Bounds a request's text before anything parses or tokenizes it: a body whose bytes "
        "besides its base64 images and videos pass the model's max_model_len times this (plus 64 KiB) "
        "is a 400 `context_length_exceeded` at the ingress (docs/api.md). Text runs 3-5 bytes a token, "
        "JSON-escaped non-Latin script up to about 12; raise it only for prompts of longer tokens.",
    )
    models: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Several models behind one endpoint, one entry each: its `model`, `served_model_name`, "
        "engine_args and the other settings of one model (MODEL_FIELDS; unset ones take their defaults), "
        "routed by the request's `model`. Each model has its own deployments, named `<Stage>:<name>` "
        "(docs/deployment.md); a text-only model has an LLMDecode only. The other settings (cache, media, "
        "auth, fair sharing, ...) are the app's; `tenant_limits` in an entry gives that model limits of its own. "
        "Empty (the default): the one model of the top-level settings.",
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry traces over OTLP: one trace per request, a span per stage "
        "(docs/operations.md: Traces); off unless otlp_endpoint is set.",
    )

    @field_validator("engine_args")
    @classmethod
    def _check_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_engine_args(value)  # as `vllm serve`'s parser would, less what Iris owns
        return value

    @model_validator(mode="after")
    def _check_builtin_needs(self) -> IrisConfig:
        # A built-in that ships its code is refused here, as any such checkpoint is when the stages load it.
        missing = {k: v for k, v in builtin_engine_args(self.model).items() if self.engine_args.get(k) != v}
        if missing:
            raise ValueError(
                f"{self.model}'s checkpoint needs engine_args {missing}, as every checkpoint of its "
                "format does (it ships code of its own, which every stage runs)"
            )
        return self

    @model_validator(mode="after")
    def _check_models(self) -> IrisConfig:
        if not self.models:
            return self
        own = sorted((self.model_fields_set & set(MODEL_FIELDS)) - {"tenant_limits"})
        if own:
            raise ValueError(f"{own} belong to a model: with `models`, set them in each of its entries")
        names: dict[str, str] = {}  # route name (served name or adapter) -> its model
        deployments: dict[str, str] = {}
        for config in self.model_configs():
            for name in (config.model_name, *adapter_names(config.engine_args)):
                if name in names:
                    raise ValueError(
                        f"models: two models answer to {name!r} ({names[name]!r} and {config.model_name!r}); "
                        "requests are routed by name: give each a served_model_name (and adapter names) of its own"
                    )
                names[name] = config.model_name
            other = deployments.setdefault(config.deployment_suffix, config.model_name)
            if other != config.model_name:
                raise ValueError(
                    f"models: {other!r} and {config.model_name!r} would share the deployment names "
                    f"`<Stage>:{config.deployment_suffix}`: give one a served_model_name of its own"
                )
        return self

    def own_tenant_limits(self) -> dict[str, TenantLimits]:
        """The models whose entries set tenant limits of their own, by served name."""
        return {
            config.model_name: config.tenant_limits
            for config, entry in zip(self.model_configs(), self.models)
            if "tenant_limits" in entry
        }

    def model_configs(self) -> list[IrisConfig]:
        """One config per model served: the app's settings with each entry's (or this one, without `models`)."""
        if not self.models:
            return [self]
        configs = []
        for index, entry in enumerate(self.models):
            shared = sorted(set(entry) - set(MODEL_FIELDS))
            if shared:
                raise ValueError(f"models[{index}]: {shared} are the app's, set at the top level (not per model)")
            try:
                own = IrisConfig.model_validate(entry)
            except ValidationError as err:
                problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}" for e in err.errors())
                raise ValueError(f"models[{index}]: {problems}") from None
            update = {name: getattr(own, name) for name in MODEL_FIELDS if name in entry or name != "tenant_limits"}
            configs.append(self.model_copy(update={**update, "models": []}))
        return configs

    @property
    def deployment_suffix(self) -> str:
        return deployment_suffix(self.model_name)

    @model_validator(mode="after")
    def _check_placement(self) -> IrisConfig:
        self.decode_ranks()  # a parallel setting no placement can run is refused at build time
        return self

    def decode_ranks(self) -> Placement:
        """Where one LLMDecode replica's vLLM ranks run (deployments/placement.py)."""
        return plan(self.engine_args, self.decode_placement)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def takes_media(self) -> bool:
        """Whether the model takes images or videos at all (vLLM's config says so); False for a text-only
        model, which LLMDecode serves alone (no Preprocess, no VisionEncoder)."""
        return takes_media(resolve_model(self.model), model_settings(self.engine_args))

    def vision_model(self) -> VisionModel:
        """vLLM's image and video path for this model, built alike by every stage so that they agree
        (processor settings, dtype, fingerprint): with the model settings of `engine_args` (revision,
        tokenizer, trust_remote_code, hf_overrides, ...), which LLMDecode's engine gets too."""
        return VisionModel(
            resolve_model(self.model),
            self.dtype,
            {"image": self.max_images_per_prompt, "video": self.max_videos_per_prompt},
            connector=self.decoder_features == "connector",
            settings=model_settings(self.engine_args),
        )
