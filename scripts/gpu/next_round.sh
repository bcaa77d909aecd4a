#!/usr/bin/env bash
# Session 20: the chunked verify steps (32 / 64 sequences of 1+7 tokens) with each MoE block's
# experts once over all of the step's tokens (DECODESCOPE_CHUNK_EXPERTS=once, the new default;
# kernels/specialized/step.py experts_once). Part 1: the whole step against the standard one at
# TP8 32x8 and TP16 64x8 (the grouped expert kernels' first runs past 64 tokens), then the
# bench at TP8 32 / 64 x 8. Part 2: the bench at TP16, and TP16 32x8 with
# DECODESCOPE_CHUNK_EXPERTS=chunk in the same call (the A/B). Predictions: notes/specialized.md
# "Session 20". From the project root on the GPU machine, after `source .gpu/run/install.sh`:
#     DS_STAGES_NAME=pending1 bash scripts/gpu/next_round.sh 1
# Results land in $OUT/pending1.tar.gz (scripts/gpu/run_stages.sh); the bench runs in
# $DECODESCOPE_RESULTS/ds merge into results/ (cp -r ds/* results/).
# Two GPUs (kind nvidia-h200-x2), if lent: notes/tp2_fused.md "Session 12" and notes/tp2.md.
set -u
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
R='$DECODESCOPE_RESULTS'
part1=(
  "170:steps_v8:python scripts/gpu_steps.py --tp 8 --points 32x8 --layers kda,mla"
  "170:steps_v16:python scripts/gpu_steps.py --tp 16 --points 64x8 --layers kda,mla"
  "200:v8:decodescope bench --tp-shape 8 --batch 32,64 --spec-verify 7 --out $R/ds --json $R/v8/bench.json"
)
part2=(
  "200:v16:decodescope bench --tp-shape 16 --batch 32,64 --spec-verify 7 --out $R/ds --json $R/v16/bench.json"
  "120:v16c:DECODESCOPE_CHUNK_EXPERTS=chunk decodescope bench --tp-shape 16 --batch 32 --spec-verify 7 --out $R/ds --json $R/v16c/bench.json"
)
# Part 3 ran in session 20 (r3: w13 with two 8-token tiles per pass, now the default above 64
# tokens); its sweep datasets are in notes/gpu-logs/s20/r3, r4. Next:
# Part 4: the README rows of the 32 / 64 x 8 verify steps (both backends: stage the vLLM parts
# too, scripts/gpu/README.md), TP8 then TP16. Session 21 ran them at 37de9f4 (the token-parallel
# ops once, DECODESCOPE_CHUNK_TOKEN_OPS; notes/gpu-logs/s21/w2, w3); since then the grouped
# experts' defaults above 64 / 256 tokens changed (the session-21 sweep): run part 6, then 4.
# Part 6: the whole step at those defaults against the standard one (gpu_steps, TP8 64x8 and
# TP16 32x8: w13 with four token tiles at 512, four stages at 256), one call.
# Part 5: w2 with two 8-token tiles per pass (DECODESCOPE_MOE_W2T_MT=2) against the default at
# TP8 32x8, the specialized path alone, same call. Session 21 (r1): 187.82 against 188.68 ms,
# within the spread: not the default.
B8="decodescope bench --tp-shape 8 --batch 32 --spec-verify 7 --verify-only --backends specialized --layers kda,mla --out $R/sweep"
part3=(
  "120:w13mt:python -m pytest -q -x -p no:cacheprovider -m gpu tests/test_grouped_w13_tile.py -k token_tiles"
  "90:m1:DECODESCOPE_MOE_W13T_MT=1 $B8 --json $R/m1.json"
  "90:m2:DECODESCOPE_MOE_W13T_MT=2 $B8 --json $R/m2.json"
)
part4=(
  "240:v8:decodescope bench --tp-shape 8 --batch 32,64 --spec-verify 7 --out $R/ds --json $R/v8/bench.json"
  "240:v16:decodescope bench --tp-shape 16 --batch 32,64 --spec-verify 7 --out $R/ds --json $R/v16/bench.json"
)
part5=(
  "90:w2m1:$B8 --json $R/w2m1.json"
  "90:w2m2:DECODESCOPE_MOE_W2T_MT=2 $B8 --json $R/w2m2.json"
)
part6=(
  "220:steps8:python scripts/gpu_steps.py --tp 8 --points 64x8 --layers kda,mla --out $R/steps8"
  "220:steps16:python scripts/gpu_steps.py --tp 16 --points 32x8 --layers kda,mla --out $R/steps16"
)
# Part 7: the GPU tests written in session 21: the wide ops against their references, the
# chunked verify step of 16 x (1+7) tokens against the standard one (vLLM parts staged: the
# standard path runs). Parts 4, 6 and 7 ran in session 22 (notes/gpu-logs/s22/p4, p67), and
# the verify steps' rows again after the dense layer and the decode kernels went once over all
# tokens (d1, o1, f1; notes/specialized.md "Session 22"). Part 8: the rows of the verify steps
# of 32 / 64 sequences, both backends, verify step only (half a part 4's device time).
part7=(
  "240:wide:python -m pytest -q -x -p no:cacheprovider -m gpu tests/test_wide_ops_gpu.py"
  "240:chunked:python -m pytest -q -p no:cacheprovider -m gpu tests/test_specialized_step_gpu.py -k chunked"
)
part8=(
  "130:b8:decodescope bench --tp-shape 8 --batch 32,64 --spec-verify 7 --verify-only --out $R/ds --json $R/b8/bench.json"
  "120:b16:decodescope bench --tp-shape 16 --batch 32,64 --spec-verify 7 --verify-only --out $R/ds --json $R/b16/bench.json"
)
# Part 9 (session 23, first in the next session): the dense layer 0 at 64 tokens with the tile
# GEMMs on warpgroup MMAs (its down projection is a plain tile plan: wgmma by default from 64
# tokens since session 23) in the whole step against the standard one; its run in session 23
# was lost to a machine that stopped answering. Then the back tile's and q_b's wgmma checks
# in the layer (knob set: not defaults).
part9=(
  "200:steps_dense:python scripts/gpu_steps.py --tp 16 8 --points 64x1 8x8 --layers dense,kda --out $R/steps_dense"
  "200:steps_knob:DECODESCOPE_TILE_WGMMA=1 python scripts/gpu_steps.py --tp 16 --points 64x1 --layers dense,kda,mla --out $R/steps_knob"
)
# Part 9's dense check ran in session 24 with the cluster split-K (gpu_steps PASS at TP16 / TP8,
# 64x1 and 8x8, layers dense,kda,mla; notes/gpu-logs/s24/n2), now the default with wgmma at 64.
# Part 10 (session 24, next): the warpgroup MMAs everywhere (from 32 tokens, the folded q_b, the
# back tile: with the cluster split-K they win alone there, notes/specialized.md "Session 24")
# checked in the step, then a same-call layer A/B against the default, specialized alone.
# Part 11: the README's verify-step rows (1x8, 8x8) at the cluster default, both backends
# (stage the vLLM parts).
BW="decodescope bench --batch 32,64 --backends specialized --out $R/ab"
part10=(
  "150:steps_wg:DECODESCOPE_TILE_WGMMA=1 python scripts/gpu_steps.py --tp 16 8 --points 32x1 64x1 --layers dense,kda,mla --out $R/steps_wg"
  "105:t16d:$BW --tp-shape 16 --json $R/t16d.json"
  "105:t16w:DECODESCOPE_TILE_WGMMA=1 $BW --tp-shape 16 --json $R/t16w.json"
  "105:t8d:$BW --tp-shape 8 --json $R/t8d.json"
  "105:t8w:DECODESCOPE_TILE_WGMMA=1 $BW --tp-shape 8 --json $R/t8w.json"
)
part11=(
  "150:v16:decodescope bench --tp-shape 16 --batch 1,8 --spec-verify 7 --verify-only --out $R/ds --json $R/v16.json"
  "150:v8:decodescope bench --tp-shape 8 --batch 1,8 --spec-verify 7 --verify-only --out $R/ds --json $R/v8.json"
)
# Part 12: the dense layer 0's gate_up + SiTU tile (1.88x its floor at TP16 batch 64, 30 of its
# 92 us) with the warpgroup MMAs and the cluster split-K (opt-in knobs, session 24, not yet
# run): its GPU tests, the kernel alone with and without, the dense layer A/B (specialized).
DK="DECODESCOPE_DENSE_TILE_CLUSTER=1 DECODESCOPE_DENSE_TILE_WGMMA=1"
BD="decodescope bench --layers dense --batch 8,32,64 --backends specialized --out $R/ab"
part12=(
  "150:dtests:python -m pytest -q -p no:cacheprovider -m gpu tests/test_dense_tile.py"
  "110:d0:python scripts/gpu_dense_tile.py --out $R/d0 --tp 16 --ms 8 32 64"
  "110:d1:$DK python scripts/gpu_dense_tile.py --out $R/d1 --tp 16 --ms 8 32 64"
  "80:bd0:$BD --tp-shape 16 --json $R/bd0.json"
  "80:bd1:$DK $BD --tp-shape 16 --json $R/bd1.json"
)
# Part 13 (session 25): the new defaults (warpgroup MMAs from 32 tokens in every tile plan, the
# dense tile's wgmma + cluster split-K, the folded norm's squares inside the wgmma block) checked
# in the step and by the GPU tests, then the dense tile alone with the squares before the barrier
# (DECODESCOPE_TILE_SQ_MMA=0) and inside the MMA block (default). Part 14: the README's
# specialized rows (batch 8 / 32 / 64) at the new defaults, and the dense layer with SQ_MMA=0.
BS="decodescope bench --backends specialized --out $R/ds"
part13=(
  "170:steps:python scripts/gpu_steps.py --tp 16 8 --points 8x1 32x1 8x8 --layers dense,kda,mla --out $R/steps"
  "150:tests:python -m pytest -q -p no:cacheprovider -m gpu tests/test_dense_tile.py tests/test_tile_gemm.py -k 'dense_tile_gpu or (cluster_gpu and q_b)'"
  "60:sq0:DECODESCOPE_TILE_SQ_MMA=0 python scripts/gpu_dense_tile.py --out $R/sq0 --tp 16 --ms 32 64"
  "60:sq1:python scripts/gpu_dense_tile.py --out $R/sq1 --tp 16 --ms 32 64"
)
part14=(
  "130:s16:$BS --tp-shape 16 --batch 8,32,64 --json $R/s16.json"
  "130:s8:$BS --tp-shape 8 --batch 8,32,64 --json $R/s8.json"
)
# Part 15 (session 25, next): where the dense tile's folded norm loses 2.8-3.2 us at 64 tokens on
# wgmma + cluster (s25/n2, n4; not the squares: DECODESCOPE_TILE_SQ_MMA=1 gained nothing):
# Nsight Compute of the dense layer at TP16 batch 64, fold (default) against the norm launch +
# unfolded tile (DECODESCOPE_DENSE_TILE=launch): the gate_up kernel's stall reasons, issue
# activity and L2 / DRAM bytes side by side. Part 16: the README's standard rows on the same
# machine as its specialized ones (batch 8 / 32 / 64, both backends; stage the vLLM parts).
part15=(
  "200:ncu_fold:bash scripts/gpu/ncu_profile.sh $R/ncu fold --backend specialized --tp 16 --batch 64 --layers dense"
  "200:ncu_launch:DECODESCOPE_DENSE_TILE=launch bash scripts/gpu/ncu_profile.sh $R/ncu launch --backend specialized --tp 16 --batch 64 --layers dense"
)
part16=(
  "260:r16:decodescope bench --tp-shape 16 --batch 8,32,64 --out $R/ds --json $R/r16.json"
  "280:r8:decodescope bench --tp-shape 8 --batch 8,32,64 --out $R/ds --json $R/r8.json"
)
# Part 17 (session 26): the streaming GEMV's knob sets at one token on the TP16 shapes (never
# swept: TUNED held TP8's only; the TP16 MLA qkv_a + g front is 1.56x its bytes by share against
# TP8's 1.09x) and the TP8 shapes again with single-wave grids; the fastest plain set per shape
# into /tmp/gemv_tuned.json (kept while the machine is warm; a copy in $R). Part 18: the layers
# with that file against the built-in table (DECODESCOPE_GEMV_TUNED), specialized, batch 1, same
# call, and the whole step with it. Part 19: the README's batch-1 rows (specialized; the
# standard path is unchanged since 385c2e3, whose rows the README keeps).
GA="scripts/gpu_specialized_attn.py --gemv-only --sweep-ms 1 --write-tuned /tmp/gemv_tuned.json --gemv-cfgs auto w16r1g4d2 w8r2g2d4"
G16="qkv_a_g:w11r2g2d4 qkv_a_g:w22r1g4d2 qkv_a_g:w22r1g4d3 qkv_a_g:w11r2g4d3 qkv_a_g:w11r2g2d6 qkv_a_g:w8r1g4d2 in_proj:w25r1g4d2 in_proj:w13r2g2d4 in_proj:w13r2g4d3 in_proj:w13r2g2d6 in_proj:w8r3g1d4 in_proj:w8r3g2d2 in_proj:w8r1g4d2 o_proj:w4r4g2d2 o_proj:w4r4g3d1 o_proj:w8r4g3d1 o_proj:w14r4g3d1 o_proj:w7r4g3d1 o_proj:w16r2g3d1 q_b:w9r1g6d1 q_b:w8r1g6d1 q_b:w4r2g6d1 q_b:w4r1g6d1 q_b:w9r1g3d2 q_b:w12r1g6d1"
G8="qkv_a_g:w14r2g2d4 qkv_a_g:w14r2g4d2 qkv_a_g:w28r1g4d2 qkv_a_g:w14r2g4d3 qkv_a_g:w7r4g2d2 in_proj:w12r4g1d2 in_proj:w24r2g2d2 in_proj:w16r3g1d2 in_proj:w12r4g2d2 in_proj:w8r3g2d2 o_proj:w4r4g3d1 o_proj:w7r4g2d2 o_proj:w14r4g2d2 o_proj:w4r4g6d1 q_b:w9r2g2d4 q_b:w9r2g3d2 q_b:w6r3g2d2 q_b:w18r1g6d1 q_b:w8r2g6d1"
part17=(
  "5:clean:rm -f /tmp/gemv_tuned.json"
  "260:g16:python $GA $G16 --tp 16 --out $R/g16"
  "260:g8:python $GA $G8 --tp 8 --out $R/g8"
  "5:keep:cp /tmp/gemv_tuned.json $R/gemv_tuned.json && cat /tmp/gemv_tuned.json"
)
TF=${DECODESCOPE_TUNED_FILE:-/tmp/gemv_tuned.json}
B1="decodescope bench --batch 1 --backends specialized --out $R/ab"
part18=(
  "75:t16d:DECODESCOPE_GEMV_TUNED=1 $B1 --tp-shape 16 --json $R/t16d.json"
  "75:t16f:DECODESCOPE_GEMV_TUNED=$TF $B1 --tp-shape 16 --json $R/t16f.json"
  "75:t8d:DECODESCOPE_GEMV_TUNED=1 $B1 --tp-shape 8 --json $R/t8d.json"
  "75:t8f:DECODESCOPE_GEMV_TUNED=$TF $B1 --tp-shape 8 --json $R/t8f.json"
  "150:steps:DECODESCOPE_GEMV_TUNED=$TF python scripts/gpu_steps.py --tp 16 8 --points 1x1 --layers dense,kda,mla --out $R/steps"
)
part19=(
  "90:s16:decodescope bench --tp-shape 16 --batch 1 --backends specialized --out $R/ds --json $R/s16.json"
  "90:s8:decodescope bench --tp-shape 8 --batch 1 --backends specialized --out $R/ds --json $R/s8.json"
)
# Part 20 (session 26, next): the one-token GEMV sets in the layer around the new TP16 MLA front
# (w22r1g4d3: 22 warps x 80 registers = 56,320 of an SM's 65,536, one CTA per SM). q_b after it
# lost 2.0 -> 2.9 us of share when it could no longer become resident beside the front; sets
# that fit the 9,216 registers left (w2r4g6d1: 2 warps x 128, every weight load before the PDL
# wait; w4r2g6d1; w4r1g6d1; w2r2g6d1) against the default (w8r1g4d2, 12,288), TP16 batch 1,
# specialized, same call; TP8 q_b likewise (beside w16r1g4d2 fronts, 2 per SM on 96 SMs); and
# the TP16 KDA in_proj's next-fastest sets alone (w16r1g4d2 / w8r2g2d4 13.9 / 14.0 us against
# 14.4; the fastest, w13r2g2d6, lost in the layer: notes/specialized.md "Session 26"); and the
# TP8 MLA front on w28r1g4d2 again (s26/n4: MLA span 126.8 -> 117.5 us, share 113.8 -> 114.5).
TA=scripts/gpu/tuned_ab
part20=(
  "60:q16d:$B1 --tp-shape 16 --json $R/q16d.json"
  "60:q16a:DECODESCOPE_GEMV_TUNED=$TA/tp16_qb_w2r4g6d1.json $B1 --tp-shape 16 --json $R/q16a.json"
  "60:q16b:DECODESCOPE_GEMV_TUNED=$TA/tp16_qb_w4r2g6d1.json $B1 --tp-shape 16 --json $R/q16b.json"
  "60:q16c:DECODESCOPE_GEMV_TUNED=$TA/tp16_qb_w4r1g6d1.json $B1 --tp-shape 16 --json $R/q16c.json"
  "60:q16e:DECODESCOPE_GEMV_TUNED=$TA/tp16_qb_w2r2g6d1.json $B1 --tp-shape 16 --json $R/q16e.json"
  "60:q8d:$B1 --tp-shape 8 --json $R/q8d.json"
  "60:q8a:DECODESCOPE_GEMV_TUNED=$TA/tp8_qb_w2r4g6d1.json $B1 --tp-shape 8 --json $R/q8a.json"
  "60:q8b:DECODESCOPE_GEMV_TUNED=$TA/tp8_qb_w4r2g6d1.json $B1 --tp-shape 8 --json $R/q8b.json"
  "60:i16a:DECODESCOPE_GEMV_TUNED=$TA/tp16_in_w16r1g4d2.json $B1 --tp-shape 16 --json $R/i16a.json"
  "60:i16b:DECODESCOPE_GEMV_TUNED=$TA/tp16_in_w8r2g2d4.json $B1 --tp-shape 16 --json $R/i16b.json"
  "60:i16d:$B1 --tp-shape 16 --json $R/i16d.json"
  "60:w8a:DECODESCOPE_GEMV_TUNED=$TA/tp8_qkv_w28r1g4d2.json $B1 --tp-shape 8 --json $R/w8a.json"
  "60:w8d:$B1 --tp-shape 8 --json $R/w8d.json"
)
# Part 21: W13T1 (the routed experts' w13 at one token) on the TP16 shapes with 4 warps per item
# and 8 stages (DECODESCOPE_MOE_T1_KW=4 DECODESCOPE_MOE_T1_STAGES=8: 2 CTAs per SM, enough for
# TP16's 192 CTAs) in the layer; alone (s13/r3) it took the experts part 26.2 -> 23.4 us while
# the block alone read 64.3 -> 65.9, and it never ran in a layer. Default, knob, default again.
part21=(
  "60:e16d:$B1 --tp-shape 16 --json $R/e16d.json"
  "60:e16k:DECODESCOPE_MOE_T1_KW=4 DECODESCOPE_MOE_T1_STAGES=8 $B1 --tp-shape 16 --json $R/e16k.json"
  "60:e16d2:$B1 --tp-shape 16 --json $R/e16d2.json"
)
# Part 22: the post-attention RMSNorm folded into the MoE front at one token (front_norm with
# DECODESCOPE_FRONT_NORM_FOLD=1: squares beside the MMAs, rstd in the epilogue; session 26, not
# yet run): its GPU test, then the layers, default (a residual_norm launch) / fold / s15's
# prologue form, TP16 and TP8 batch 1, specialized, same call; then the whole step with it.
FF="DECODESCOPE_FRONT_NORM=1 DECODESCOPE_FRONT_NORM_FOLD=1"
part22=(
  "150:ftest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_specialized_moe_gpu.py -k front_norm_fold"
  "60:f16d:$B1 --tp-shape 16 --json $R/f16d.json"
  "60:f16f:$FF $B1 --tp-shape 16 --json $R/f16f.json"
  "60:f16p:DECODESCOPE_FRONT_NORM=1 $B1 --tp-shape 16 --json $R/f16p.json"
  "60:f8d:$B1 --tp-shape 8 --json $R/f8d.json"
  "60:f8f:$FF $B1 --tp-shape 8 --json $R/f8f.json"
  "120:fsteps:$FF python scripts/gpu_steps.py --tp 16 8 --points 1x1 --layers dense,kda,mla --out $R/fsteps"
)
# Part 23 (session 27): W13T1's wide form (8 stages, 4 warps per item where the w13 grid fits at
# 2 CTAs per SM: TP16) as the default (experts_t1.w13_plan; s27/n3: projected TP16 batch-1 step
# 7.87 / 7.91 -> 7.81 ms): its GPU tests at TP16 (the new default, and the old form explicit);
# the layer A/B again, new / old / new / old, TP16 batch 1, specialized, same call; TP8's
# 4-warp form on 64-column chunks (8 stages of 6 KB) against its default, d / k / d; the whole
# step at TP16 1x1; the README's TP16 batch-1 rows, both backends (stage the vLLM parts).
OLD16="DECODESCOPE_MOE_T1_KW=2 DECODESCOPE_MOE_T1_STAGES=6"
K8="DECODESCOPE_MOE_T1_KW=4 DECODESCOPE_MOE_T1_STAGES=8 DECODESCOPE_MOE_T1_BK=64"
part23=(
  "150:t1test:python -m pytest -q -p no:cacheprovider -m gpu tests/test_experts_t1.py -k kimi-k3-16"
  "60:w16n:$B1 --tp-shape 16 --json $R/w16n.json"
  "60:w16o:$OLD16 $B1 --tp-shape 16 --json $R/w16o.json"
  "60:w16n2:$B1 --tp-shape 16 --json $R/w16n2.json"
  "60:w16o2:$OLD16 $B1 --tp-shape 16 --json $R/w16o2.json"
  "60:k8d:$B1 --tp-shape 8 --json $R/k8d.json"
  "60:k8k:$K8 $B1 --tp-shape 8 --json $R/k8k.json"
  "60:k8d2:$B1 --tp-shape 8 --json $R/k8d2.json"
  "120:steps:python scripts/gpu_steps.py --tp 16 --points 1x1 --layers dense,kda,mla --out $R/steps"
  "120:r16:decodescope bench --tp-shape 16 --batch 1 --out $R/ds --json $R/r16.json"
)
# Part 24 (session 27): the dense gate_up tile at 64 tokens with 8 splits (DECODESCOPE_DENSE_TILE_
# SPLITS=8: 264 CTAs, 2 per SM, twice the bytes in flight; ncu s27/n5: 132 CTAs of one
# warpgroup, 2.33 TB/s, SMs active 69% of the kernel); its GPU test, then the dense layer at TP16
# batch 64, specialized, d / k / d / k, same call.
BD="decodescope bench --batch 64 --layers dense --backends specialized --out $R/ab"
part24=(
  "120:dtest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_dense_tile.py -k kw9"
  "45:d16d:$BD --tp-shape 16 --json $R/d16d.json"
  "45:d16k:DECODESCOPE_DENSE_TILE_SPLITS=8 $BD --tp-shape 16 --json $R/d16k.json"
  "45:d16d2:$BD --tp-shape 16 --json $R/d16d2.json"
  "45:d16k2:DECODESCOPE_DENSE_TILE_SPLITS=8 $BD --tp-shape 16 --json $R/d16k2.json"
)
# Part 25 (session 27, next): the dense gate_up tile with more cp.async stages (DECODESCOPE_DENSE_
# TILE_STAGES=6 / 8: 5 / 7 chunks of 16 KB in flight per SM instead of 3; the plans run one CTA
# per SM, so the shared memory is free; ncu s27/n5: 2.33 TB/s, barrier / wait / long-scoreboard
# stalls): its GPU test, then the dense layer at batch 32 and 64, TP16 and TP8, specialized,
# d / st6 / st8 / d, same call. Prediction: TP16 batch 64 dense 92.2 -> 85-88 us with 6 or 8
# stages; wrong if under 2 us: then the chunk's barrier and proxy fence, not the bytes in
# flight, bound it (next: a producer warp with TMA and mbarriers).
BDD="decodescope bench --batch 32,64 --layers dense --backends specialized --out $R/ab"
part25=(
  "120:dtest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_dense_tile.py -k kw10"
  "50:s16d:$BDD --tp-shape 16 --json $R/s16d.json"
  "50:s16a:DECODESCOPE_DENSE_TILE_STAGES=6 $BDD --tp-shape 16 --json $R/s16a.json"
  "50:s16b:DECODESCOPE_DENSE_TILE_STAGES=8 $BDD --tp-shape 16 --json $R/s16b.json"
  "50:s16d2:$BDD --tp-shape 16 --json $R/s16d2.json"
  "50:s8d:$BDD --tp-shape 8 --json $R/s8d.json"
  "50:s8a:DECODESCOPE_DENSE_TILE_STAGES=6 $BDD --tp-shape 8 --json $R/s8a.json"
  "50:s8b:DECODESCOPE_DENSE_TILE_STAGES=8 $BDD --tp-shape 8 --json $R/s8b.json"
  "50:s8d2:$BDD --tp-shape 8 --json $R/s8d2.json"
)
# Part 26 (session 27, next): the one-token experts without a route kernel (DECODESCOPE_MOE_T1_
# ROUTE=w13: W13T1Route ranks the token after its wait, block 0 writes the lists for w2; built
# and CPU-tested, never run): its GPU tests (TP8 / TP16: lists, h, routed sum, shared output,
# the block, poisoned outputs), the layers d / rtw / d / rtw at TP16 and TP8 batch 1,
# specialized, same call, then the whole step with it (stage the vLLM parts). Prediction (s27/n4
# trace: the route ends 4.3 us after the front): each MoE layer's share -2 to -3 us, one kernel
# fewer per layer (KDA 8, MLA 9), projected TP16 batch-1 step 7.82 -> 7.55-7.65 ms; wrong if
# under 1 us per layer (then W13T1's own wait, not the route, is the chain's link).
RW="DECODESCOPE_MOE_T1_ROUTE=w13"
part26=(
  "150:rtest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_experts_t1.py -k rtw"
  "60:r16d:$B1 --tp-shape 16 --json $R/r16d.json"
  "60:r16w:$RW $B1 --tp-shape 16 --json $R/r16w.json"
  "60:r16d2:$B1 --tp-shape 16 --json $R/r16d2.json"
  "60:r16w2:$RW $B1 --tp-shape 16 --json $R/r16w2.json"
  "60:r8d:$B1 --tp-shape 8 --json $R/r8d.json"
  "60:r8w:$RW $B1 --tp-shape 8 --json $R/r8w.json"
  "120:rsteps:$RW python scripts/gpu_steps.py --tp 16 8 --points 1x1 --layers dense,kda,mla --out $R/rsteps"
)
# Part 27 (session 27, next): Nsight Compute of the TP16 batch-1 KDA layer (specialized): is the
# one-token w13 (192 CTAs of 229 KB on 132 SMs: 60 SMs hold two, 72 one) bound by that
# imbalance? (s27/n4 trace: the routed w13 stream 14.9 us for 44 MB, 10.7 at 4.1 TB/s; two
# phases, all SMs then the 60, predict ~15 us.) ncu_profile.sh now records sm__cycles_active
# min / max / avg per kernel: the imbalance reads max / avg.
part27=(
  "200:ncu_b1:bash scripts/gpu/ncu_profile.sh $R/ncu b1kda --backend specialized --tp 16 --batch 1 --layers kda"
)
# Part 28 (session 27, next; after part 27 has said whether the imbalance is there): W13T1 with
# two CTAs per item, each on half of K (DECODESCOPE_MOE_T1_KSPLIT=2: 384 CTAs at TP16, 3 per SM,
# the halves' partials added by the second to arrive; built and CPU-tested, never run): its GPU
# tests, the layers d / ks2 / d / ks2 at TP16 and d / ks2 at TP8 batch 1, specialized, same
# call, the whole step with it. Prediction (notes/specialized.md "Session 27"): TP16 expert
# kernels' share -2 to -3.5 us per MoE layer, projected step 7.82 -> 7.55-7.65 ms; TP8 within
# +-1 us (its grid is already even: ks2 there adds the partials' round trip for nothing).
KS2="DECODESCOPE_MOE_T1_KSPLIT=2"
part28=(
  "150:ktest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_experts_t1.py -k ks2"
  "60:k16d:$B1 --tp-shape 16 --json $R/k16d.json"
  "60:k16s:$KS2 $B1 --tp-shape 16 --json $R/k16s.json"
  "60:k16d2:$B1 --tp-shape 16 --json $R/k16d2.json"
  "60:k16s2:$KS2 $B1 --tp-shape 16 --json $R/k16s2.json"
  "60:k8dd:$B1 --tp-shape 8 --json $R/k8dd.json"
  "60:k8s:$KS2 $B1 --tp-shape 8 --json $R/k8s.json"
  "120:ksteps:$KS2 python scripts/gpu_steps.py --tp 16 8 --points 1x1 --layers dense,kda,mla --out $R/ksteps"
)
# Part 29 (session 28): s28/n1's Nsight Compute of the TP16 batch-1 KDA layer refuted the
# imbalance (W13T1's sm__cycles_active max / avg 1.06, not ~1.45) and showed the kernel issue-
# bound: 1.45 active warps per scheduler, 0.16 issued per cycle, 43% of its stall cycles waiting on
# shared-memory loads (its dot products), 2.72 TB/s. More warps per SM, same bytes: two CTAs per
# item (KSPLIT=2) of 4 warps on 64-wide chunks, 8 stages (384 CTAs of 50 KB, 3 per SM: 8-12 warps
# on every SM against 4-8). Knobs only (compiles on the CPU; KSPLIT=2 alone, the 2-warp form, was
# even in s28/n2). Prediction: TP16 expert share -1.5 to -3 us per MoE layer; wrong if under
# 0.5. Then the whole-step check with it, and the default step at every point of the issue
# (batch 1, 8, 32, 64, 1x8, 8x8; TP8, TP16; dense, KDA, MLA) at this commit (vLLM parts staged).
K4="DECODESCOPE_MOE_T1_KSPLIT=2 DECODESCOPE_MOE_T1_KW=4 DECODESCOPE_MOE_T1_BK=64 DECODESCOPE_MOE_T1_STAGES=8"
part29=(
  "60:q16d:$B1 --tp-shape 16 --json $R/q16d.json"
  "60:q16k:$K4 $B1 --tp-shape 16 --json $R/q16k.json"
  "60:q16d2:$B1 --tp-shape 16 --json $R/q16d2.json"
  "60:q16k2:$K4 $B1 --tp-shape 16 --json $R/q16k2.json"
  "90:qsteps:$K4 python scripts/gpu_steps.py --tp 16 --points 1x1 --layers dense,kda,mla --out $R/qsteps"
  "330:allsteps:python scripts/gpu_steps.py --tp 16 8 --points 1x1 8x1 32x1 64x1 1x8 8x8 --layers dense,kda,mla --budget 280 --out $R/allsteps"
)
# Part 30 (session 28): the one-token route off the critical path (DECODESCOPE_MOE_T1_EARLY=4:
# FrontMmaEarly runs each router row tile as 4 CTAs on a quarter of K and counts them in;
# RouteT1Early, resident beside the front, sums the parts and ranks while the front still
# streams, then waits and triggers W13T1 as before). s28/n3 showed the ranking, not the route
# launch, is the link (W13T1Route ranking in every CTA after its wait: the same time). Order:
# the whole step first (correctness), then the layer A/B, the GPU tests, TP8. Prediction: each
# MoE layer's share -2 to -3.5 us at TP16 (the route's 4.3 us after the front, s27/n4, less the
# wait's release), projected step 7.74 -> 7.45-7.6 ms; wrong if under 1 us.
EA="DECODESCOPE_MOE_T1_EARLY=4"
part30=(
  "70:esteps:$EA python scripts/gpu_steps.py --tp 16 8 --points 1x1 --layers dense,kda,mla --out $R/esteps"
  "45:e16d:$B1 --tp-shape 16 --json $R/e16d.json"
  "45:e16e:$EA $B1 --tp-shape 16 --json $R/e16e.json"
  "45:e16d2:$B1 --tp-shape 16 --json $R/e16d2.json"
  "45:e16e2:$EA $B1 --tp-shape 16 --json $R/e16e2.json"
  "90:etest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_experts_t1.py -k 't1_e4 or t1_e2'"
  "45:e8d:$B1 --tp-shape 8 --json $R/e8d.json"
  "45:e8e:$EA $B1 --tp-shape 8 --json $R/e8e.json"
)
# Part 31 (session 28, next): where the early route's +9 us per MoE layer comes from (s28/n7).
# FrontMmaEarly and RouteT1Early now stamp the global timer at each phase (front_mma.STAMPS):
# the front's CTA 0 resident, its last router CTA counted in, the route resident, past the
# count, ranked, back from its PDL wait. scripts/early_stamps.py prints the medians per MoE layer.
# Prediction (from the n7 trace: route resident 10 us into the front, ended 8.6 us after it):
# either route_counted - router_done is small and route_ranked - route_counted is 5 us or more
# (the ranking slowed beside the saturating front: then rank from registers), or router_done
# itself comes late (the router CTAs finish with the rest: then fewer, earlier router CTAs).
# Then the early route's GPU tests (not run in n7) and its TP8 A/B.
part31=(
  "90:stamps16:$EA python scripts/early_stamps.py --tp 16 --replays 50 --out $R/stamps16"
  "90:stamps8:$EA python scripts/early_stamps.py --tp 8 --replays 50 --out $R/stamps8"
  "120:etest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_experts_t1.py -k 't1_e4 or t1_e2'"
  "45:e8d:$B1 --tp-shape 8 --json $R/e8d.json"
  "45:e8e:$EA $B1 --tp-shape 8 --json $R/e8e.json"
)
# Part 32 (session 29): the dense MLP's two 1-token GEMMs on the streaming GEMV
# (DECODESCOPE_GEMV_EXT=1: gemv_stream's SiTU epilogue and K tail). s28 trace of the dense layer
# at batch 1: gate_up on the skinny kernel at 2.4 TB/s (TP16) / 3.3 (TP8), down at 2.3-2.4.
# 32a: the GPU tests, then the kernels alone (knob sets; the fastest into tuned_dense.json).
# 32b: the dense layer A/B (default / GEMV / GEMV with the sweep's sets), ABAB, TP16 then TP8,
# then the whole step with the knob (dense, KDA, MLA at 1x1, needs the vLLM parts).
# Prediction (notes/specialized.md "Session 29"): the dense layer's span -8 to -12 us at both
# shapes (TP16 59.6 -> ~49, TP8 98.4 -> ~88).
GX="DECODESCOPE_GEMV_EXT=1"
GT="$GX DECODESCOPE_GEMV_TUNED=/tmp/tuned_dense.json"  # 32a writes it in its $R: copy it there first
D1="decodescope bench --batch 1 --backends specialized --layers dense --out $R/ab"
SW="python scripts/gpu_specialized_attn.py --gemv-only --gemv-shapes dense_gate_up dense_down --sweep-ms 1 --write-tuned $R/tuned_dense.json"
part32a=(
  "200:dtest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_skinny_gemv.py -k 'dense or gemv_vs'"
  "150:sw16:$GX $SW --tp 16 --out $R/sw16"
  "200:sw8:$GX $SW --tp 8 --out $R/sw8"
)
part32b=(
  "50:x16d:$D1 --tp-shape 16 --json $R/x16d.json"
  "50:x16g:$GX $D1 --tp-shape 16 --json $R/x16g.json"
  "50:x16t:$GT $D1 --tp-shape 16 --json $R/x16t.json"
  "50:x16d2:$D1 --tp-shape 16 --json $R/x16d2.json"
  "50:x16g2:$GX $D1 --tp-shape 16 --json $R/x16g2.json"
  "50:x8d:$D1 --tp-shape 8 --json $R/x8d.json"
  "50:x8g:$GX $D1 --tp-shape 8 --json $R/x8g.json"
  "50:x8t:$GT $D1 --tp-shape 8 --json $R/x8t.json"
  "50:x8d2:$D1 --tp-shape 8 --json $R/x8d2.json"
  "50:x8g2:$GX $D1 --tp-shape 8 --json $R/x8g2.json"
)
part32c=(
  "120:xsteps:$GX python scripts/gpu_steps.py --tp 16 8 --points 1x1 --layers dense,kda,mla --out $R/xsteps"
)
# Part 33 (session 29): the dense MLP on the GEMV is the default (DECODESCOPE_GEMV_EXT, the
# measured knob sets): its GPU tests, the whole step at batch 1, then the README's batch-1 rows
# (both backends: stage the vLLM parts) into $R/ds (merge into results/).
part33=(
  "150:dgpu:python -m pytest -q -p no:cacheprovider -m gpu tests/test_specialized_dense_gpu.py -k 'equal_refs'"
  "120:steps:python scripts/gpu_steps.py --tp 16 8 --points 1x1 --layers dense,kda,mla --out $R/steps"
  "150:b16:decodescope bench --tp-shape 16 --batch 1 --out $R/ds --json $R/b16.json"
  "150:b8:decodescope bench --tp-shape 8 --batch 1 --out $R/ds --json $R/b8.json"
)
# Part 34 (session 29): the LatentMoE back at one token on the streaming GEMV
# (DECODESCOPE_MOE_BACK=gemv: gemv_stream.GemvStreamBack). s28 trace (TP16 KDA layer 1): BackMma
# ends 15.7 us after W2T1 for 51 MB (3.25 TB/s); the GEMV streamed the dense MLP at 3.5-3.8.
# Prediction (notes/specialized.md "Session 29"): each MoE layer's share -1 to -3 us.
# 34a: the GPU tests, the whole step with it, the TP16 A/B (auto_cfg and two knob sets, ABAB);
# 34b: the TP8 A/B.
BG="DECODESCOPE_MOE_BACK=gemv"
BT="$BG DECODESCOPE_GEMV_TUNED=scripts/gpu/tuned_ab/back_"
M1="decodescope bench --batch 1 --backends specialized --layers kda,mla --out $R/ab"
part34a=(
  "100:btest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_back_gemv.py"
  "100:bsteps:$BG python scripts/gpu_steps.py --tp 16 8 --points 1x1 --layers dense,kda,mla --out $R/bsteps"
  "45:m16d:$M1 --tp-shape 16 --json $R/m16d.json"
  "45:m16g:$BG $M1 --tp-shape 16 --json $R/m16g.json"
  "45:m16t1:${BT}w4r4g2d2.json $M1 --tp-shape 16 --json $R/m16t1.json"
  "45:m16t2:${BT}w16r1g4d2.json $M1 --tp-shape 16 --json $R/m16t2.json"
  "45:m16d2:$M1 --tp-shape 16 --json $R/m16d2.json"
  "45:m16g2:$BG $M1 --tp-shape 16 --json $R/m16g2.json"
)
part34b=(
  "45:m8d:$M1 --tp-shape 8 --json $R/m8d.json"
  "45:m8g:$BG $M1 --tp-shape 8 --json $R/m8g.json"
  "45:m8d2:$M1 --tp-shape 8 --json $R/m8d2.json"
  "45:m8g2:$BG $M1 --tp-shape 8 --json $R/m8g2.json"
)
# Part 35 (session 30): the KDA decode at large batch: the persistent state stream
# (DECODESCOPE_KDA_STREAM, kernels/specialized/kda_decode_stream.py) and the batched chain
# (DECODESCOPE_KDA_CHAIN=batched). 35a: their GPU tests and the kernel alone (one-CTA / stream
# 2x1 / 1x2, per-token / batched chain; the split's chains at 1 x 1 and 1 x 8); 35b: the dense
# and KDA layers at batch 64 (specialized, same call); 35c: the same at 64 x 8 (verify step
# only), then 1 x 8 (the split's chain). Prediction: notes/specialized.md "Session 30".
KB="decodescope bench --batch 64 --backends specialized --layers dense,kda --out $R/ab"
KV="$KB --spec-verify 7 --verify-only"
KV1="decodescope bench --batch 1 --spec-verify 7 --verify-only --backends specialized --layers dense,kda --out $R/ab"
KCB="DECODESCOPE_KDA_CHAIN=batched"
KSB="DECODESCOPE_KDA_STREAM=2x1 $KCB"
part35a=(
  "200:kst:python -m pytest -q -p no:cacheprovider -m gpu tests/test_kda_stream.py"
  "300:kalone:python scripts/gpu_kda_split.py --out $R/kalone --tp 8 16 --points 64x1 32x1 64x8 32x8 8x8 --splits 1 --streams 0 2x1 1x2 --chains token batched"
  "120:ksplit:python scripts/gpu_kda_split.py --out $R/ksplit --tp 8 16 --points 1x1 1x8 --splits 8 --chains token batched"
)
part35b=(
  "75:k8d:$KB --tp-shape 8 --json $R/k8d.json"
  "75:k8b:$KCB $KB --tp-shape 8 --json $R/k8b.json"
  "75:k8s:$KSB $KB --tp-shape 8 --json $R/k8s.json"
  "75:k16d:$KB --tp-shape 16 --json $R/k16d.json"
  "75:k16b:$KCB $KB --tp-shape 16 --json $R/k16b.json"
  "75:k16s:$KSB $KB --tp-shape 16 --json $R/k16s.json"
  "75:k8d2:$KB --tp-shape 8 --json $R/k8d2.json"
)
part35c=(
  "90:v8d:$KV --tp-shape 8 --json $R/v8d.json"
  "90:v8b:$KCB $KV --tp-shape 8 --json $R/v8b.json"
  "90:v8s:$KSB $KV --tp-shape 8 --json $R/v8s.json"
  "90:v16d:$KV --tp-shape 16 --json $R/v16d.json"
  "90:v16b:$KCB $KV --tp-shape 16 --json $R/v16b.json"
  "90:v16s:$KSB $KV --tp-shape 16 --json $R/v16s.json"
  "60:w8d:$KV1 --tp-shape 8 --json $R/w8d.json"
  "60:w8b:$KCB $KV1 --tp-shape 8 --json $R/w8b.json"
  "60:w16d:$KV1 --tp-shape 16 --json $R/w16d.json"
  "60:w16b:$KCB $KV1 --tp-shape 16 --json $R/w16b.json"
)
# Part 36 (session 30): the batched chain with contiguous rows per lane, 16-byte shared loads
# and four partial sums (n4's ncu: the 64x8 decode issue-bound on its per-row shared loads,
# 2 warps per scheduler). 36a: its GPU tests and the kernel alone; 36b: the layers, same call.
P36="decodescope bench --backends specialized --layers dense,kda --out $R/ab"
part36a=(
  "150:kst:python -m pytest -q -p no:cacheprovider -m gpu tests/test_kda_stream.py -k batched"
  "200:kalone:python scripts/gpu_kda_split.py --out $R/kalone --tp 8 16 --points 64x1 64x8 32x8 8x8 --splits 1 --streams 0 --chains token batched"
)
part36b=(
  "60:v8d:$P36 --batch 64 --spec-verify 7 --verify-only --tp-shape 8 --json $R/v8d.json"
  "60:v8b:$KCB $P36 --batch 64 --spec-verify 7 --verify-only --tp-shape 8 --json $R/v8b.json"
  "60:v16d:$P36 --batch 64 --spec-verify 7 --verify-only --tp-shape 16 --json $R/v16d.json"
  "60:v16b:$KCB $P36 --batch 64 --spec-verify 7 --verify-only --tp-shape 16 --json $R/v16b.json"
  "60:k8d:$P36 --batch 64 --tp-shape 8 --json $R/k8d.json"
  "60:k8b:$KCB $P36 --batch 64 --tp-shape 8 --json $R/k8b.json"
)
# Part 37 (staged in session 30 for the next): 37a (vLLM parts staged): the whole step against
# the standard one at the batched chain's default, at the points it changed; 37b: the one-CTA
# KDA decode at two CTAs per SM from 2 tokens (DECODESCOPE_KDA_OCC=2: 128 registers, ~200 bytes
# of spills) and its token passes rolled into a loop (DECODESCOPE_KDA_ROLL=1: 70 KB of cubin
# instead of 108) against the default, alone, then where its warps stall at 64 x 8 (Nsight
# Compute source counters, both chains:
# the 16-byte loads and the batched chain moved it by 1-2% alone); 37c (vLLM parts): the
# README rows of the verify steps and batch 64 at the new default, both backends.
part37a=(
  "300:steps:python scripts/gpu_steps.py --tp 16 8 --points 1x8 8x8 64x1 64x8 --layers dense,kda,mla --out $R/steps"
)
part37b=(
  "100:occ1:python scripts/gpu_kda_split.py --out $R/occ1 --tp 8 16 --points 64x8 32x8 8x8 --splits 1 --chains batched"
  "100:occ2:DECODESCOPE_KDA_OCC=2 python scripts/gpu_kda_split.py --out $R/occ2 --tp 8 16 --points 64x8 32x8 8x8 --splits 1 --chains batched"
  "100:roll:DECODESCOPE_KDA_ROLL=1 python scripts/gpu_kda_split.py --out $R/roll --tp 8 16 --points 64x8 32x8 8x8 --splits 1 --chains batched"
  "100:rtest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_kda_stream.py -k roll_gpu"
  "150:src_b:bash scripts/gpu/ncu_source.sh $R/ncu kda8_batched KDADecode --backend specialized --tp 16 --batch 64 --tokens 8 --layers dense"
  "150:src_t:DECODESCOPE_KDA_CHAIN=token bash scripts/gpu/ncu_source.sh $R/ncu kda8_token KDADecode --backend specialized --tp 16 --batch 64 --tokens 8 --layers dense"
)
part37c=(
  "280:r8:decodescope bench --tp-shape 8 --batch 1,64 --spec-verify 7 --out $R/ds --json $R/r8.json"
  "280:r16:decodescope bench --tp-shape 16 --batch 1,64 --spec-verify 7 --out $R/ds --json $R/r16.json"
)
# Part 37d (session 31): the capture's cost on graph replays with the session paused against
# recording, ABBA in one process (bench_capture_overhead --graph-ab), standard b1 (58 kernels,
# +3.5% recording): what a capture recording one step in N would pay. Predictions:
# notes/capture.md "Session 31".
part37d=(
  "150:ovh:python benchmarks/bench_capture_overhead.py --workload standard --batch 1 --variants default,control --eager-ab 0 --graph-ab 6 --budget-s 140 --out $R/ovh"
)
# Part 38 (session 31): the batched chain's projection staged in shared memory
# (DECODESCOPE_KDA_STAGE, default on) and two CTAs per SM where it halves the waves
# (DECODESCOPE_KDA_OCC=auto, default). 38a (vLLM parts staged): the GPU tests, the kernel alone
# with the staging off / on (same call), the whole step at the points they change. 38b: the
# layer A/B, specialized, staging off / on. Predictions: notes/specialized.md "Session 31".
KP="--tp 8 16 --points 64x8 32x8 8x8 64x1 --splits 1 --chains batched"
part38a=(
  "150:ktests:python -m pytest -q -p no:cacheprovider -m gpu tests/test_kda_stream.py -k 'batched_matches_token or roll_gpu or stream_gpu'"
  "90:s0:DECODESCOPE_KDA_STAGE=0 python scripts/gpu_kda_split.py --out $R/s0 $KP"
  "90:s1:python scripts/gpu_kda_split.py --out $R/s1 $KP"
  "200:steps:python scripts/gpu_steps.py --tp 8 16 --points 64x8 32x8 64x1 8x8 --layers dense,kda --out $R/steps"
)
BK="decodescope bench --backends specialized --layers dense,kda --batch 32,64 --spec-verify 7 --out $R/ab"
part38b=(
  "80:b8s0:DECODESCOPE_KDA_STAGE=0 $BK --tp-shape 8 --json $R/b8s0.json"
  "80:b8s1:$BK --tp-shape 8 --json $R/b8s1.json"
  "80:b16s0:DECODESCOPE_KDA_STAGE=0 $BK --tp-shape 16 --json $R/b16s0.json"
  "80:b16s1:$BK --tp-shape 16 --json $R/b16s1.json"
)
# Part 39 (staged in session 31 for the next). 39a (vLLM parts staged): the split's staged
# projection (DECODESCOPE_KDA_SPLIT_STAGE, the default since s31 m3 / m4: its whole-step check
# is the `steps` stage; 0 for the A/B) and the approximate-reciprocal sigmoid
# (DECODESCOPE_FAST_SIGMOID=1, opt-in, every KDA / MLA kernel) checked (GPU tests; the KDA decode
# against its FP32 reference; the whole step against the standard one), then the split alone
# at 1x8, off / on. 39b: the layers, specialized, same call, 1x8 and 64x8: default, split
# staging, fast sigmoid (bench stages get 150 s: 80 s cut the 64x8 points in s31). 39c (vLLM
# parts): the README's verify-step rows at the s31 defaults (KDA OCC auto + staging), both
# backends. Also: two CTAs per SM (OCC auto) against one with the staging on (auto was chosen
# on s31 n4's unstaged figures; the staging may have taken part of what two per SM hid).
# Predictions: notes/specialized.md "Session 31".
SP="--tp 8 16 --points 1x8 2x8 --splits 8 4 --chains batched"
part39a=(
  "120:stests:python -m pytest -q -p no:cacheprovider -m gpu tests/test_kda_stream.py -k 'split_stage_gpu or batched_split_gpu'"
  "60:sp0:DECODESCOPE_KDA_SPLIT_STAGE=0 python scripts/gpu_kda_split.py --out $R/sp0 $SP"
  "60:sp1:python scripts/gpu_kda_split.py --out $R/sp1 $SP"
  "60:fsk:DECODESCOPE_FAST_SIGMOID=1 python scripts/gpu_kda_split.py --out $R/fsk --tp 8 16 --points 1x1 1x8 64x8 --splits 1 8 --chains token batched"
  "200:fsteps:DECODESCOPE_FAST_SIGMOID=1 python scripts/gpu_steps.py --tp 8 16 --points 1x1 64x1 1x8 64x8 --layers kda,mla --out $R/fsteps"
  "120:steps:python scripts/gpu_steps.py --tp 8 16 --points 1x8 2x8 --layers dense,kda,mla --out $R/steps"
  "60:occ1:DECODESCOPE_KDA_OCC=1 python scripts/gpu_kda_split.py --out $R/occ1 --tp 8 16 --points 64x8 32x8 16x8 --splits 1 --chains batched"
  "60:occa:python scripts/gpu_kda_split.py --out $R/occa --tp 8 16 --points 64x8 32x8 16x8 --splits 1 --chains batched"
)
BV="decodescope bench --backends specialized --layers kda,mla --batch 1,64 --spec-verify 7 --verify-only --out $R/ab"
part39b=(
  "150:v8d:$BV --tp-shape 8 --json $R/v8d.json"
  "150:v8s:DECODESCOPE_KDA_SPLIT_STAGE=0 $BV --tp-shape 8 --json $R/v8s.json"
  "150:v8f:DECODESCOPE_FAST_SIGMOID=1 $BV --tp-shape 8 --json $R/v8f.json"
)
part39c=(
  "200:r8:decodescope bench --tp-shape 8 --batch 8,32,64 --spec-verify 7 --verify-only --out $R/ds --json $R/r8.json"
  "200:r16:decodescope bench --tp-shape 16 --batch 8,32,64 --spec-verify 7 --verify-only --out $R/ds --json $R/r16.json"
)
# Part 40 (staged in session 32 for the next; no vLLM parts needed). 40a: the TMA GEMM's GPU
# tests at the knob's tiling, the whole step with DECODESCOPE_PROJ_TMA=oproj at TP8 / TP16 64x1
# and 32x1, then the layers A/B at TP16 (batch 32, 64; default / oproj / 1, specialized only).
# 40b: the same A/B at TP8. 40c: the copy warp of its own (wsp) against the same tilings without
# it (tests, then the sweep). Predictions and rules: notes/specialized.md "Session 32".
BT="decodescope bench --backends specialized --layers dense,kda,mla --batch 32,64 --out $R/ab"
part40a=(
  "90:ttest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_tma_gemm.py -k 'project_knob or graph or kw16 or kw0'"
  "150:steps:DECODESCOPE_PROJ_TMA=oproj python scripts/gpu_steps.py --tp 8 16 --points 64x1 32x1 --layers dense,kda,mla --out $R/steps"
  "100:t16d:$BT --tp-shape 16 --json $R/t16d.json"
  "100:t16o:DECODESCOPE_PROJ_TMA=oproj $BT --tp-shape 16 --json $R/t16o.json"
  "100:t16a:DECODESCOPE_PROJ_TMA=1 $BT --tp-shape 16 --json $R/t16a.json"
)
part40c=(
  "90:wtest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_tma_gemm.py -k 'vs_ref and (kw19 or kw20 or kw21)'"
  "200:wsweep:python scripts/gpu_tma_gemm.py --out $R/wsweep --tokens 32 64 --sweep --ops in_proj o_proj gate_up down"
  "240:ncu:DS_NCU_PROG=scripts/gpu_tma_gemm.py bash scripts/gpu/ncu_profile.sh $R/ncu tma16 --out $R/ncu_rows --tp 16 --tokens 64 --ops gate_up down --sweep --profile"
)
part40b=(
  "120:t8d:$BT --tp-shape 8 --json $R/t8d.json"
  "120:t8o:DECODESCOPE_PROJ_TMA=oproj $BT --tp-shape 8 --json $R/t8o.json"
  "120:t8a:DECODESCOPE_PROJ_TMA=1 $BT --tp-shape 8 --json $R/t8a.json"
)
# Part 41 (session 33; vLLM parts staged): the README's batch 8 and 32 rows (one token, both
# backends, TP8 / TP16) at the current defaults (they were measured at 1b95ebe, before the KDA
# decode's batched chain, two CTAs per SM and the split's staging), then the fast sigmoid's
# whole-step check. Predictions: notes/specialized.md "Session 33".
part41=(
  "200:r8:decodescope bench --tp-shape 8 --batch 8,32 --out $R/ds --json $R/r8.json"
  "200:r16:decodescope bench --tp-shape 16 --batch 8,32 --out $R/ds --json $R/r16.json"
  "150:fsig:DECODESCOPE_FAST_SIGMOID=1 python scripts/gpu_steps.py --tp 8 16 --points 1x8 64x1 --layers dense,kda,mla --out $R/fsig"
)
# Part 42 (session 33; no vLLM parts needed): BackMma's PDL trigger after its main loop
# (DECODESCOPE_MOE_BACK_LATE=1): the MoE block's GPU checks and the whole step with it, then the
# layers at batch 1 and 8, default / late / default, TP16 (42a) and TP8 (42b). Prediction and
# rule: notes/specialized.md "Session 33".
BL="decodescope bench --backends specialized --layers dense,kda,mla --batch 1,8 --out $R/ab"
part42a=(
  "120:ltest:DECODESCOPE_MOE_BACK_LATE=1 python -m pytest -q -p no:cacheprovider -m gpu tests/test_specialized_moe_gpu.py -k 'test_specialized_moe_block and pipe and kimi'"
  "150:lsteps:DECODESCOPE_MOE_BACK_LATE=1 python scripts/gpu_steps.py --tp 8 16 --points 1x1 8x1 --layers dense,kda,mla --out $R/lsteps"
  "80:t16d:$BL --tp-shape 16 --json $R/t16d.json"
  "80:t16l:DECODESCOPE_MOE_BACK_LATE=1 $BL --tp-shape 16 --json $R/t16l.json"
  "80:t16d2:$BL --tp-shape 16 --json $R/t16d2.json"
)
part42b=(
  "90:t8d:$BL --tp-shape 8 --json $R/t8d.json"
  "90:t8l:DECODESCOPE_MOE_BACK_LATE=1 $BL --tp-shape 8 --json $R/t8l.json"
  "90:t8d2:$BL --tp-shape 8 --json $R/t8d2.json"
  "90:t8l2:DECODESCOPE_MOE_BACK_LATE=1 $BL --tp-shape 8 --json $R/t8l2.json"
)
# Part 43 (staged in session 33 for the next; no vLLM parts): where the MoE back triggers the
# next layer's launch (DECODESCOPE_MOE_BACK_LATE: 1 = after its main loop, issued = once its
# last weight chunk is issued, auto = 1 from 8 tokens; BackMma to 31 tokens, the tile back from
# 32). 43a: the MoE block's GPU checks with issued (42a's with 1 ran out of time after 7
# passes), the tile back's late cases (not run yet), the whole step with issued and with auto.
# 43b (TP16), 43c (TP8): the layers at batch 1, 8, 24, 64: default / auto / issued; 43d, 43e:
# the same again. Prediction and rule: notes/specialized.md "Session 33".
BA="decodescope bench --backends specialized --layers dense,kda,mla --batch 1,8,24,64 --out $R/ab"
# Session 34 trimmed it to fit one staging in 1,800 s: no `1` block checks (42a passed 7 of 8),
# and auto's runs skip batch 1 (there auto is the default).
BA8="decodescope bench --backends specialized --layers dense,kda,mla --batch 8,24,64 --out $R/ab"
part43a=(
  "150:itest:DECODESCOPE_MOE_BACK_LATE=issued python -m pytest -q -p no:cacheprovider -m gpu tests/test_specialized_moe_gpu.py -k 'test_specialized_moe_block and pipe and kimi'"
  "100:ttest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_back_tile.py -k 'back_tile_gpu and late'"
  "90:isteps:DECODESCOPE_MOE_BACK_LATE=issued python scripts/gpu_steps.py --tp 8 16 --points 1x1 64x1 --layers dense,kda,mla --out $R/isteps"
  "90:asteps:DECODESCOPE_MOE_BACK_LATE=auto python scripts/gpu_steps.py --tp 8 16 --points 16x1 64x1 --layers dense,kda,mla --out $R/asteps"
)
part43b=(
  "130:t16d:$BA --tp-shape 16 --json $R/t16d.json"
  "130:t16a:DECODESCOPE_MOE_BACK_LATE=auto $BA8 --tp-shape 16 --json $R/t16a.json"
  "130:t16i:DECODESCOPE_MOE_BACK_LATE=issued $BA --tp-shape 16 --json $R/t16i.json"
)
part43c=(
  "170:t8d:$BA --tp-shape 8 --json $R/t8d.json"
  "170:t8a:DECODESCOPE_MOE_BACK_LATE=auto $BA8 --tp-shape 8 --json $R/t8a.json"
  "170:t8i:DECODESCOPE_MOE_BACK_LATE=issued $BA --tp-shape 8 --json $R/t8i.json"
)
# the repeats: 43d at TP16, 43e at TP8
part43d=(
  "130:t16d2:$BA --tp-shape 16 --json $R/t16d2.json"
  "130:t16a2:DECODESCOPE_MOE_BACK_LATE=auto $BA8 --tp-shape 16 --json $R/t16a2.json"
  "130:t16i2:DECODESCOPE_MOE_BACK_LATE=issued $BA --tp-shape 16 --json $R/t16i2.json"
)
part43e=(
  "170:t8d2:$BA --tp-shape 8 --json $R/t8d2.json"
  "170:t8a2:DECODESCOPE_MOE_BACK_LATE=auto $BA8 --tp-shape 8 --json $R/t8a2.json"
  "170:t8i2:DECODESCOPE_MOE_BACK_LATE=issued $BA --tp-shape 8 --json $R/t8i2.json"
)
# Part 44 (staged in session 34; kind nvidia-h200-x2, vLLM parts staged): the tp_world 2 rows
# (TP8 shapes on two GPUs, both paths, batch 1 / 8 / 32 / 64) at today's defaults; they are from
# e10bc36 (session 8). 44a: the whole step's check (both reductions of the specialized path);
# 44b: the bench (one call each, as the machine stays warm between them).
part44a=(
  "260:tp2steps:python scripts/gpu_steps_tp2.py --out $R/tp2steps --batches 1,8,32,64 --spec-allreduce fused,nccl --budget 240"
)
part44b=(
  "400:tp2bench:decodescope bench --tp-shape 8 --tp-world 2 --batch 1,8,32,64 --out $R/ds --json $R/tp2.json"
)
# Part 45 (staged in session 34; one H200, no vLLM parts): the sigmoid without the division's
# branch (DECODESCOPE_FAST_SIGMOID=rn: bit-equal to the division above x = -87.3, every kernel,
# the routes' scores included). 45a: its bit-equality test, the route and one-token MoE GPU
# tests with it, the whole step with it; 45b (TP16) and 45c (TP8): the layers at batch 1, 8 and
# 64, default / rn / default / rn. Prediction and rule: notes/specialized.md "Session 34".
BS="decodescope bench --backends specialized --layers dense,kda,mla --batch 1,8,64 --out $R/ab"
part45a=(
  "60:sigtest:python -m pytest -q -p no:cacheprovider -m gpu tests/test_fast_sigmoid.py"
  "150:rtest:DECODESCOPE_FAST_SIGMOID=rn python -m pytest -q -p no:cacheprovider -m gpu tests/test_route_topk.py tests/test_experts_t1.py -k 'thresh_route or grouped_t1_kw2 or grouped_t1_s8_kw4 or grouped_t1_rt1'"
  "150:rsteps:DECODESCOPE_FAST_SIGMOID=rn python scripts/gpu_steps.py --tp 8 16 --points 1x1 8x1 64x1 --layers dense,kda,mla --out $R/rsteps"
)
part45b=(
  "130:t16d:$BS --tp-shape 16 --json $R/t16d.json"
  "130:t16r:DECODESCOPE_FAST_SIGMOID=rn $BS --tp-shape 16 --json $R/t16r.json"
  "130:t16d2:$BS --tp-shape 16 --json $R/t16d2.json"
  "130:t16r2:DECODESCOPE_FAST_SIGMOID=rn $BS --tp-shape 16 --json $R/t16r2.json"
)
part45c=(
  "140:t8d:$BS --tp-shape 8 --json $R/t8d.json"
  "140:t8r:DECODESCOPE_FAST_SIGMOID=rn $BS --tp-shape 8 --json $R/t8r.json"
  "140:t8d2:$BS --tp-shape 8 --json $R/t8d2.json"
  "140:t8r2:DECODESCOPE_FAST_SIGMOID=rn $BS --tp-shape 8 --json $R/t8r2.json"
)
# part 46: rn at 8 and 32 tokens afresh (after 45: faster at 8, slower at TP8 batch 1).
# Prediction and rule: notes/specialized.md "Part 46".
BS46="decodescope bench --backends specialized --layers kda,mla --batch 8,32 --out $R/ab"
part46a=(
  "110:t16d:$BS46 --tp-shape 16 --json $R/t16d.json"
  "110:t16r:DECODESCOPE_FAST_SIGMOID=rn $BS46 --tp-shape 16 --json $R/t16r.json"
  "110:t16d2:$BS46 --tp-shape 16 --json $R/t16d2.json"
  "110:t16r2:DECODESCOPE_FAST_SIGMOID=rn $BS46 --tp-shape 16 --json $R/t16r2.json"
)
part46b=(
  "120:t8d:$BS46 --tp-shape 8 --json $R/t8d.json"
  "120:t8r:DECODESCOPE_FAST_SIGMOID=rn $BS46 --tp-shape 8 --json $R/t8r.json"
  "120:t8d2:$BS46 --tp-shape 8 --json $R/t8d2.json"
  "120:t8r2:DECODESCOPE_FAST_SIGMOID=rn $BS46 --tp-shape 8 --json $R/t8r2.json"
)
# Part 47 (session 35; vLLM parts staged): the README's rows from 8 tokens at the new sigmoid
# default (auto: rn from 2 tokens), both backends. 47a one token per sequence at batch 8, 32,
# 64; 47b the 1+7-token verify steps at batch 1, 8, 32, 64. Batch 1 with one token compiles
# the same PTX as before and is not rerun. Prediction: notes/specialized.md "Part 47".
part47a=(
  "270:r8:decodescope bench --tp-shape 8 --batch 8,32,64 --out $R/ds --json $R/r8.json"
  "270:r16:decodescope bench --tp-shape 16 --batch 8,32,64 --out $R/ds --json $R/r16.json"
)
part47b=(
  "270:v8:decodescope bench --tp-shape 8 --batch 1,8,32,64 --spec-verify 7 --verify-only --out $R/ds --json $R/v8.json"
  "270:v16:decodescope bench --tp-shape 16 --batch 1,8,32,64 --spec-verify 7 --verify-only --out $R/ds --json $R/v16.json"
)
# Part 49 (session 36; one H200, no vLLM parts): the GPU tests s36/n5 did not reach before its
# stage limits (22 of 54 attention halves and 20 of 24 MoE blocks ran there, all passed): the
# other 32 attention halves (32x1 MLA from TP16 on, 64x1, 1x8, 8x8) and the MoE block at 64
# tokens. About 11 s a case there. Prediction: all pass (notes/specialized.md "GPU tests at
# 3aa10d0").
T49="python -m pytest -q -p no:cacheprovider -m gpu"
part49a=(
  "220:attn1:$T49 tests/test_specialized_gpu.py -k '(32x1- or 64x1-) and not 32x1-kda and not 32x1-mla-kimi-k3-8'"
  "280:attn2:$T49 tests/test_specialized_gpu.py -k '1x8- or 8x8-'"
)
part49b=(
  "120:moe64:$T49 tests/test_specialized_moe_gpu.py -k 'specialized_moe_block and 64-kimi'"
)
# Part 50 (session 37; one H200, no vLLM parts): the one-token L2 prefetch of the MoE back's
# weight from W13T1 (DECODESCOPE_MOE_BACK_L2PRE, with and without an L2 set-aside,
# DECODESCOPE_L2_PERSIST_MB). 50a: its GPU test, the MoE blocks 49b left, the TP16 A/B at batch
# 1; 50b: the A/B repeated, o_proj's prefetch of the MoE front with evict_last (alone and with
# the back's), and TP8. Prediction: notes/specialized.md "Part 50".
B50="decodescope bench --backends specialized --layers kda,mla --batch 1 --out $R/ab"
P12="DECODESCOPE_MOE_BACK_L2PRE=12"
P12S="DECODESCOPE_MOE_BACK_L2PRE=12 DECODESCOPE_L2_PERSIST_MB=16"
P24S="DECODESCOPE_MOE_BACK_L2PRE=24 DECODESCOPE_L2_PERSIST_MB=30"
part50a=(
  "100:pretest:$T49 tests/test_experts_t1.py -k back_prefetch_gpu"
  "100:moe64:$T49 tests/test_specialized_moe_gpu.py -k 'specialized_moe_block and 64-kimi'"
  "70:t16d:$B50 --tp-shape 16 --json $R/t16d.json"
  "70:t16p:$P12 $B50 --tp-shape 16 --json $R/t16p.json"
  "70:t16s:$P12S $B50 --tp-shape 16 --json $R/t16s.json"
  "70:t16w:$P24S $B50 --tp-shape 16 --json $R/t16w.json"
)
OPL="DECODESCOPE_OPROJ_PREFETCH=512 DECODESCOPE_OPROJ_PREFETCH_EVICT=last DECODESCOPE_L2_PERSIST_MB=30"
part50b=(
  "70:t16d2:$B50 --tp-shape 16 --json $R/t16d2.json"
  "70:t16s2:$P12S $B50 --tp-shape 16 --json $R/t16s2.json"
  "70:t16o:$OPL $B50 --tp-shape 16 --json $R/t16o.json"
  "70:t16b:$OPL DECODESCOPE_MOE_BACK_L2PRE=12 $B50 --tp-shape 16 --json $R/t16b.json"
  "75:t8d:$B50 --tp-shape 8 --json $R/t8d.json"
  "75:t8s:$P12S $B50 --tp-shape 8 --json $R/t8s.json"
  "75:t8d2:$B50 --tp-shape 8 --json $R/t8d2.json"
  "75:t8s2:$P12S $B50 --tp-shape 8 --json $R/t8s2.json"
)
# Part 51 (session 37, staged; one H200, no vLLM parts): the MLA split kernel's wave-model
# splits at the verify steps (DECODESCOPE_MLA_SPLIT_WAVES=1: 2 splits at TP8 32x8 and TP16 64x8,
# the rule's 1 elsewhere). 51a: its GPU tests, the whole step at those points, the TP8 A/B;
# 51b: the TP16 A/B and the repeats. Prediction: notes/specialized.md "Part 51".
W51="DECODESCOPE_MLA_SPLIT_WAVES=1"
B51="decodescope bench --backends specialized --layers mla --batch 32,64 --spec-verify 7 --verify-only --out $R/ab"
part51a=(
  "150:wtest:$T49 tests/test_mla_split.py -k gpu_waves"
  "200:wsteps:$W51 python scripts/gpu_steps.py --tp 8 16 --points 32x8 64x8 --layers mla --out $R/wsteps"
  "110:v8d:$B51 --tp-shape 8 --json $R/v8d.json"
  "110:v8w:$W51 $B51 --tp-shape 8 --json $R/v8w.json"
)
part51b=(
  "110:v16d:$B51 --tp-shape 16 --json $R/v16d.json"
  "110:v16w:$W51 $B51 --tp-shape 16 --json $R/v16w.json"
  "110:v8d2:$B51 --tp-shape 8 --json $R/v8d2.json"
  "110:v8w2:$W51 $B51 --tp-shape 8 --json $R/v8w2.json"
  "110:v16d2:$B51 --tp-shape 16 --json $R/v16d2.json"
)
# Part 52 (session 38, staged; one H200, no vLLM parts): the verify steps past 64 tokens in
# fewer launches, with part 51's wave-model splits in the same runs (they move other kernels:
# the MLA decode, where these move the MoE back and MLA's first projection; ab_modes.py --ops
# tells them apart). DECODESCOPE_WIDE_BACK=addmm: the MoE back in two launches;
# DECODESCOPE_WIDE_AG=1: MLA's qkv_a and g_proj in one GEMM. 52a: the GPU tests of all three and
# the whole step with all three (and the GEMM rate that the runs record from now on, for the
# ops' compute floors); 52b-c: the A/B, default against all three, TP8 and TP16, twice.
# Run 52a-c instead of 51a-b. Prediction: notes/specialized.md "Part 52".
X52="DECODESCOPE_MLA_SPLIT_WAVES=1 DECODESCOPE_WIDE_BACK=addmm DECODESCOPE_WIDE_AG=1"
B52="decodescope bench --backends specialized --layers kda,mla --batch 32,64 --spec-verify 7 --verify-only --out $R/ab"
part52a=(
  "130:wtest:$T49 tests/test_mla_split.py tests/test_flops.py -k 'gpu_waves or gpu_strided_a_g or gemm_rate'"
  "170:btest:$T49 tests/test_wide_ops_gpu.py -k 'side_cast or wide_moe_block'"
  "240:xsteps:$X52 python scripts/gpu_steps.py --tp 8 16 --points 32x8 64x8 --layers kda,mla --out $R/xsteps"
)
part52b=(
  "110:v8d:$B52 --tp-shape 8 --json $R/v8d.json"
  "110:v8x:$X52 $B52 --tp-shape 8 --json $R/v8x.json"
  "110:v16d:$B52 --tp-shape 16 --json $R/v16d.json"
  "110:v16x:$X52 $B52 --tp-shape 16 --json $R/v16x.json"
)
part52c=(
  "110:v8x2:$X52 $B52 --tp-shape 8 --json $R/v8x2.json"
  "110:v8d2:$B52 --tp-shape 8 --json $R/v8d2.json"
  "110:v16x2:$X52 $B52 --tp-shape 16 --json $R/v16x2.json"
  "110:v16d2:$B52 --tp-shape 16 --json $R/v16d2.json"
)
# Part 53 (session 39, staged; one H200, no vLLM parts needed): where the MLA decode's 141-258
# us go at the verify steps past 64 tokens (the split kernel's phase timelines, `split trace`,
# against the standard path's kernels for the same ops), and what slowed the experts by about 1%
# at TP8 64x8 in part 52's runs with KDA and MLA layers in one process: the new defaults against
# the old paths, then each MLA knob off alone. Prediction: notes/specialized.md "Part 53".
B53="decodescope bench --backends specialized --layers kda,mla --batch 64 --spec-verify 7 --verify-only --tp-shape 8 --out $R/ab"
OLD53="DECODESCOPE_WIDE_BACK=add DECODESCOPE_WIDE_AG=0 DECODESCOPE_MLA_SPLIT_WAVES=0"
part53a=(
  "260:mtrace:python scripts/gpu_mla_tc.py --out $R/mtrace --tp 8 16 --points 32x8 64x8 --variants split 'split trace' --no-sweep --no-diag --budget 230"
  "90:p8n:$B53 --json $R/p8n.json"
  "90:p8o:$OLD53 $B53 --json $R/p8o.json"
)
part53b=(
  "90:p8o2:$OLD53 $B53 --json $R/p8o2.json"
  "90:p8n2:$B53 --json $R/p8n2.json"
  "90:p8ag0:DECODESCOPE_WIDE_AG=0 $B53 --json $R/p8ag0.json"
  "90:p8wv0:DECODESCOPE_MLA_SPLIT_WAVES=0 $B53 --json $R/p8wv0.json"
  "90:p8bk0:DECODESCOPE_WIDE_BACK=add $B53 --json $R/p8bk0.json"
)
# Part 54 (session 39, staged; one H200): DECODESCOPE_WIDE_QNORM=1, MLA's q_b on the raw q_a
# (its RMSNorm weight folded into q_b's), the split decode kernel scaling each score row by its
# token's q_a rstd: 13 -> 12 launches per MLA layer past 64 tokens. 53c: its GPU test and the
# whole step; 53d: the A/B, MLA layer, TP8 and TP16, each mode twice. Prediction:
# notes/specialized.md "Part 54".
Q54="DECODESCOPE_WIDE_QNORM=1"
B54="decodescope bench --backends specialized --layers mla --batch 32,64 --spec-verify 7 --verify-only --out $R/ab"
part53c=(
  "150:qtest:$T49 tests/test_mla_split.py -k gpu_qnorm"
  "200:qsteps:$Q54 python scripts/gpu_steps.py --tp 8 16 --points 32x8 64x8 --layers kda,mla --out $R/qsteps"
)
part53d=(
  "80:q8d:$B54 --tp-shape 8 --json $R/q8d.json"
  "80:q8q:$Q54 $B54 --tp-shape 8 --json $R/q8q.json"
  "80:q16d:$B54 --tp-shape 16 --json $R/q16d.json"
  "80:q16q:$Q54 $B54 --tp-shape 16 --json $R/q16q.json"
  "80:q8q2:$Q54 $B54 --tp-shape 8 --json $R/q8q2.json"
  "80:q8d2:$B54 --tp-shape 8 --json $R/q8d2.json"
)
# one call per part (each under the 600 s a call may run): next_round.sh 1 | 2 | ... | 34b
case "${1:-1}" in
  1) exec bash "$here/run_stages.sh" "${part1[@]}" ;;
  2) exec bash "$here/run_stages.sh" "${part2[@]}" ;;
  3) exec bash "$here/run_stages.sh" "${part3[@]}" ;;
  4) exec bash "$here/run_stages.sh" "${part4[@]}" ;;
  5) exec bash "$here/run_stages.sh" "${part5[@]}" ;;
  6) exec bash "$here/run_stages.sh" "${part6[@]}" ;;
  7) exec bash "$here/run_stages.sh" "${part7[@]}" ;;
  8) exec bash "$here/run_stages.sh" "${part8[@]}" ;;
  9) exec bash "$here/run_stages.sh" "${part9[@]}" ;;
  10) exec bash "$here/run_stages.sh" "${part10[@]}" ;;
  11) exec bash "$here/run_stages.sh" "${part11[@]}" ;;
  12) exec bash "$here/run_stages.sh" "${part12[@]}" ;;
  13) exec bash "$here/run_stages.sh" "${part13[@]}" ;;
  14) exec bash "$here/run_stages.sh" "${part14[@]}" ;;
  15) exec bash "$here/run_stages.sh" "${part15[@]}" ;;
  16) exec bash "$here/run_stages.sh" "${part16[@]}" ;;
  17) exec bash "$here/run_stages.sh" "${part17[@]}" ;;
  18) exec bash "$here/run_stages.sh" "${part18[@]}" ;;
  19) exec bash "$here/run_stages.sh" "${part19[@]}" ;;
  20) exec bash "$here/run_stages.sh" "${part20[@]}" ;;
  21) exec bash "$here/run_stages.sh" "${part21[@]}" ;;
  22) exec bash "$here/run_stages.sh" "${part22[@]}" ;;
  23) exec bash "$here/run_stages.sh" "${part23[@]}" ;;
  24) exec bash "$here/run_stages.sh" "${part24[@]}" ;;
  25) exec bash "$here/run_stages.sh" "${part25[@]}" ;;
  26) exec bash "$here/run_stages.sh" "${part26[@]}" ;;
  27) exec bash "$here/run_stages.sh" "${part27[@]}" ;;
  28) exec bash "$here/run_stages.sh" "${part28[@]}" ;;
  29) exec bash "$here/run_stages.sh" "${part29[@]}" ;;
  30) exec bash "$here/run_stages.sh" "${part30[@]}" ;;
  31) exec bash "$here/run_stages.sh" "${part31[@]}" ;;
  32a) exec bash "$here/run_stages.sh" "${part32a[@]}" ;;
  32b) exec bash "$here/run_stages.sh" "${part32b[@]}" ;;
  32c) exec bash "$here/run_stages.sh" "${part32c[@]}" ;;
  33) exec bash "$here/run_stages.sh" "${part33[@]}" ;;
  34a) exec bash "$here/run_stages.sh" "${part34a[@]}" ;;
  34b) exec bash "$here/run_stages.sh" "${part34b[@]}" ;;
  35a) exec bash "$here/run_stages.sh" "${part35a[@]}" ;;
  35b) exec bash "$here/run_stages.sh" "${part35b[@]}" ;;
  35c) exec bash "$here/run_stages.sh" "${part35c[@]}" ;;
  36a) exec bash "$here/run_stages.sh" "${part36a[@]}" ;;
  36b) exec bash "$here/run_stages.sh" "${part36b[@]}" ;;
  37a) exec bash "$here/run_stages.sh" "${part37a[@]}" ;;
  37b) exec bash "$here/run_stages.sh" "${part37b[@]}" ;;
  37c) exec bash "$here/run_stages.sh" "${part37c[@]}" ;;
  37d) exec bash "$here/run_stages.sh" "${part37d[@]}" ;;
  38a) exec bash "$here/run_stages.sh" "${part38a[@]}" ;;
  38b) exec bash "$here/run_stages.sh" "${part38b[@]}" ;;
  39a) exec bash "$here/run_stages.sh" "${part39a[@]}" ;;
  39b) exec bash "$here/run_stages.sh" "${part39b[@]}" ;;
  39c) exec bash "$here/run_stages.sh" "${part39c[@]}" ;;
  40a) exec bash "$here/run_stages.sh" "${part40a[@]}" ;;
  40b) exec bash "$here/run_stages.sh" "${part40b[@]}" ;;
  40c) exec bash "$here/run_stages.sh" "${part40c[@]}" ;;
  41) exec bash "$here/run_stages.sh" "${part41[@]}" ;;
  42a) exec bash "$here/run_stages.sh" "${part42a[@]}" ;;
  42b) exec bash "$here/run_stages.sh" "${part42b[@]}" ;;
  43a) exec bash "$here/run_stages.sh" "${part43a[@]}" ;;
  43b) exec bash "$here/run_stages.sh" "${part43b[@]}" ;;
  43c) exec bash "$here/run_stages.sh" "${part43c[@]}" ;;
  43d) exec bash "$here/run_stages.sh" "${part43d[@]}" ;;
  43e) exec bash "$here/run_stages.sh" "${part43e[@]}" ;;
  44a) exec bash "$here/run_stages.sh" "${part44a[@]}" ;;
  44b) exec bash "$here/run_stages.sh" "${part44b[@]}" ;;
  45a) exec bash "$here/run_stages.sh" "${part45a[@]}" ;;
  45b) exec bash "$here/run_stages.sh" "${part45b[@]}" ;;
  45c) exec bash "$here/run_stages.sh" "${part45c[@]}" ;;
  46a) exec bash "$here/run_stages.sh" "${part46a[@]}" ;;
  46b) exec bash "$here/run_stages.sh" "${part46b[@]}" ;;
  47a) exec bash "$here/run_stages.sh" "${part47a[@]}" ;;
  47b) exec bash "$here/run_stages.sh" "${part47b[@]}" ;;
  49a) exec bash "$here/run_stages.sh" "${part49a[@]}" ;;
  49b) exec bash "$here/run_stages.sh" "${part49b[@]}" ;;
  50a) exec bash "$here/run_stages.sh" "${part50a[@]}" ;;
  50b) exec bash "$here/run_stages.sh" "${part50b[@]}" ;;
  51a) exec bash "$here/run_stages.sh" "${part51a[@]}" ;;
  51b) exec bash "$here/run_stages.sh" "${part51b[@]}" ;;
  52a) exec bash "$here/run_stages.sh" "${part52a[@]}" ;;
  52b) exec bash "$here/run_stages.sh" "${part52b[@]}" ;;
  52c) exec bash "$here/run_stages.sh" "${part52c[@]}" ;;
  53a) exec bash "$here/run_stages.sh" "${part53a[@]}" ;;
  53b) exec bash "$here/run_stages.sh" "${part53b[@]}" ;;
  53c) exec bash "$here/run_stages.sh" "${part53c[@]}" ;;
  53d) exec bash "$here/run_stages.sh" "${part53d[@]}" ;;
  *) echo "next_round.sh: part 1 to 31, 32a-c, 33, 34a-b, 35a-c, 36a-b, 37a-d, 38a-b, 39a-c, 40a-c, 41, 42a-b, 43a-e, 44a-b, 45a-c, 46a-b, 47a-b, 49a-b, 50a-b, 51a-b or 52a-c, got '$1'" >&2; exit 2 ;;
esac
