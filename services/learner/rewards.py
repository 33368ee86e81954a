"""Re-export of services/common/rewards.py for services/world/oracle.py only.

The reward code lives in services/common/rewards.py, below both its users (the learner and the
world's oracle). oracle.py still imports it from here because its source is part of the world's
cache key (services/common/paths.py, GENERATOR_MODULES): editing even its import line would rebuild
every cached world. Point that import at services.common.rewards the next time oracle.py changes
anyway, then delete this file. Nothing else may import it.
"""

from services.common.rewards import multi_objective_em  # noqa: F401
