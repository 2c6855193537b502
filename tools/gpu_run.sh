#!/usr/bin/env bash
# The GPU session's one command (issues #15, #30): every stage of tools/gpu_run.py, results under
# $OUT (default out/gpu); every stage takes ~13 minutes on an H100, so a session runs two commands
# (docs/benchmarks.md, "GPU"). Its --help tells the stages and options:
#   bash tools/gpu_run.sh                        # every stage
#   bash tools/gpu_run.sh --stages long_context  # a second command: some stages
#   bash tools/gpu_run.sh --dry-run --out DIR    # the same stages on the CPU, tiny shapes
cd "$(dirname "${BASH_SOURCE[0]}")/.." && exec "${PYTHON:-python3}" tools/gpu_run.py "$@"
