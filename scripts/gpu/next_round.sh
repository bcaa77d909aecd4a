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
# Two GPUs (kind nvidia-h200-x2), if lent: notes/tp2_fused.md "Session 12" and notes/tp2.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
part1=(
  "80:b16x8:decodescope bench --tp-shape 16 --batch 8 --out $R/ds --json $R/b16x8/bench.json"
  "90:steps16x8:python scripts/gpu_steps.py --tp 16 --points 8x1 --layers dense,kda,mla"
  "240:split_gpu:python -m pytest -q -m gpu tests/test_mla_split.py -k 'tail or uvfast'"
)
# one call per part (each under the 600 s a call may run): next_round.sh 1 | 2 | 3
case "${1:-1}" in
  1) exec bash "$here/run_stages.sh" "${part1[@]}" ;;
  *) echo "next_round.sh: part 1, got '$1'" >&2; exit 2 ;;
esac
