#!/usr/bin/env bash
# The README's demo: a training run that needs several time-limit cycles.
# Each cycle may run 15 s; procckpt asks for a checkpoint 4 s before the end, stops the
# training, starts it again, and the run resumes where it stopped until it finishes.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/procckpt-demo.XXXXXX")"
cd "$work"
echo "== procckpt demo in $work"
echo "== procckpt run --time-limit 15s --grace 4s -- python polynomial_regression.py"
procckpt run --time-limit 15s --grace 4s -- python "$here/polynomial_regression.py"
echo
echo "== procckpt status"
procckpt status
