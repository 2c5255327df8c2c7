#!/usr/bin/env bash
# Installs what building and testing Cairn needs on Debian 12, as root. Safe to run again: it only
# installs what is missing.
set -euo pipefail

need_apt=()
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
[ -e /usr/lib/llvm-14/lib/libclang.so ] || ls /usr/lib/llvm-*/lib/libclang.so >/dev/null 2>&1 || need_apt+=(libclang-dev)
command -v clang >/dev/null 2>&1 || need_apt+=(clang)
command -v c++ >/dev/null 2>&1 || need_apt+=(build-essential)
command -v sst_dump >/dev/null 2>&1 || need_apt+=(rocksdb-tools)
command -v curl >/dev/null 2>&1 || need_apt+=(curl ca-certificates)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null 2>&1; then
  if [ -x "$HOME/.cargo/bin/cargo" ]; then
    :
  else
    echo "setup: installing the Rust toolchain with rustup" >&2
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --component rustfmt,clippy
  fi
fi
