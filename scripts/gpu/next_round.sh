#!/usr/bin/env bash
# Written at the end of session 18 (outcomes in notes/specialized.md "Session 18"). One H200 call
# of ~6 minutes after the staging; each stage has its own time limit and a failing stage does not
# stop the rest. From the project root on the GPU machine, after `source .gpu/run/install.sh`:
#     DS_STAGES_NAME=pending1 bash scripts/gpu/next_round.sh 1
# Results land in $OUT/pending1.tar.gz (scripts/gpu/run_stages.sh); the bench runs in
# $DECODESCOPE_RESULTS/ds merge into results/ (cp -r ds/* results/).
#
# DECODESCOPE_MLA_SPLIT_EARLYABS (default 1 since the end of session 18: the absorption's w_uk
# staged before the PDL wait, where the MLA decode's grid is one wave): the whole step against
# the standard one where it is in effect (not yet run with it), the bench at TP8 / TP16 batch 1
# and 8 at the default (knob-free rows for the README) and TP16 batch 1 / 8 with it off in the
# same call (its effect there was never timed). Keep it where TP16 gains or holds.
# Two GPUs (kind nvidia-h200-x2), if lent: notes/tp2_fused.md "Session 12" and notes/tp2.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
part1=(
  "150:steps_ea:python scripts/gpu_steps.py --tp 8 --points 1x1 2x1 --layers dense,kda,mla"
  "150:steps_ea16:python scripts/gpu_steps.py --tp 16 --points 1x1 8x1 --layers dense,kda,mla"
  "70:b8_1:decodescope bench --tp-shape 8 --batch 1,8 --out $R/ds --json $R/b8_1/bench.json"
  "70:b16_1:decodescope bench --tp-shape 16 --batch 1,8 --out $R/ds --json $R/b16_1/bench.json"
  "70:b16_1x:DECODESCOPE_MLA_SPLIT_EARLYABS=0 decodescope bench --tp-shape 16 --batch 1,8 --out $R/ds --json $R/b16_1x/bench.json"
)
# one call (under the 600 s a call may run): next_round.sh 1
case "${1:-1}" in
  1) exec bash "$here/run_stages.sh" "${part1[@]}" ;;
  *) echo "next_round.sh: part 1, got '$1'" >&2; exit 2 ;;
esac
