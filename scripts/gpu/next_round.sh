#!/usr/bin/env bash
# Ran in session 15 (notes/gpu-logs/s15/r1-r3; outcomes in notes/specialized.md and
# notes/specialized_moe.md "Session 15"). The GPU checks pending at the end of session 14, in order of value, for the next
# session's first three H200 calls (one GPU, three parts of ~6.5 minutes; each stage has its own
# time limit and a failing stage does not stop the rest). From the project root on the GPU
# machine, after
# `source .gpu/run/install.sh`:
#     DS_STAGES_NAME=pending1 bash scripts/gpu/next_round.sh 1    (~6.5 min)
#     DS_STAGES_NAME=pending2 bash scripts/gpu/next_round.sh 2    (~6.5 min)
#     DS_STAGES_NAME=pending3 bash scripts/gpu/next_round.sh 3    (~6.5 min)
# Results land in $OUT/pending1.tar.gz .. pending3.tar.gz (scripts/gpu/run_stages.sh); the bench runs in
# $DECODESCOPE_RESULTS/ds merge into results/ (cp -r ds/* results/).
#
# - mlatrace: the MLA split decode's phases with the steps inside each marked (d2cc525; the
#   attention phase took ~4.2 us after its wait at TP8 1x1 in s14/r3: which of q_lat's load,
#   the key block, the partials' stores and release is it?), 1x1 and 8x1 at TP8 / TP16, with
#   the GPU tests of the trace (notes/specialized.md "Session 14").
# - steps1x8: the whole-step check at TP8 1x8 with the KDA split's early loads (the default
#   since 39f3f61; its kernel tests passed, the in-step check ran before it was the default).
# - fn_moe / fn_steps / fn_b8 / fn_b8k: the MoE front with the post-attention RMSNorm in the
#   tensor-core kernel (FrontMmaNorm, DECODESCOPE_FRONT_NORM=1: one launch less per layer; not
#   yet run on a GPU): its checks and block vs block_norm timings at one token, the whole step
#   with it against the standard step, then TP8 batch 1 (+ 1x8) with and without it in one call
#   (notes/specialized_moe.md "Session 14").
# - b64: TP8 / TP16 batch 64 at today's defaults (the README's 64-token rows are from ebcc21d).
# - part 3, mla_hg*: the verify step (1+7 tokens) on the split MLA decode with head groups
#   (session 14; the default there is still tc): kernel alone against tc with its checks, the
#   GPU tests, the whole step, and the TP8 1x8 bench with it (compare with part 2's fn_b8).
# Two GPUs (kind nvidia-h200-x2), if lent: notes/tp2_fused.md "Session 12" and notes/tp2.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
part1=(
  "80:mlatrace:python scripts/gpu_mla_tc.py --out $R/mlatrace --tp 8 16 --points 1x1 8x1 --variants split 'split trace' 'split diag' --no-sweep --no-diag --no-standard --budget 70"
  "60:mla_pytest:python -m pytest -q -m gpu tests/test_mla_split.py -k 'knobs9 or knobs10'"
  "80:steps1x8:python scripts/gpu_steps.py --tp 8 --points 1x8 --layers dense,kda,mla"
  "150:fn_moe:python scripts/gpu_specialized_moe.py --out $R/fn_moe --tp 8 16 --tokens 1 --variants grouped_t1"
)
part2=(
  "90:fn_steps:DECODESCOPE_FRONT_NORM=1 python scripts/gpu_steps.py --tp 8 16 --points 1x1 --layers dense,kda,mla"
  "90:fn_b8:decodescope bench --tp-shape 8 --batch 1 --spec-verify 7 --out $R/ds --json $R/fn_b8/bench.json"
  "90:fn_b8k:DECODESCOPE_FRONT_NORM=1 decodescope bench --tp-shape 8 --batch 1 --spec-verify 7 --out $R/ds --json $R/fn_b8k/bench.json"
  "60:b64_8:decodescope bench --tp-shape 8 --batch 64 --out $R/ds --json $R/b64_8/bench.json"
  "60:b64_16:decodescope bench --tp-shape 16 --batch 64 --out $R/ds --json $R/b64_16/bench.json"
)
part3=(
  "130:mla_hg:python scripts/gpu_mla_tc.py --out $R/mla_hg --tp 8 16 --points 1x8 8x8 --variants auto split 'split trace' --no-sweep --no-diag --no-standard --budget 120"
  "90:mla_hg_pytest:python -m pytest -q -m gpu tests/test_mla_split.py -k head_groups"
  "90:mla_hg_steps:DECODESCOPE_MLA_KERNEL=split python scripts/gpu_steps.py --tp 8 16 --points 1x8 --layers dense,kda,mla"
  "90:mla_hg_b8:DECODESCOPE_MLA_KERNEL=split decodescope bench --tp-shape 8 --batch 1 --spec-verify 7 --out $R/ds --json $R/mla_hg_b8/bench.json"
)
# one call per part (each under the 600 s a call may run): next_round.sh 1 | 2 | 3
case "${1:-1}" in
  1) exec bash "$here/run_stages.sh" "${part1[@]}" ;;
  2) exec bash "$here/run_stages.sh" "${part2[@]}" ;;
  3) exec bash "$here/run_stages.sh" "${part3[@]}" ;;
  *) echo "next_round.sh: part 1, 2 or 3, got '$1'" >&2; exit 2 ;;
esac
