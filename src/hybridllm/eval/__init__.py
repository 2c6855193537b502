"""Quality evaluations: perplexity and KL divergence against the float reference."""

from hybridllm.eval.perplexity import PerplexityResult, evaluate_perplexity, load_text

__all__ = ["PerplexityResult", "evaluate_perplexity", "load_text"]
