"""hybridllm: local LLM inference that decides, and honours, where every byte lives."""

from hybridllm.config import EngineConfig, KVConfig, ModelConfig, SamplingParams, StructuredOutput
from hybridllm.engine.llm_engine import GenerationResult
from hybridllm.errors import HybridLLMError
from hybridllm.llm import LLM

__all__ = [
    "LLM", "SamplingParams", "StructuredOutput", "GenerationResult", "ModelConfig", "EngineConfig", "KVConfig",
    "HybridLLMError",
]
__version__ = "0.1.0"
