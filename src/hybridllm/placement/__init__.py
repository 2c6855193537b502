"""Where weights and KV live: the ``Placement`` data, the planner, and applying a placement."""

from hybridllm.placement.placement import Placement

__all__ = ["Placement"]
