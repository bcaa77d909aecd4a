#!/usr/bin/env bash
# The GPU checks pending at the end of session 14 (2026-12-01), in order of value, for the next
# session's first H200 call (one GPU, ~5 minutes; each stage has its own time limit and a failing
# stage does not stop the rest). From the project root on the GPU machine, after
# `source .gpu/run/install.sh`:
#     DS_STAGES_NAME=pending bash scripts/gpu/next_round.sh
# Results land in $OUT/pending.tar.gz (scripts/gpu/run_stages.sh); the bench runs in
# $DECODESCOPE_RESULTS/ds merge into results/ (cp -r ds/* results/).
#
# - mlatrace: the MLA split decode's phases with the steps inside each marked (d2cc525; the
#   attention phase took ~4.2 us after its wait at TP8 1x1 in s14/r3: which of q_lat's load,
#   the key block, the partials' stores and release is it?), 1x1 and 8x1 at TP8 / TP16, with
#   the GPU tests of the trace (notes/specialized.md "Session 14").
# - steps1x8: the whole-step check at TP8 1x8 with the KDA split's early loads (the default
#   since 39f3f61; its kernel tests passed, the in-step check ran before it was the default).
# - b64: TP8 / TP16 batch 64 at today's defaults (the README's 64-token rows are from ebcc21d).
# Two GPUs (kind nvidia-h200-x2), if lent: notes/tp2_fused.md "Session 12" and notes/tp2.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
exec bash "$here/run_stages.sh" \
  "80:mlatrace:python scripts/gpu_mla_tc.py --out $R/mlatrace --tp 8 16 --points 1x1 8x1 --variants split 'split trace' 'split diag' --no-sweep --no-diag --no-standard --budget 70" \
  "60:mla_pytest:python -m pytest -q -m gpu tests/test_mla_split.py -k 'knobs9 or knobs10'" \
  "80:steps1x8:python scripts/gpu_steps.py --tp 8 --points 1x8 --layers dense,kda,mla" \
  "60:b64_8:decodescope bench --tp-shape 8 --batch 64 --out $R/ds --json $R/b64_8/bench.json" \
  "60:b64_16:decodescope bench --tp-shape 16 --batch 64 --out $R/ds --json $R/b64_16/bench.json"
