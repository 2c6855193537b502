#!/usr/bin/env bash
# The GPU session's one command (issue #15): set-up, `pytest -m cuda`, the issue's table and a
# profile of decode steps, everything written under $OUT (default ./out/gpu).
#
#   bash tools/gpu_run.sh                 # every stage (about 15-20 minutes on an H100)
#   bash tools/gpu_run.sh setup test      # some stages (a device run may last 10 minutes:
#   bash tools/gpu_run.sh setup bench     #  split the stages over runs of one warm machine)
#
# Stages: setup (the GPU kit: shared/gpu/setup.sh), test (pytest -m cuda), bench (dynamic KV,
# the cuda-graph backend and the eager one, vs transformers, at 4K and 32K), tiered (32K, 90% of
# the KV on the host), profile (torch.profiler traces of decode steps, eager vs cuda-graph, 4K
# and 32K). A stage that fails is reported and the next one runs; the exit status is the
# number of failed stages.
set -uo pipefail
OUT=${OUT:-out/gpu}
CONFIG=${CONFIG:-configs/llama-3.2-1b.json}
NEW_TOKENS=${NEW_TOKENS:-128}
mkdir -p "$OUT"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(setup test bench tiered profile)
bench=(hybridllm bench --random-weights "$CONFIG" --device cuda --dtype bfloat16 --new-tokens "$NEW_TOKENS"
       --repeat 3 --prefill-chunk 8192)  # 3: the median skips a run that captured a new key span
failed=0

run() {  # run NAME SECONDS COMMAND...: the command's output in $OUT/NAME.log, its status noted
  local name=$1 seconds=$2
  shift 2
  echo "== $name: $*" | tee -a "$OUT/stages.txt"
  timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
  local status=${PIPESTATUS[0]}
  echo "== $name: exit $status" | tee -a "$OUT/stages.txt"
  [ "$status" -eq 0 ] || failed=$((failed + 1))
}

for stage in "${stages[@]}"; do
  case $stage in
    setup)
      kit=$(ls -d shared/gpu ../shared/gpu 2>/dev/null | head -1)
      run setup 300 bash "$kit/setup.sh"
      nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
      python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" \
        > "$OUT/torch.txt" 2>&1 ;;
    test)
      run test 600 python3 -m pytest -q -p no:cacheprovider -m cuda tests ;;
    bench)  # the rows: ours (cuda-graph, eager) and transformers at 4K and 32K
      run bench_cuda_graph 900 "${bench[@]}" --prompt-tokens 4K,32K --kv-cache dynamic --decode-backend cuda-graph \
        --baseline transformers --json "$OUT/bench_cuda_graph.json" --markdown "$OUT/bench_cuda_graph.md"
      run bench_eager 600 "${bench[@]}" --prompt-tokens 4K,32K --kv-cache dynamic --decode-backend eager \
        --baseline none --json "$OUT/bench_eager.json" --markdown "$OUT/bench_eager.md" ;;
    tiered)  # cuda-graph serves dense KV only: the tiered row runs the eager backend
      run bench_tiered 600 "${bench[@]}" --prompt-tokens 32K --kv-cache tiered --kv-offload-percent 90 \
        --decode-backend eager --baseline none --json "$OUT/bench_tiered.json" --markdown "$OUT/bench_tiered.md" ;;
    profile)
      for context in 4096 32768; do
        run "profile_$context" 600 python3 tools/gpu_profile.py --random-weights "$CONFIG" --context "$context" \
          --backends eager,cuda-graph --out "$OUT/profile"
      done ;;
    *)
      echo "unknown stage $stage (setup, test, bench, tiered, profile)"; failed=$((failed + 1)) ;;
  esac
done
echo "results under $OUT; $failed stage(s) failed"
exit "$failed"
