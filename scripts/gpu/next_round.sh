#!/usr/bin/env bash
# Written in session 18 (outcomes in notes/specialized.md "Session 18"). One H200 call of ~5
# minutes after the staging; each stage has its own time limit and a failing stage does not stop
# the rest. From the project root on the GPU machine, after `source .gpu/run/install.sh`:
#     DS_STAGES_NAME=pending1 bash scripts/gpu/next_round.sh 1
# Results land in $OUT/pending1.tar.gz (scripts/gpu/run_stages.sh); the bench runs in
# $DECODESCOPE_RESULTS/ds merge into results/ (cp -r ds/* results/).
#
# The points the DECODESCOPE_TILE_CUBLAS default (32, since session 18) moves: 32, 64 and 8x8
# tokens at TP8 / TP16, benched without knobs (the README table shows knob-free runs only), and
# the whole step against the standard one there (TP16's split-K cuBLAS GEMM included).
# Two GPUs (kind nvidia-h200-x2), if lent: notes/tp2_fused.md "Session 12" and notes/tp2.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
part1=(
  "120:steps16:python scripts/gpu_steps.py --tp 16 --points 64x1 8x8 --layers dense,kda,mla"
  "120:steps8:python scripts/gpu_steps.py --tp 8 --points 32x1 8x8 --layers dense,kda,mla"
  "110:b8_64:decodescope bench --tp-shape 8 --batch 32,64 --out $R/ds --json $R/b8_64/bench.json"
  "110:b16_64:decodescope bench --tp-shape 16 --batch 32,64 --out $R/ds --json $R/b16_64/bench.json"
  "110:b8_8x8:decodescope bench --tp-shape 8 --batch 8 --spec-verify 7 --out $R/ds --json $R/b8_8x8/bench.json"
  "110:b16_8x8:decodescope bench --tp-shape 16 --batch 8 --spec-verify 7 --out $R/ds --json $R/b16_8x8/bench.json"
)
# one call (under the 600 s a call may run): next_round.sh 1
case "${1:-1}" in
  1) exec bash "$here/run_stages.sh" "${part1[@]}" ;;
  *) echo "next_round.sh: part 1, got '$1'" >&2; exit 2 ;;
esac
