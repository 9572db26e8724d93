#!/usr/bin/env bash
# Installs everything corral needs on a Debian 12 machine (run as root), idempotently:
# Debian packages, a Rust toolchain if none is present, and a virtualenv at .venv with corral
# built from this checkout (maturin builds the Rust core).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(id -u)" != 0 ]; then
  echo "corral setup must run as root (sandboxes need namespaces, mounts and cgroups)" >&2
  exit 1
fi

# Debian packages: compilers (the static sandbox init needs libc6-dev's libc.a), Python venv
# support, iproute2 and util-linux (tests), procps, btrfs-progs (mkfs.btrfs: the sandboxes' disk),
# lxcfs (each sandbox's /proc view of its own limits: docs/daemon.md), runsc (gVisor: the
# gvisor substrate, docs/substrates.md), nftables (libnftables: sandbox network rules,
# docs/network.md), erofs-utils (mkfs.erofs: image layers, docs/images.md); for the image
# tests: docker-registry (a real OCI registry on loopback), skopeo (pushes the test images),
# busybox-static (their rootfs), apache2-utils (htpasswd), zstd, openssl; chromium and
# chromium-driver (the dashboard's browser test, docs/observability.md); dnsutils (dig: the
# network tests' DNS over TCP from inside a sandbox).
PKGS=(build-essential libc6-dev pkg-config python3 python3-venv python3-dev iproute2 util-linux
      procps tar xz-utils btrfs-progs lxcfs runsc nftables erofs-utils docker-registry skopeo
      busybox-static apache2-utils zstd openssl chromium chromium-driver dnsutils)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Rust: prefer an existing rustup toolchain; otherwise Debian's cargo.
export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v cargo >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq cargo rustc >/dev/null
fi

# Python: a private virtualenv so the system Python stays untouched.
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test,bench,cluster]'
