"""Which CPU cores a vLLM engine on a CPU-only node binds its OpenMP threads to.

vLLM's default (`VLLM_CPU_OMP_THREADS_BIND=auto`) binds every engine on a node to
the same cores (all but the last, which it leaves to other processes), so two
engines on one node take turns on those cores while the rest sit idle. Engines
that know their place among the node's engines take a slice of their own instead.
"""

from __future__ import annotations


def omp_threads_bind(index: int, engines: int, core_ids: list[int]) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for engine `index` of `engines` sharing the cores
    `core_ids`; None keeps vLLM's default (one engine). With more engines than cores
    they share cores round-robin."""
    if engines <= 1:
        return None
    ids = sorted(core_ids)
    index %= engines
    if engines >= len(ids):
        return str(ids[index % len(ids)])
    per = len(ids) // engines
    return ",".join(map(str, ids[index * per:(index + 1) * per]))
