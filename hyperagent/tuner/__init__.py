"""Closed-loop tuning of distributed-training settings: the search space and the optimiser."""

from hyperagent.tuner.optimizer import Tuner
from hyperagent.tuner.space import SearchSpace, Settings

__all__ = ["SearchSpace", "Settings", "Tuner"]
