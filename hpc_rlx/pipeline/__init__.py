"""Pipeline parallelism: a model split into stages across ranks (``parallel.pipeline_stages``).

schedule (pure: GPipe and 1F1B action lists, their time grid, idle slots and live activations).
"""
