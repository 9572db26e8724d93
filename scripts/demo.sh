#!/usr/bin/env bash
# The main job: an RL-style rollout workload on the embedded local daemon.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/corral demo "$@"
