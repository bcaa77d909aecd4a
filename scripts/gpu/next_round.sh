#!/usr/bin/env bash
# The GPU checks still pending at the end of session 11 (2026-12-01), in order of value, for the
# next session's first H200 call (one GPU, ~9 minutes; each stage has its own time limit and a
# failing stage does not stop the rest). From the project root on the GPU machine, after
# `source .gpu/run/install.sh`:
#     DS_STAGES_NAME=pending bash scripts/gpu/next_round.sh
# Results land in $OUT/pending.tar.gz (scripts/gpu/run_stages.sh).
#
# - dense_tile / w2p: the opt-in kernels of session 11 (helpers A and C; notes/specialized.md
#   "Session 11: dense gate_up on the tile GEMM", notes/specialized_moe.md "Session 11:
#   persistent w2 at one token"): correctness first, then kernel-alone timings.
# - ovh: the capture-overhead benchmark with the HES variant and the interleaved eager blocks
#   (notes/capture.md "Session 11").
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
exec bash "$here/run_stages.sh" \
  "150:gpu_tests:python -m pytest -q -m gpu -n 4 -p no:cacheprovider tests/test_dense_tile.py tests/test_w2_t1_persist.py" \
  "150:dense_tile8:python scripts/gpu_dense_tile.py --out $R/dense_tile8 --tp 8" \
  "120:w2p:python scripts/gpu_specialized_moe.py --out $R/w2p --tp 8 --tokens 1 --variants grouped_t1 grouped_t1_w2p grouped_t1_w2p_ps7 grouped_t1_w2p_pw4_ps4_pm2 --quick" \
  "130:ovh:python benchmarks/bench_capture_overhead.py --workload standard,specialized --batch 1 --variants default,hw_trace,control --budget-s 120 --out $R/ovh"
