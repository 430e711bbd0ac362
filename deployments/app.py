"""The public surface: `build_app(args)` returns the Iris application.

serve run serve_config.yaml              # import_path: deployments.app:build_app
serve.run(build_app({"model": "builtin:tiny-qwen2-vl"}))
"""

from __future__ import annotations

import logging

from pydantic import ValidationError
from ray.serve import Application

from deployments.config import IrisConfig
from deployments.decode import LLMDecode
from deployments.encoder import VisionEncoder
from deployments.ingress import Ingress
from deployments.preprocess import Preprocess
from pipeline.tenancy.auth import KeyRing

logger = logging.getLogger("ray.serve")
SHUTDOWN_MARGIN_S = 10.0  # beyond request_timeout_s: the answer's last bytes, the replica's own shutdown


def build_app(args: dict | None = None) -> Application:
    try:
        config = IrisConfig.model_validate(args or {})
    except ValidationError as err:
        raise ValueError(f"invalid Iris application args:\n{err}") from None
    try:
        KeyRing.load(config.auth)  # each ingress replica loads the keys itself; a bad file or variable stops here
    except ValueError as err:
        raise ValueError(f"invalid Iris application args: {err}") from None
    _report_redis(config)
    return iris_application(config)


def iris_application(config: IrisConfig, **ingress_options) -> Application:
    """The deployment graph: per model served, Preprocess and VisionEncoder (none for a text-only
    model) and LLMDecode, each named `<Stage>:<model>` in an app of several; one Ingress for all.
    A replica that an update (`serve deploy` of a changed config) or a scale-down stops finishes
    its requests first: the Ingress's and LLMDecode's for as long as a request may take (Serve's
    default, 20 s, cut longer answers, and the Ingress's requests that wait for a replacing decode
    replica)."""
    drain = {"graceful_shutdown_timeout_s": config.request_timeout_s + SHUTDOWN_MARGIN_S}
    stages = []
    for model in config.model_configs():
        # Several vLLM ranks per replica: a placement group per replica (deployments/placement.py).
        decode_options = {
            "name": deployment_name("LLMDecode", config, model),
            **drain,
            **model.decode_ranks().serve_options(),
        }
        decode = LLMDecode.options(**decode_options).bind(model)
        preprocess = encoder = None
        if model.takes_media():
            preprocess = Preprocess.options(name=deployment_name("Preprocess", config, model)).bind(model)
            encoder = VisionEncoder.options(name=deployment_name("VisionEncoder", config, model)).bind(model)
        stages.append((model, preprocess, encoder, decode))
    return Ingress.options(**{**drain, **ingress_options}).bind(config, stages)


def deployment_name(stage: str, app: IrisConfig, model: IrisConfig) -> str:
    """The stage's own name in an app of one model; `<Stage>:<model>` in an app of several (`models:`)."""
    return f"{stage}:{model.deployment_suffix}" if app.models else stage


def _report_redis(config: IrisConfig) -> None:
    """Iris starts without Redis (L1 only); say so up front."""
    url = config.cache.redis_url
    if url is None:
        logger.warning("Iris: no redis_url configured; the feature cache is per process (L1 only)")
        return
    from cache_service.redis_client import REDIS_ERRORS, connect_blocking, redacted

    try:
        connect_blocking(config.cache, "iris-start-up").ping()
    except (*REDIS_ERRORS, ValueError) as err:  # url logged unexpanded and redacted: no password in logs
        logger.warning(
            "Iris: Redis at %s is not reachable (%s); starting with the in-process cache only, "
            "reconnecting in the background",
            redacted(url),
            err,
        )
