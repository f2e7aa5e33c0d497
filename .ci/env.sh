# Sourced by .ci/main, .ci/test and .ci/run: makes (or reuses) the pinned
# virtualenv and installs fsdp-rs into it. Idempotent; a fresh machine needs
# only python3 (>= 3.10) with venv, and cargo.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

for tool in python3 cargo; do
    command -v "$tool" >/dev/null || {
        echo "error: $tool is required (Rust via rustup, Python >= 3.10 with venv)" >&2
        exit 1
    }
done

CACHE="${FSDP_RS_CACHE:-$HOME/.cache/fsdp-rs}"
export PIP_CACHE_DIR="${PIP_CACHE_DIR:-$CACHE/pip}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# torch.compile's caches (inductor's compiled graphs, AOT autograd's) beside the
# virtualenvs rather than in /tmp, so that a later run on this machine reuses
# them (tests/test_compile.py: 67 s warm against 114 s cold on 2 cores). Keys
# include the torch build and each graph, so the three legs share the folder.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$CACHE/torchinductor}"
REQ_HASH="$(cat requirements-dev.txt | sha256sum | cut -c1-12)"
VENV="${FSDP_RS_VENV:-$CACHE/venv-$REQ_HASH}"

if [ ! -f "$VENV/.complete" ]; then
    echo "==> creating $VENV (pinned dev/test set; torch is large, cached afterwards)"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/pip" install -q -r requirements-dev.txt
    touch "$VENV/.complete"
fi
export VIRTUAL_ENV="$VENV"
export PATH="$VENV/bin:$PATH"

echo "==> building fsdp-rs (release) into $VENV"
maturin develop --release --quiet 2>&1 | grep -v "^$" | tail -n 3
