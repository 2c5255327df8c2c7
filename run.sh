#!/usr/bin/env bash
# Builds and starts a complete single-node Cairn: data in ./cairn-data, gRPC on 127.0.0.1:5122,
# the Redis protocol on 127.0.0.1:6380.
# Extra arguments go to `cairn` (e.g. --config cairn.toml). Installs build dependencies first,
# and puts `cairnctl` on the PATH (a link in /usr/local/bin) so that any user of the machine can
# run the README's `cairnctl …` commands.
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/setup-debian.sh
export PATH="$HOME/.cargo/bin:$PATH"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/var/cache/cairn-target}"
cargo build --release --bins
cairnctl="$CARGO_TARGET_DIR/release/cairnctl"
link=/usr/local/bin/cairnctl
if ln -sfn "$cairnctl" "$link" 2>/dev/null; then
    echo "run.sh: cairnctl is on the PATH ($link -> $cairnctl); try: cairnctl kv put greeting hello"
else
    echo "run.sh: cannot link $link (run as root to do so); run cairnctl as $cairnctl" >&2
fi
exec "$CARGO_TARGET_DIR/release/cairn" "$@"
