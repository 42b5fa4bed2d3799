"""The tiered system in one process: the one `Router` over in-process tiers, behind a synchronous façade for the
CLI, evaluation, training rollouts and benchmarks (`generation.py`)."""
