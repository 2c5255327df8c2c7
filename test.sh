#!/usr/bin/env bash
# Runs every test of the workspace. Installs build dependencies first.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup-debian.sh
export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cairn-target}"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --all-features --no-fail-fast "$@"
else
  cargo test --workspace --all-features --no-fail-fast "$@"
fi
