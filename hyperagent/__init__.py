"""hyperagent: a GPU-cluster monitoring agent and a closed-loop tuner for distributed training."""

__version__ = "0.1.0"
