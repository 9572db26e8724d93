#!/usr/bin/env bash
# The whole test suite: lint, Rust checks, then pytest (real daemon, real sandboxes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
.venv/bin/ruff check .
(cd rust && cargo fmt --check && cargo clippy --quiet --all-targets -- -D warnings)
exec .venv/bin/pytest -q tests "$@"
