#!/usr/bin/env bash
# Runs named stages on the GPU machine, each with its own time limit, never stopping at a failing
# one; logs and results land in $OUT/results.tar.gz (the device tool returns at most 8 files).
# usage: [DS_STAGES_NAME=results] scripts/gpu/run_stages.sh SECONDS:NAME:COMMAND ...
# Several runs side by side (one per GPU, CUDA_VISIBLE_DEVICES) need distinct DS_STAGES_NAMEs:
# each writes /tmp/ds-NAME and $OUT/NAME.tar.gz.
set -u
out=${OUT:-/tmp/out}
name_=${DS_STAGES_NAME:-results}
work=/tmp/ds-$name_
rm -rf "$work"; mkdir -p "$work/logs"
export DECODESCOPE_RESULTS="$work"
export PYTHONUNBUFFERED=1 COLUMNS=200
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem --format=csv > "$work/logs/nvidia-smi.csv" 2>&1
summary="$work/summary.txt"
for spec in "$@"; do
  secs=${spec%%:*}; rest=${spec#*:}; name=${rest%%:*}; cmd=${rest#*:}
  t0=$(date +%s)
  timeout --kill-after=10 "$secs" bash -c "$cmd" > "$work/logs/$name.log" 2>&1
  rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$summary"
  tail -n 25 "$work/logs/$name.log" | sed "s/^/  [$name] /"
done
tar czf "$out/$name_.tar.gz" -C "$work" .
cat "$summary"
