#!/usr/bin/env bash
# Builds and starts a complete single-node Cairn: data in ./cairn-data, gRPC on 127.0.0.1:5122.
# Extra arguments go to `cairn` (e.g. --config cairn.toml). Installs build dependencies first.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup-debian.sh
export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cairn-target}"
cargo build --release --bins
exec "$CARGO_TARGET_DIR/release/cairn" "$@"
