"""`dspark simulate`: a discrete-event model of a dspark cluster (router, drafter pool, verifier pool).

Modules: `model` (contracts: costs, arms, workload, results), `policies` (verify-length policies, the scheduled
dspark budget through `router.scheduling.budget.plan_budget`), `engine` (the event loop), `metrics` (bench-style
reduction), `calibrate` (constants from a `dspark bench` run and an SPS profile), `studies` (validation, scale,
drafter:verifier ratio) and `report` (markdown and PNG plots).
"""

from __future__ import annotations

from benchmarks.simulator.engine import Simulation, simulate
from benchmarks.simulator.model import Arm, Cluster, CostModel, DraftCost, SimResult, SimWorkload, StepProfile

__all__ = [
           "Arm",
           "Cluster",
           "CostModel",
           "DraftCost",
           "SimResult",
           "SimWorkload",
           "Simulation",
           "StepProfile",
           "simulate",
]
