"""deployments/failures.py: what a client sees of the errors Ray and Serve raise when a replica or
its node is lost (503 `replica_unavailable`), past the deadline (504) and of a bug (500). The
errors are Ray's own classes, raised as a lost node raises them (tests/test_node_loss.py shows it
on a real cluster); no cluster is started here."""

from __future__ import annotations

import pytest
from ray.exceptions import (
    ActorDiedError,
    ActorUnavailableError,
    NodeDiedError,
    ObjectReconstructionFailedError,
    OwnerDiedError,
    RayTaskError,
    WorkerCrashedError,
)
from ray.serve.exceptions import DeploymentUnavailableError, RayServeException

from deployments.failures import failure_response
from pipeline.errors import bad_request


def _serve_upstream_crash() -> RayServeException:
    """Serve's error for a call whose argument came from a replica that died (its router's
    _make_upstream_crash_error: the ActorDiedError is the cause)."""
    try:
        try:
            raise ActorDiedError()
        except ActorDiedError as err:
            raise RayServeException("an upstream actor died") from err
    except RayServeException as err:
        return err


LOST = {
    "actor died": ActorDiedError(),
    "actor unreachable": ActorUnavailableError("connection refused", None),
    "owner died": OwnerDiedError("ff" * 28, None, ""),
    "object not reconstructable": ObjectReconstructionFailedError("ff" * 28),
    "node died": NodeDiedError("node lost"),
    "worker crashed": WorkerCrashedError(),
    "task failed for a dead actor": RayTaskError("encode", "traceback", ActorDiedError()),
    "serve: upstream died": _serve_upstream_crash(),
    "serve: no replica": DeploymentUnavailableError("LLMDecode"),  # (Serve passes its DeploymentID),
}


@pytest.mark.parametrize("err", LOST.values(), ids=LOST.keys())
def test_a_lost_replica_or_node_is_a_503(err):
    error = failure_response(err, "test", 10)
    assert error.status_code == 503 and error.code == "replica_unavailable" and error.type == "server_error"
    assert set(error.to_dict()["error"]) == {"message", "type", "param", "code"}


def test_past_the_deadline_is_a_504_and_a_bug_a_500():
    timeout = failure_response(TimeoutError(), "test", 10)
    assert (timeout.status_code, timeout.code) == (504, "timeout") and "10 s" in timeout.message
    bug = failure_response(KeyError("x"), "test", 10)
    assert (bug.status_code, bug.code) == (500, "internal_error") and "x" not in bug.message
    refusal = bad_request("no", param="messages")
    assert failure_response(refusal, "test", 10) is refusal
