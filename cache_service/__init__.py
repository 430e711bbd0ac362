"""Cluster-wide cache of vision-encoder features: L1 in process, L2 in Redis.

No Ray in here; the Ray Serve deployments use it as a plain library. Import
from the modules (`cache_service.keys`, `cache_service.feature_cache`, ...):
this file re-exports nothing, so computing a key does not import torch.
"""
