#!/usr/bin/env bash
# Installs what the browser tests (crates/cli/tests/browser.rs, run by `cargo test --release
# --workspace`) need: Debian's headless-capable `chromium`, when no Chromium is on PATH.
# The tests FAIL (they never skip) without it, naming this script.
set -euo pipefail
for name in chromium chromium-browser google-chrome google-chrome-stable; do
    if command -v "$name" >/dev/null 2>&1; then
        echo "browser tests: $(command -v "$name") ($("$name" --version 2>/dev/null || echo 'version unknown'))"
        exit 0
    fi
done
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
$sudo apt-get update
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium
echo "browser tests: $(command -v chromium) ($(chromium --version 2>/dev/null || true))"
