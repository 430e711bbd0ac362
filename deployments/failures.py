"""What a client sees of an unexpected exception: 504 past the request's deadline, 503 when
a replica of a stage died under the request or a stage has no replica to take it (a node lost,
docs/operations.md: losing a node), 500 for anything else (a bug, logged)."""

from __future__ import annotations

import logging

from ray.exceptions import (
    NodeDiedError,
    ObjectLostError,
    RayActorError,
    WorkerCrashedError,
)
from ray.serve.exceptions import DeploymentUnavailableError

from pipeline.errors import IrisError, causes, server_error

logger = logging.getLogger("ray.serve")


def failure_response(err: BaseException, what: str, timeout_s: float) -> IrisError:
    if isinstance(err, IrisError):
        return err
    if isinstance(err, TimeoutError):
        return server_error(
            f"the request took longer than the server's limit of {timeout_s:g} s", code="timeout", status_code=504
        )
    if stage_failed(err):
        logger.warning("%s: a replica failed: %r", what, err)
        return server_error(
            "a serving replica failed while handling this request; retry it",
            code="replica_unavailable",
            status_code=503,
        )
    logger.error("%s", what, exc_info=err)
    return server_error("internal error", code="internal_error")


def stage_failed(err: BaseException | None) -> bool:
    """Whether `err` says a replica of a downstream stage died or became unreachable
    (killed, crashed, its node lost: RayActorError covers ActorDiedError and ActorUnavailableError,
    ObjectLostError the owner's death and failed reconstruction), or that a stage has no replica
    at all (Serve's DeploymentUnavailableError, a 503 in Serve's own proxy too), as opposed to a bug."""
    # Causes nest: a task error caused by an actor's death, Serve's error for a dead upstream, ...
    return any(
        isinstance(e, (RayActorError, WorkerCrashedError, ObjectLostError, NodeDiedError, DeploymentUnavailableError))
        for e in causes(err)
    )
