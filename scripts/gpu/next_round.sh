#!/usr/bin/env bash
# Written at the end of session 18; both parts ran in session 19 (outcomes in notes/specialized.md
# "Session 19", logs notes/gpu-logs/s19/r1, r2): kept as the rerun of those points. One H200 call
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
# Part 2: the verify step of 32 and 64 sequences (1+7 tokens) runs in chunks of 64 tokens, so
# the DECODESCOPE_TILE_CUBLAS default (32, session 18) moves those points too; they were not
# rerun in session 18 (the README rows are older): benched at the default with the 32 / 64
# rows beside them.
# Two GPUs (kind nvidia-h200-x2), if lent: notes/tp2_fused.md "Session 12" and notes/tp2.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
part1=(
  "150:steps_ea:python scripts/gpu_steps.py --tp 8 --points 1x1 2x1 --layers dense,kda,mla"
  "150:steps_ea16:python scripts/gpu_steps.py --tp 16 --points 1x1 8x1 --layers dense,kda,mla"
  "100:b8_1:decodescope bench --tp-shape 8 --batch 1,8 --out $R/ds --json $R/b8_1/bench.json"
  "100:b16_1:decodescope bench --tp-shape 16 --batch 1,8 --out $R/ds --json $R/b16_1/bench.json"
  "100:b16_1x:DECODESCOPE_MLA_SPLIT_EARLYABS=0 decodescope bench --tp-shape 16 --batch 1,8 --out $R/ds --json $R/b16_1x/bench.json"
)
part2=(
  "240:v8:decodescope bench --tp-shape 8 --batch 32,64 --spec-verify 7 --out $R/ds --json $R/v8/bench.json"
  "240:v16:decodescope bench --tp-shape 16 --batch 32,64 --spec-verify 7 --out $R/ds --json $R/v16/bench.json"
)
# one call per part (each under the 600 s a call may run): next_round.sh 1 | 2
case "${1:-1}" in
  1) exec bash "$here/run_stages.sh" "${part1[@]}" ;;
  2) exec bash "$here/run_stages.sh" "${part2[@]}" ;;
  *) echo "next_round.sh: part 1 or 2, got '$1'" >&2; exit 2 ;;
esac
