#!/usr/bin/env bash
# Operator trials (issue 20): what an operator or a failure does to a run, one trial at a time. Results table:
# docs/failures.md "Operator trials". Not part of the test suite: it needs root (trial 5 mounts a tmpfs),
# torchrun and ss, takes 15-25 minutes, and must run alone on the machine (never beside another job).
#
#   this checkout:                   bash tools/trials/run_trials.sh
#   an older commit (the "before"):  COMMIT=a75e725 LABEL=before bash tools/trials/run_trials.sh
#   some trials only:                ONLY=6.1,6.3 bash tools/trials/run_trials.sh
#
# Results: $TRIALS/$LABEL/results.{json,md} (default /tmp/trials/after), logs and run directories beside them.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel)
LABEL=${LABEL:-after}
TRIALS=${TRIALS:-/tmp/trials}
if [ -n "${COMMIT:-}" ]; then  # a clean copy of that commit, imported instead of the installed one
  ROOT=$TRIALS/src-$COMMIT
  [ -d "$ROOT/.git" ] || { git clone -q "$REPO" "$ROOT" && git -C "$ROOT" checkout -q "$COMMIT"; } || exit 1
else
  ROOT=$REPO
fi
export ROOT LABEL TRIALS PYTHONPATH="$ROOT/src"
mkdir -p "$TRIALS/$LABEL"
cd "$ROOT" || exit 1
# a hard ceiling for the whole set; each trial has its own timeouts inside
timeout -k 10 3600 python "$HERE/trials.py" 2>&1 | tee "$TRIALS/$LABEL/trials.log"
