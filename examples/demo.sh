#!/usr/bin/env bash
# The README's demo: a training run that needs several time-limit cycles.
# Each cycle may run 25 s; procckpt asks for a checkpoint 4 s before the end, stops the
# training, starts it again, and the run resumes where it stopped until it finishes. The
# training (1000 epochs of at least 30 ms) outlasts a cycle on any machine, and a cycle leaves
# time to train after a start that a busy machine can stretch to 10 s or more.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/procckpt-demo.XXXXXX")"
cd "$work"
echo "== procckpt demo in $work"
echo "== procckpt run --time-limit 25s --grace 4s -- python polynomial_regression.py --sleep 0.03"
procckpt run --time-limit 25s --grace 4s -- python "$here/polynomial_regression.py" --sleep 0.03
echo
echo "== procckpt status"
procckpt status
