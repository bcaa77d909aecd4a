#!/usr/bin/env bash
# The GPU checks pending at the end of session 12 (2026-12-01), in order of value, for the next
# session's first H200 call (one GPU, ~8 minutes; each stage has its own time limit and a failing
# stage does not stop the rest). From the project root on the GPU machine, after
# `source .gpu/run/install.sh`:
#     DS_STAGES_NAME=pending bash scripts/gpu/next_round.sh
# Results land in $OUT/pending.tar.gz (scripts/gpu/run_stages.sh); the bench runs in
# $DECODESCOPE_RESULTS/ds merge into results/ (cp -r ds/* results/).
#
# - ncu_w13 / ncu_mla: Nsight Compute on the specialized KDA and MLA layers at batch 1 (TP8):
#   where W13T1 (31.5 us alone against 23.9 of bytes) and the split MLA decode (19.3 us of the
#   layer at one token) lose their time (notes/specialized.md "Session 12 (lead)",
#   notes/specialized_moe.md "Outcome on the H200 (lead, s12/r4 ...)").
# - b8v: the TP8 8x8 verify step at the current defaults (the README's row is from 5f86c3e: the
#   s12 run of it ran past its stage limit).
# Two GPUs (kind nvidia-h200-x2), if lent: see notes/tp2_fused.md "Session 12" for the MoE back
# end's LL variant without the local flag hop, and notes/tp2.md for the tp_world 2 step.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
exec bash "$here/run_stages.sh" \
  "150:ncu_kda:bash scripts/gpu/ncu_profile.sh $R/ncu spec_kda_b1 --backend specialized --tp 8 --batch 1 --layers kda" \
  "150:ncu_mla:bash scripts/gpu/ncu_profile.sh $R/ncu spec_mla_b1 --backend specialized --tp 8 --batch 1 --layers mla" \
  "170:b8v:decodescope bench --tp-shape 8 --batch 8 --spec-verify 7 --out $R/ds --json $R/b8v/bench.json"
