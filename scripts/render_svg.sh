#!/usr/bin/env bash
# Render ditmem's SVG plots (plan --plot, estimate/compare --plot) to PNG with headless
# Chromium, to look at them as a person would. Installs Debian's `chromium` when it is missing.
#
#   scripts/render_svg.sh plot.svg [out.png] [WIDTHxHEIGHT]
set -euo pipefail
svg=${1:?usage: scripts/render_svg.sh plot.svg [out.png] [WIDTHxHEIGHT]}
png=${2:-${svg%.svg}.png}
size=${3:-1200x800}
if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" -eq 0 ]; then
        apt-get update -qq && apt-get install -y -qq chromium >/dev/null
    else
        sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null
    fi
fi
[ -f "$svg" ] || { echo "render_svg: no such file: $svg" >&2; exit 2; }
abs=$(cd "$(dirname "$svg")" && pwd)/$(basename "$svg")
out=$(cd "$(dirname "$png")" && pwd)/$(basename "$png")
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size="${size/x/,}" --screenshot="$out" "file://$abs" >/dev/null 2>&1
echo "$out"
