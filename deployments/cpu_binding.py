"""Which CPU cores a vLLM engine on a CPU-only node binds its OpenMP threads to.

vLLM's default (`VLLM_CPU_OMP_THREADS_BIND=auto`) binds an engine to all cores but
the last, which it leaves to the processes around the engine. Every engine on the
node gets that same set, so two engines oversubscribe it twice over. Engines that
know their place among the node's engines split the set between them instead.
"""

from __future__ import annotations


def omp_threads_bind(index: int, engines: int, core_ids: list[int], reserve: int = 1) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for engine `index` of `engines` on the cores `core_ids`,
    leaving the last `reserve` of them to other processes (as vLLM does); None keeps
    vLLM's default (one engine). Contiguous slices, the first ones a core larger when
    the cores do not divide evenly; with more engines than cores they share round-robin."""
    if engines <= 1:
        return None
    ids = sorted(core_ids)
    usable = ids[:-reserve] if reserve and len(ids) > reserve else ids
    index %= engines
    if engines >= len(usable):
        return str(usable[index % len(usable)])
    per, extra = divmod(len(usable), engines)
    start = index * per + min(index, extra)
    return ",".join(map(str, usable[start : start + per + (index < extra)]))


def rank_binds(core_ids: list[int], ranks: int, reserve: int = 1) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for one engine of `ranks` CPU workers (tensor or pipeline parallel) on
    `core_ids`: one core list per rank, `|`-separated (vLLM's format), leaving the last `reserve` cores
    to other processes where every rank still gets a core of its own. vLLM's default (`auto`) gives
    rank N the N-th NUMA node, which a one-node machine does not have."""
    ids = sorted(core_ids)
    if reserve and len(ids) - reserve >= ranks:
        ids = ids[:-reserve]
    return "|".join(omp_threads_bind(rank, ranks, ids, reserve=0) for rank in range(ranks))
