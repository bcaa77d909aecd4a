#!/usr/bin/env bash
# The GPU checks pending at the end of session 13 (2026-12-01), in order of value, for the next
# session's first H200 call (one GPU, ~8 minutes; each stage has its own time limit and a failing
# stage does not stop the rest). From the project root on the GPU machine, after
# `source .gpu/run/install.sh`:
#     DS_STAGES_NAME=pending bash scripts/gpu/next_round.sh
# Results land in $OUT/pending.tar.gz (scripts/gpu/run_stages.sh); the bench runs in
# $DECODESCOPE_RESULTS/ds merge into results/ (cp -r ds/* results/).
#
# - steps1x8: the whole-step check at 1x8 with the KDA decode's cluster split, the default from
#   2 tokens since 0cd7dce (its s13/r5 stage ran past 60 s; kernel checks passed).
# - zt / zt_pytest: W13T1 with its z stages sized for the tokens (DECODESCOPE_MOE_T1_ZT=1, 8
#   stages in the shared memory of 6: 4 steps of the two-warp K split in flight instead of 2;
#   notes/specialized_moe.md "Session 13"), against the default, TP8 / TP16 at 1 token.
# - kda_pytest / b1early: the KDA split with its loads before the PDL wait
#   (DECODESCOPE_KDA_EARLY=1, cff9e86): GPU tests, then TP8 batch 1 in the layer with the split
#   and early loads (a knob run beside bv8's default; notes/specialized.md "Session 13").
# - bv8: the TP8 1x1 / 1x8 bench at the new defaults (the README's 1x8 rows predate the split).
# Two GPUs (kind nvidia-h200-x2), if lent: notes/tp2_fused.md "Session 12" and notes/tp2.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
exec bash "$here/run_stages.sh" \
  "140:steps1x8:python scripts/gpu_steps.py --tp 8 16 --points 1x8 --layers dense,kda,mla" \
  "110:zt:python scripts/gpu_specialized_moe.py --out $R/zt --tp 8 16 --tokens 1 --variants grouped_t1 grouped_t1_s8_zt grouped_t1_s8_k64_zt --quick" \
  "50:zt_pytest:python -m pytest -q -m gpu tests/test_experts_t1.py -k zt" \
  "40:kda_pytest:python -m pytest -q -m gpu tests/test_kda_split.py" \
  "80:bv8:decodescope bench --tp-shape 8 --batch 1 --spec-verify 7 --out $R/ds --json $R/bv8/bench.json" \
  "50:b1early:DECODESCOPE_KDA_VSPLIT=0 DECODESCOPE_KDA_EARLY=1 decodescope bench --tp-shape 8 --batch 1 --out $R/ds --json $R/b1early/bench.json"
