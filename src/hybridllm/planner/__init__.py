"""The planner: where weights and KV should live for a model on a machine, and how fast it will run.

By concern: :mod:`.memory` (bytes of weights and KV per tier), :mod:`.roofline` (TTFT and decode
TPS from bandwidths and FLOP rates), :mod:`.search` (candidates, the best fit), :mod:`.explain`
(the result, its JSON and the reason), :mod:`.inputs` (model numbers and machine figures),
:mod:`.capacity` (engine replicas for a target decode rate).
"""

from hybridllm.planner.explain import PlanResult
from hybridllm.planner.inputs import hardware_from, load_model_config
from hybridllm.planner.memory import (
    KV_DTYPES,
    WEIGHT_FORMATS,
    WeightBytes,
    kv_bytes_per_token,
    matrix_bytes,
    weight_bytes,
)
from hybridllm.planner.roofline import Candidate, Hardware, Prediction, predict
from hybridllm.planner.search import (
    PlanError,
    candidates,
    device_only_max_context,
    engine_weight_formats,
    plan,
    predicted_for_run,
)

__all__ = [
    "KV_DTYPES",
    "WEIGHT_FORMATS",
    "Candidate",
    "Hardware",
    "PlanError",
    "PlanResult",
    "Prediction",
    "WeightBytes",
    "candidates",
    "device_only_max_context",
    "engine_weight_formats",
    "hardware_from",
    "kv_bytes_per_token",
    "load_model_config",
    "matrix_bytes",
    "plan",
    "predict",
    "predicted_for_run",
    "weight_bytes",
]
