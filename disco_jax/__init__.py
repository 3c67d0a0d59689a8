"""disco-jax: joint operator fusion and AllReduce tensor fusion for distributed JAX training.

Decorate a jitted data-parallel training step with `@optimize_distributed`. Run once with
`ENABLE_SEARCH=1` to search for, validate and store a plan; later runs apply the stored plan.
See README.md for the data flow (capture -> graph -> profile -> cost -> search -> rewrite -> plan).
"""

from disco_jax import backends, cost
from disco_jax._api import OptimizedStep, optimize_distributed
from disco_jax._distributed import PlanMismatchError, initialize_from_env
from disco_jax._graph import Graph, build_graph
from disco_jax._options import StepReport, search_enabled
from disco_jax._plan import Plan, PlanWarning, find_plan, read_plan_file
from disco_jax._profile_db import Profile, ProfileDatabase
from disco_jax._program import Program, build_program
from disco_jax._search import SearchConfig, SearchResult, backtracking_search
from disco_jax._strategy import Strategy, start_candidates, unfused, xla_default
from disco_jax.cost import (
    AllReduceCost,
    AllReduceCostModel,
    AnalyticalEstimator,
    CalibratedEstimator,
    ChainEstimator,
    CostModel,
    Estimator,
    SimulatedStep,
    SimulatorParams,
    TableEstimator,
    chain,
    register_estimator,
    simulate,
)

__version__ = "0.1.0"

__all__ = [
    "AllReduceCost",
    "AllReduceCostModel",
    "AnalyticalEstimator",
    "CalibratedEstimator",
    "ChainEstimator",
    "CostModel",
    "Estimator",
    "Graph",
    "OptimizedStep",
    "Plan",
    "PlanMismatchError",
    "PlanWarning",
    "Program",
    "Profile",
    "ProfileDatabase",
    "SearchConfig",
    "SearchResult",
    "SimulatedStep",
    "SimulatorParams",
    "StepReport",
    "Strategy",
    "TableEstimator",
    "backends",
    "backtracking_search",
    "build_graph",
    "build_program",
    "chain",
    "cost",
    "find_plan",
    "initialize_from_env",
    "optimize_distributed",
    "read_plan_file",
    "register_estimator",
    "search_enabled",
    "simulate",
    "start_candidates",
    "unfused",
    "xla_default",
]
