"""Iris's features in vLLM's own encoder cache: an EC connector (vLLM's `ECConnectorBase`).

vLLM takes no image embeddings for many families (Gemma 3, Mistral 3, Idefics3, ...), but
every family's engine keeps what its tower computed per item in an encoder cache keyed by
the item's `mm_hash` (its `multi_modal_uuids` entry when one is given). An engine with an EC
connector in a consumer role asks the connector, per item, whether that output exists
elsewhere; when it does, the connector's worker side puts it into the encoder cache and the
tower never runs. Iris's VisionEncoder computes exactly what `embed_multimodal` returns, so
this connector hands it over. The engine's processor still runs on the item itself to lay
out the placeholders: the decode replica gives the engine the item's bytes too.

Where the features come from, in order:
- the staging folder (`staging_dir`): LLMDecode writes an item's features there (Iris's
  value codec, file named by `staged_name(key)`) before it calls the engine with the item's
  key as its uuid, and removes them when the request ends (`FeatureStaging`, in
  pipeline/model/ec_staging.py). The engine runs in processes of its own (vLLM's EngineCore,
  its workers): a file in /dev/shm is the cheapest way in, one copy.
- the feature plane (`redis_url`): for an engine that is not Iris's (a plain `vllm serve
  --ec-transfer-config ...`), an item whose uuid is `iris:<uuid>` names Iris's uuid key of
  `<uuid>` for `tenant` under `fingerprint` (the VisionEncoder's, from `/iris/stats`), read
  with the cache's codec and checks. Only identifiers with that prefix, which a client must
  choose on purpose: vLLM's identifier of an item sent without a uuid is the blake3 of model
  id and bytes, computable offline by anyone, so honouring bare identifiers would hand the
  tenant's features to whoever has the image. Such a server has no tenant boundary of its
  own: it serves the one `tenant` it is configured with (run one per tenant).

The scheduler side reads and checks an item's features when its request is first scheduled
(`ensure_cache_available`): rows = the item's placeholder embeds, the model's dtype, the
encoder's width where known. What fails the check, is not there, or fails to read or decode
for any reason, is not claimed (counted as `refused` where it was there): the engine runs
its own tower on the item, so a missing or forged value costs time, never a wrong or failed
answer, and nothing raises in vLLM's scheduler (which would end the EngineCore). Checked tensors
travel to the workers in the step's connector metadata (in-process on one device;
vLLM's message queue to tensor-parallel workers).

Counters (`vllm:iris_ec_loaded_items_total`, `vllm:iris_ec_encoded_items_total`,
`vllm:iris_ec_refused_items_total`: items the connector supplied, items the engine's own tower
encoded, and items whose staged or stored features were there but refused) go through vLLM's EC
connector stats to its logs and Prometheus metrics.

No Ray here: the module runs inside vLLM's engine processes.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)

from cache_service import codec
from cache_service.keys import DEFAULT_NAMESPACE, DEFAULT_TENANT, uuid_key
from cache_service.validation import ValueCheck
from pipeline.model.ec_staging import staged_name, values_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.multimodal.inputs import MultiModalFeatureSpec
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "IrisECConnector"
MODULE_PATH = __name__
# The uuid form a plain server's clients send for features in Iris's cache: `iris:<uuid>`.
UUID_PREFIX = "iris:"
_COUNTERS = ("loaded", "encoded", "refused")


def plane_uuid(identifier: str) -> str | None:
    """The Iris uuid an engine's item identifier asks for (`iris:<uuid>`), else None: a bare
    identifier (a content hash, or a uuid not meant for Iris) is never looked up."""
    if isinstance(identifier, str) and identifier.startswith(UUID_PREFIX) and len(identifier) > len(UUID_PREFIX):
        return identifier[len(UUID_PREFIX) :]
    return None


def ec_transfer_config(staging_dir: str | os.PathLike, widths: dict[str, int]) -> dict:
    """vLLM's `ec_transfer_config` for an engine that takes Iris's features from `staging_dir`."""
    return {
        "ec_connector": CONNECTOR_NAME,
        "ec_connector_module_path": MODULE_PATH,
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"staging_dir": str(staging_dir), "widths": dict(widths)},
    }


@dataclass
class IrisECMetadata(ECConnectorMetadata):
    """One step's items to load: identifier -> checked features (host memory)."""

    items: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class IrisECStats(ECConnectorStats):
    """Items this connector supplied, items the engine's own tower encoded, items refused."""

    def __post_init__(self):
        for name in _COUNTERS:
            self.data.setdefault(name, 0)

    def reset(self):
        self.data = dict.fromkeys(_COUNTERS, 0)

    def aggregate(self, other: ECConnectorStats) -> IrisECStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class IrisECPromMetrics(ECConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, what in (
            ("loaded", "Multimodal items whose encoder output Iris's EC connector supplied"),
            ("encoded", "Multimodal items the engine's own encoder computed (no features from Iris's EC connector)"),
            (
                "refused",
                "Multimodal items whose features Iris's EC connector found but refused "
                "(unreadable, corrupt, or not this model's); the engine encoded them",
            ),
        ):
            counter = self._counter_cls(name=f"vllm:iris_ec_{name}_items", documentation=what, labelnames=labelnames)
            self._counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, per_engine in self._counters.items():
            if transfer_stats_data.get(name):
                per_engine[engine_idx].inc(transfer_stats_data[name])


def connector_counts() -> dict[str, int]:
    """This process's vLLM engine's connector counters, from vLLM's Prometheus metrics (its stat
    loggers run where the engine's client runs): items the connector supplied, items the
    engine's own tower encoded, items refused."""
    from prometheus_client import REGISTRY

    counts = dict.fromkeys(_COUNTERS, 0)
    for family in REGISTRY.collect():
        for name in counts:
            if family.name == f"vllm:iris_ec_{name}_items":
                counts[name] += int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    return counts


class IrisECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        ec = vllm_config.ec_transfer_config
        extra = ec.ec_connector_extra_config
        self._dtype = vllm_config.model_config.dtype
        # Per-token width of the encoder's output per modality, where known: Iris's decoder
        # passes it; an engine that also produces measured it at start-up.
        self._widths = {**extra.get("widths", {}), **ec.mm_encoder_output_widths}
        staging = extra.get("staging_dir")
        self._staging = Path(staging) if staging else None
        self._plane = _FeaturePlane(extra) if extra.get("redis_url") and role == ECConnectorRole.SCHEDULER else None
        if self._staging is None and extra.get("redis_url") is None:
            raise ValueError(f"{CONNECTOR_NAME}: ec_connector_extra_config needs staging_dir or redis_url")
        # Scheduler side.
        self._ready: dict[str, torch.Tensor] = {}  # identifier -> checked features
        self._holders: dict[str, set[str]] = defaultdict(set)  # identifier -> request ids that may load it
        self._checked: set[str] = set()  # request ids whose items were looked up
        self._to_load: dict[str, torch.Tensor] = {}  # this step's loads
        self._stats = IrisECStats()  # since vLLM last collected them
        self.totals = dict.fromkeys(_COUNTERS, 0)  # since start (the in-process engine's tests read them)

    # --- scheduler side -----------------------------------------------------------
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Looks the request's items up once, when it is first scheduled; never defers it."""
        if request.request_id in self._checked:
            return True
        self._checked.add(request.request_id)
        for feature in request.mm_features:
            position = feature.mm_position
            if position.offset + position.length <= num_computed_tokens:
                continue  # within the prefix vLLM has cached: the engine needs no features for it
            if feature.identifier not in self._ready:
                try:
                    values = self._lookup(feature)
                except Exception:  # a bug or a value nobody foresaw: the engine's tower runs, never a crash
                    logger.exception("%s: lookup of an item failed; the engine encodes it itself", CONNECTOR_NAME)
                    self._count("refused")
                    values = None
                if values is None:
                    continue
                self._ready[feature.identifier] = values
            self._holders[feature.identifier].add(request.request_id)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        return identifier in self._ready

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        counted = "encoded"  # the engine's tower runs on it
        if identifier in self._ready:
            self._to_load[identifier] = self._ready[identifier]
            counted = "loaded"
        self._count(counted)

    def _count(self, name: str) -> None:
        self._stats.data[name] += 1
        self.totals[name] += 1

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> IrisECMetadata:
        meta = IrisECMetadata(self._to_load)
        self._to_load = {}
        return meta

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._checked.discard(request.request_id)
        for feature in request.mm_features:
            holders = self._holders.get(feature.identifier)
            if holders is None:
                continue
            holders.discard(request.request_id)
            if not holders:
                del self._holders[feature.identifier]
                self._ready.pop(feature.identifier, None)
        return False, None

    def get_ec_connector_stats(self) -> IrisECStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, IrisECStats()
        return stats

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> IrisECStats:
        return IrisECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> IrisECPromMetrics:
        return IrisECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _lookup(self, feature: MultiModalFeatureSpec) -> torch.Tensor | None:
        """The item's checked features, or None (the engine then encodes the item itself).
        Refused values are counted; nothing here raises for what a file or Redis holds."""
        values, source = None, None
        if self._staging is not None:
            path = self._staging / staged_name(feature.identifier)
            try:
                data = path.read_bytes()
            except FileNotFoundError:
                data = None
            except OSError as err:
                logger.warning("%s: staged features of %s unreadable (%s)", CONNECTOR_NAME, feature.identifier, err)
                data, source = None, "staging"
            if data is not None:
                source = "staging"
                try:
                    values = values_of(codec.decode(data))
                except Exception as err:  # CorruptValue, or anything else a hostile file provokes
                    logger.warning(
                        "%s: staged features of %s undecodable (%s)", CONNECTOR_NAME, feature.identifier, str(err)[:300]
                    )
        if values is None and source is None and self._plane is not None:
            uuid = plane_uuid(feature.identifier)
            if uuid is not None:
                values, source = self._plane.get(uuid, feature.modality), "the feature plane"
                if values is None and self._plane.last_refused:
                    self._count("refused")
                    return None
        if values is None:
            if source == "staging":
                self._count("refused")
            return None
        problem = self._problem(values, feature)
        if problem:
            logger.warning(
                "%s: features of %s from %s refused, the engine encodes the item itself: %s",
                CONNECTOR_NAME,
                feature.identifier,
                source,
                problem,
            )
            self._count("refused")
            return None
        return values

    def _problem(self, values: torch.Tensor, feature: MultiModalFeatureSpec) -> str | None:
        rows = feature.mm_position.get_num_embeds()
        width = self._widths.get(feature.modality)
        if values.ndim != 2 or values.shape[0] != rows:
            return f"shape {list(values.shape)}, the item's placeholder takes {rows} rows"
        if width is not None and values.shape[1] != width:
            return f"{values.shape[1]} wide, the encoder's output is {width}"
        if values.dtype != self._dtype:
            return f"dtype {values.dtype}, the engine's is {self._dtype}"
        if not bool(torch.isfinite(values).all()):
            return "NaN or infinity in the features"
        return None

    # --- worker side --------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs) -> None:
        """Puts this step's checked features into the encoder cache. The scheduler side checked
        them (shape, dtype, finite values), so only the copy to the device remains; a metadata
        entry that is not a tensor (it never is) is skipped rather than raised on."""
        from vllm.platforms import current_platform

        meta = self._get_connector_metadata()
        items = meta.items if isinstance(meta, IrisECMetadata) else {}
        device = current_platform.device_type
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        for identifier, values in items.items():
            if identifier not in encoder_cache and isinstance(values, torch.Tensor):
                encoder_cache[identifier] = values.to(device, non_blocking=True)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs) -> None:
        return  # a consumer: what the engine computes stays in the engine


