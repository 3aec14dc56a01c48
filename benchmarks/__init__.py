"""mmcache benchmarks: each module measures ratios in one run and ends with ``RESULT`` lines.

Run one with ``python -m mmcache.benchmarks.<name> [--quick]`` or all with ``mmcache bench [names]``.
"""

MODULES = ("hashing", "processor_cache", "encoder", "encoder_routing", "llm", "structured", "metrics")
