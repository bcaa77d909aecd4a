#!/usr/bin/env bash
# For session 18 (written at the end of session 17; outcomes of session 17 in notes/specialized.md
# "Session 17"). One H200 call of ~3 minutes after the staging; each stage has its own time limit
# and a failing stage does not stop the rest. From the project root on the GPU machine, after
# `source .gpu/run/install.sh`:
#     DS_STAGES_NAME=pending1 bash scripts/gpu/next_round.sh 1
# Results land in $OUT/pending1.tar.gz (scripts/gpu/run_stages.sh); the bench runs in
# $DECODESCOPE_RESULTS/ds merge into results/ (cp -r ds/* results/).
#
# - b16x8 / steps16x8: TP16 batch 8 at the new default (DECODESCOPE_MLA_SPLIT_TAIL unset = auto,
#   on there since session 17): the README table's TP16 batch-8 row is still the run before it;
#   the whole step against the standard one at that point.
# - split_gpu: the MLA split kernel's GPU tests at the new default (tail at TP16 8x1 included).
# - part 2, cub*: DECODESCOPE_TILE_CUBLAS=32 (o_proj and KDA's in_proj GEMMs on cuBLAS from 32
#   tokens; built in session 17, not yet run): its GPU tests, the whole step at TP8 64x1, and
#   the bench at TP8 / TP16 batch 64 against the default in the same call. Make it the default
#   if the KDA and MLA layers' shares both drop by >= 3 us at batch 64 (prediction in
#   notes/specialized.md "Session 17").
# Two GPUs (kind nvidia-h200-x2), if lent: notes/tp2_fused.md "Session 12" and notes/tp2.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
part1=(
  "80:b16x8:decodescope bench --tp-shape 16 --batch 8 --out $R/ds --json $R/b16x8/bench.json"
  "90:steps16x8:python scripts/gpu_steps.py --tp 16 --points 8x1 --layers dense,kda,mla"
  "240:split_gpu:python -m pytest -q -m gpu tests/test_mla_split.py -k 'tail or uvfast'"
)
part2=(
  "90:cub_pytest:python -m pytest -q -m gpu tests/test_tile_cublas.py"
  "100:cub_steps:DECODESCOPE_TILE_CUBLAS=32 python scripts/gpu_steps.py --tp 8 --points 64x1 --layers dense,kda,mla"
  "80:cub8:decodescope bench --tp-shape 8 --batch 64 --out $R/ds --json $R/cub8/bench.json"
  "80:cub8x:DECODESCOPE_TILE_CUBLAS=32 decodescope bench --tp-shape 8 --batch 64 --out $R/ds --json $R/cub8x/bench.json"
  "80:cub16x:DECODESCOPE_TILE_CUBLAS=32 decodescope bench --tp-shape 16 --batch 64 --out $R/ds --json $R/cub16x/bench.json"
  "80:cub16:decodescope bench --tp-shape 16 --batch 64 --out $R/ds --json $R/cub16/bench.json"
)
# one call per part (each under the 600 s a call may run): next_round.sh 1 | 2
case "${1:-1}" in
  1) exec bash "$here/run_stages.sh" "${part1[@]}" ;;
  2) exec bash "$here/run_stages.sh" "${part2[@]}" ;;
  *) echo "next_round.sh: part 1 or 2, got '$1'" >&2; exit 2 ;;
esac
