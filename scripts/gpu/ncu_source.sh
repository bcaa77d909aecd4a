#!/usr/bin/env bash
# Nsight Compute with source counters: where one kernel's warps stall, per SASS instruction.
# Profiles the kernels whose name matches REGEX in one decode step (scripts/gpu_ncu.py, caches
# flushed, serialized) with the warp-state and source-counter sections, then writes
# DIR/NAME.txt (details page), DIR/NAME.sass.csv (per SASS instruction: the stall samples by
# reason) and DIR/NAME.top.txt (scripts/ncu_stalls.py: the stall reasons and the top lines).
# usage: scripts/gpu/ncu_source.sh DIR NAME REGEX [gpu_ncu.py options...]
#   e.g. scripts/gpu/ncu_source.sh $OUT/ncu kda8 KDADecode --backend specialized --tp 16 \
#        --batch 64 --tokens 8 --layers dense
set -u
dir=$1; name=$2; regex=$3; shift 3
mkdir -p "$dir"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$NCU" --profile-from-start off --clock-control none --kernel-name "regex:$regex" \
  --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats --section SourceCounters \
  --import-source no -f -o "$dir/$name" python3 scripts/gpu_ncu.py "$@"
rc=$?
"$NCU" --import "$dir/$name.ncu-rep" --page details > "$dir/$name.txt" 2>&1
"$NCU" --import "$dir/$name.ncu-rep" --page source --csv --print-source sass \
  > "$dir/$name.sass.csv" 2>&1
python3 scripts/ncu_stalls.py "$dir/$name.sass.csv" > "$dir/$name.top.txt" 2>&1
rm -f "$dir/$name.ncu-rep"
exit $rc
