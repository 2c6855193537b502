"""``python -m hybridllm.cli``."""

from hybridllm.cli import main

main()
