"""``mmcache bench URL``: load any OpenAI-compatible deployment with a chosen workload."""
