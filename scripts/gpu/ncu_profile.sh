#!/usr/bin/env bash
# Nsight Compute profile of one decode step (scripts/gpu_ncu.py): every kernel replayed with
# flushed caches; writes DIR/NAME.ncu-rep, NAME.txt (details page) and NAME.csv (raw metrics).
# usage: scripts/gpu/ncu_profile.sh DIR NAME [gpu_ncu.py options...]
# DS_NCU_PROG=scripts/other.py profiles another script's profiler window instead (for example
# scripts/gpu_tma_gemm.py --profile: one launch of each tiling).
set -u
dir=$1; name=$2; shift 2
mkdir -p "$dir"
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
"$NCU" --profile-from-start off --clock-control none \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
  --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,gpu__time_duration.sum,sm__cycles_active.min,sm__cycles_active.max,sm__cycles_active.avg \
  -f -o "$dir/$name" python3 "${DS_NCU_PROG:-scripts/gpu_ncu.py}" "$@"
rc=$?
"$NCU" --import "$dir/$name.ncu-rep" --page details > "$dir/$name.txt" 2>&1
"$NCU" --import "$dir/$name.ncu-rep" --page raw --csv > "$dir/$name.csv" 2>&1
exit $rc