class _FeaturePlane:
    """Iris's feature store (Redis or Redis Cluster) read by uuid, from an engine that is not Iris's.

    ec_connector_extra_config: redis_url (${NAME} expanded from the environment), redis_cluster,
    namespace, fingerprint (required: the VisionEncoder's, `GET /iris/stats`), tenant (whose
    uuids this engine's clients send; "default" when Iris runs without API keys),
    redis_timeout_s, backoff_initial_s, backoff_max_s. Reads only: a refused value is left in
    Redis (Iris's own readers delete it) and `last_refused` says the last read refused one."""

    def __init__(self, extra: dict):
        from cache_service.config import CacheConfig
        from cache_service.store_factory import blocking_reader

        fingerprint = extra.get("fingerprint")
        if not fingerprint:
            raise ValueError(
                f"{CONNECTOR_NAME}: redis_url needs the model's fingerprint in ec_connector_extra_config "
                "(Iris's GET /iris/stats: model.fingerprint)"
            )
        self.fingerprint = fingerprint
        self.namespace = extra.get("namespace", DEFAULT_NAMESPACE)
        self.tenant = extra.get("tenant", DEFAULT_TENANT)
        timeout = float(extra.get("redis_timeout_s", 1.0))
        config = CacheConfig(
            redis_url=extra["redis_url"],
            redis_cluster=bool(extra.get("redis_cluster")),
            namespace=self.namespace,
            redis_timeout_s=timeout,
            redis_connect_timeout_s=timeout,
            backoff_initial_s=float(extra.get("backoff_initial_s", 1.0)),
            backoff_max_s=float(extra.get("backoff_max_s", 30.0)),
        )
        self.read = blocking_reader(config, "iris-ec-connector")
        self.check = ValueCheck()  # the value's stamped fingerprint and modality must be the key's
        self.last_refused = False

    def get(self, uuid: str, modality: str) -> torch.Tensor | None:
        """The features Iris stored for `uuid` (the client's, without the `iris:` prefix) of
        `tenant`, checked; None when absent, unreadable or refused. Never raises."""
        self.last_refused = False
        try:
            key = uuid_key(self.fingerprint, self.tenant, uuid, self.namespace, modality)
        except ValueError as err:  # e.g. an over-long uuid
            logger.warning("%s: feature plane lookup of %r failed: %s", CONNECTOR_NAME, uuid[:80], err)
            return None
        data = self.read(key)
        if data is None:
            return None
        try:
            features = codec.decode(data)
            problem = self.check.problem(key, features)
            values = values_of(features) if problem is None else None
        except Exception as err:  # CorruptValue, or anything else a hostile value provokes
            problem = f"unreadable: {str(err)[:300]}"
        if problem is None and values is None:
            problem = "no single 2-D floating-point tensor of features"
        if problem is not None:
            self.last_refused = True
            logger.warning("%s: value of %s refused: %s", CONNECTOR_NAME, key, problem)
            return None
        return values
