#!/usr/bin/env bash
# For session 17 (written at the end of session 16; outcomes of session 16 in notes/specialized.md
# "Session 16"). One H200 call of ~6 minutes after the staging; each stage has its own time limit
# and a failing stage does not stop the rest. From the project root on the GPU machine, after
# `source .gpu/run/install.sh`:
#     DS_STAGES_NAME=pending1 bash scripts/gpu/next_round.sh 1
# Results land in $OUT/pending1.tar.gz (scripts/gpu/run_stages.sh); the bench runs in
# $DECODESCOPE_RESULTS/ds merge into results/ (cp -r ds/* results/).
#
# - tail16 / tail16x / tail16_steps: DECODESCOPE_MLA_SPLIT_TAIL=1 where its extra split keeps
#   the grid one wave (TP16 8x1: 9 splits, 132 CTAs; kernel alone 16.4 -> 14.9 us in s16/r3),
#   in the layer against the default in the same call, and the whole step with it. If the MLA
#   decode's share drops by >= 1 us, make the one-wave rule the default.
# - qb64 / qb64n: TP16 batch 64, where the specialized q_kv_norm+q_b_proj takes 14.4 us by share
#   against cuBLAS + norm 7.5 (s16/r5) and the front 28.8 against 20.6: the default (q_b's norm
#   folded into the tile GEMM, tile_gemm "Norm folded into the GEMM") against
#   DECODESCOPE_TILE_NORM=launch (the norm as its own launch: 12 MLA launches, one over the
#   target; a measurement of where q_b's 7 us go, not a candidate default).
# Two GPUs (kind nvidia-h200-x2), if lent: notes/tp2_fused.md "Session 12" and notes/tp2.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
part1=(
  "80:tail16:decodescope bench --tp-shape 16 --batch 8 --out $R/ds --json $R/tail16/bench.json"
  "80:tail16x:DECODESCOPE_MLA_SPLIT_TAIL=1 decodescope bench --tp-shape 16 --batch 8 --out $R/ds --json $R/tail16x/bench.json"
  "90:tail16_steps:DECODESCOPE_MLA_SPLIT_TAIL=1 python scripts/gpu_steps.py --tp 16 --points 8x1 --layers dense,kda,mla"
  "80:qb64:decodescope bench --tp-shape 16 --batch 64 --out $R/ds --json $R/qb64/bench.json"
  "80:qb64n:DECODESCOPE_TILE_NORM=launch decodescope bench --tp-shape 16 --batch 64 --out $R/ds --json $R/qb64n/bench.json"
)
# one call per part (each under the 600 s a call may run): next_round.sh 1 | 2 | 3
case "${1:-1}" in
  1) exec bash "$here/run_stages.sh" "${part1[@]}" ;;
  *) echo "next_round.sh: part 1, got '$1'" >&2; exit 2 ;;
esac
