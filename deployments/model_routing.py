"""Which served model a request is for: an app serves one model, or several behind one endpoint
(`models:` in its config).

Each served model has its own stages (deployments named `<Stage>:<name>`), feature keys (its
fingerprint), text bounds and, where configured, tenant limits. With several, a body is read
within the widest bounds of all, parsed once, and its `model` names the served model: its
served name or one of its LoRA adapters. A body that names none goes to the first model, as
`vllm serve` takes a request without `model`; a name no model has is answered as vLLM answers
it (404 `The model ... does not exist.`)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from ray.serve.handle import DeploymentHandle

from deployments.config import IrisConfig
from deployments.media_features import MediaFeatures
from deployments.request_parsing import Bounds, RequestParser
from pipeline.api.body import parse_body
from pipeline.api.media_parts import MediaItem
from pipeline.errors import IrisError

# A served model's settings and its deployments' handles: Preprocess, VisionEncoder (None for a
# text-only model), LLMDecode.
ModelStages = tuple[IrisConfig, DeploymentHandle | None, DeploymentHandle | None, DeploymentHandle]


@dataclass
class ServedModel:
    config: IrisConfig  # the model's settings (the app's, with its entry's)
    decode: DeploymentHandle
    features: MediaFeatures
    parser: RequestParser
    names: tuple[str, ...]  # what a request may name it by: its served name, then its LoRA adapters

    @property
    def name(self) -> str:
        return self.config.model_name


class ModelRouter:
    def __init__(self, models: list[ServedModel]):
        self.models = models
        self.by_name = {name: model for model in models for name in model.names}

    async def parse(self, route: str, request: Request) -> tuple[ServedModel, Any, list[MediaItem]]:
        """The served model the body names, the body as vLLM's request model, and its media items."""
        if len(self.models) == 1:  # vLLM's serving layer answers a name it does not serve
            model = self.models[0]
            return model, *await model.parser.parse(route, request)
        bounds = await asyncio.gather(*(model.parser.bounds() for model in self.models))
        # The model whose text bound is widest speaks for a text too long for all of them.
        widest_text = max(range(len(bounds)), key=lambda i: bounds[i].max_text or math.inf)
        raw = await self.models[widest_text].parser.read(route, request, Bounds.widest(bounds))
        body = await parse_body(raw)
        model = self.pick(body.get("model"))
        return model, *await model.parser.parse(route, request, raw, body)

    def pick(self, name: Any) -> ServedModel:
        if not isinstance(name, str):  # none: the first model (vLLM's request model refuses a non-string)
            return self.models[0]
        model = self.by_name.get(name)
        if model is None:
            raise IrisError(
                f"The model `{name}` does not exist.", status_code=404, type="NotFoundError", param="model", code=404
            )
        return model
