#!/usr/bin/env bash
# GPU helper: bash r.sh pendingN | bash r.sh x STAGE...
export DECODESCOPE_GIT_COMMIT=$(cat SHA 2>/dev/null)
case "$1" in
  pending*) n=${1#pending}; DS_STAGES_NAME=$1 bash scripts/gpu/next_round.sh "$n" ;;
  x) shift; DS_STAGES_NAME=${DS_STAGES_NAME:-x} bash scripts/gpu/run_stages.sh "$@" ;;
esac
