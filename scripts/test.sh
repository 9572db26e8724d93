#!/usr/bin/env bash
# The whole test suite: lint, types, Rust checks, then pytest (real daemon, real sandboxes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$HOME/.cargo/bin:$PATH"
.venv/bin/ruff check .
.venv/bin/mypy
(cd rust && cargo fmt --check && cargo clippy --quiet --all-targets -- -D warnings && cargo test --quiet --lib)
exec .venv/bin/pytest -q tests "$@"
