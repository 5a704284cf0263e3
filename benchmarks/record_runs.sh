# Sourced by the benchmark scripts that start several recipe runs in one command (RESULTS, SKIP_STEPS and ROOT set):
#   record_run RUN DIR STATUS JSONL: copies DIR/metrics.jsonl to RESULTS/metrics-RUN.jsonl; status 0 adds DIR to
#     done_runs, another (a failure; 124: cut by timeout) is printed and appended to JSONL as {"run", "failed"};
#   summarize_runs JSONL: benchmarks/summarize.py over done_runs (medians after SKIP_STEPS), its rows appended to JSONL.
done_runs=()
record_run() {
  local run=$1 dir=$2 rc=$3 jsonl=$4
  if [ -f "$dir/metrics.jsonl" ]; then cp "$dir/metrics.jsonl" "$RESULTS/metrics-$run.jsonl"; fi
  if [ "$rc" = 0 ]; then
    done_runs+=("$dir")
  else
    echo "run $run failed with exit status $rc" >&2
    echo "{\"run\": \"$run\", \"failed\": $rc}" >> "$jsonl"
  fi
}
summarize_runs() {
  if [ ${#done_runs[@]} -gt 0 ]; then
    python3 "$ROOT/benchmarks/summarize.py" --skip-steps "$SKIP_STEPS" --json "$1" "${done_runs[@]}"
  fi
}
