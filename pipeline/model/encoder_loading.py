"""vLLM's model class for a checkpoint built encoder-only (`mm_encoder_only`: the tower
and projector; the language model is neither allocated nor loaded), outside an engine,
with a hash of its weights taken as they were loaded."""

from __future__ import annotations

import contextlib
import tempfile
import threading

import torch

from cache_service.keys import content_hash

# vLLM's torch.distributed state is per process: one model is built at a time.
_DISTRIBUTED_LOCK = threading.Lock()


def load_encoder_only(vllm_config) -> tuple[torch.nn.Module, str]:
    """The model on vLLM's device, and the digest of its weights."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader

    # What get_model does, with the weights hashed as loaded: vLLM then repacks some
    # into kernel formats (on the CPU, linear weights into oneDNN handles, leaving
    # empty parameters), which would hide them from a hash of the finished model.
    loader = get_model_loader(vllm_config.load_config)
    load_weights = loader.load_weights
    digest: list[str] = []

    def load_and_hash(model, model_config):
        load_weights(model, model_config)
        digest.append(_weights_digest(model))

    loader.load_weights = load_and_hash
    with set_current_vllm_config(vllm_config), process_group_of_one():
        model = loader.load_model(vllm_config=vllm_config, model_config=vllm_config.model_config)
    return model, digest[0]


def _weights_digest(model: torch.nn.Module) -> str:
    """A hash of every parameter and buffer, byte by byte, with its name and dtype. Tensors left on
    the meta device hold no values to hash (Phi-3-Vision's vLLM class builds its language model's
    embedding there when only the encoder is loaded)."""
    parts = []
    for name, tensor in sorted(model.state_dict().items()):
        if tensor.is_meta:
            continue
        parts += [
            name.encode(),
            str(tensor.dtype).encode(),
            content_hash(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).encode(),
        ]
    return content_hash(b"\0".join(parts))


@contextlib.contextmanager
def process_group_of_one():
    """vLLM's layers ask for their tensor-parallel group while they are built: a group of one.
    It goes again once the model is built (most one-process models never use it; those whose
    forward asks for it get one again for each call, `VisionModel.encode`), since gloo's threads
    would otherwise keep waking the idle replica for good."""
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    with _DISTRIBUTED_LOCK, tempfile.TemporaryDirectory(prefix="iris-vllm-dist-") as rendezvous:
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{rendezvous}/store", backend="gloo"
        )
        ensure_model_parallel_initialized(1, 1)
        try:
            yield
        finally:
            destroy_model_parallel()
            destroy_distributed_environment()
