"""ImageAffinityRouter: sends requests for the same image to the same LLMDecode replica.

vLLM's prefix cache lives in each decode replica; the feature cache already spares
the encoder on a repeat, this router spares the prefill. Selected in
serve_config.yaml:

    request_router_config:
      request_router_class: deployments.image_affinity_router:ImageAffinityRouter
      request_router_kwargs: {max_load_factor: 1.5}

This is Iris's own router, a subclass of Serve's pluggable `RequestRouter` base
class: it replaces Serve's default router (`PowerOfTwoChoicesRequestRouter`) for
LLMDecode, it does not extend it. `choose_replicas` returns ranks of replicas; the
base class tries them in order and, within a rank, takes the replica with the
shortest queue that accepts the request. The key is the request's Serve `session_id`, which
the ingress sets to the first image's key (deployments/decode_stream.py); the ranking itself is
`deployments.affinity`: rendezvous hashing on that key with a load bound. Requests
without images get two random replicas from `deployments.affinity.two_choices`, Iris's
copy of the power-of-two-choices step, so the shorter of two queues wins. None of
the default router's mixins are used: no FIFOMixin (it would hand the replica chosen
for one request's image to whichever request is oldest), no LocalityMixin (same-node
preference), no MultiplexMixin.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from deployments.affinity import ReplicaLoad, rank_for_key, two_choices


class ImageAffinityRouter(RequestRouter):
    def initialize_state(self, max_load_factor: float = 1.5, **unknown: Any) -> None:
        if unknown:
            raise ValueError(f"ImageAffinityRouter: unknown request_router_kwargs {sorted(unknown)}")
        if not isinstance(max_load_factor, (int, float)) or max_load_factor < 1:
            raise ValueError(f"ImageAffinityRouter: max_load_factor must be a number >= 1, got {max_load_factor!r}")
        self._max_load_factor = float(max_load_factor)
        # Requests this process sent and that have not finished, per replica: the
        # load signal when Serve's queue-length cache has no fresh entry.
        self._sent: Counter[ReplicaID] = Counter()
        self._sent_by_request: dict[str, ReplicaID] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = pending_request.metadata.session_id if pending_request is not None else ""
        if not key:
            return [[by_id[rid] for rid in two_choices(list(by_id))]] if by_id else []
        loads = [ReplicaLoad(rid, self._in_flight(r), r.max_ongoing_requests) for rid, r in by_id.items()]
        return [[by_id[rid] for rid in rank] for rank in rank_for_key(key, loads, self._max_load_factor)]

    def _in_flight(self, replica: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        return cached if cached is not None else self._sent[replica.replica_id]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._sent[replica_id] += 1
        self._sent_by_request[pending_request.metadata.internal_request_id] = replica_id

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._sent_by_request.pop(internal_request_id, None) is not None and self._sent[replica_id] > 0:
            self._sent[replica_id] -= 1
