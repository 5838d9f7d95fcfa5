#!/usr/bin/env bash
# Re-fetches the vendored uPlot (the dashboard's charting library) from the
# npm registry and checks it against the digests recorded here. The files
# are committed so that building the collector needs no network and no npm;
# this script is for upgrading them (change VERSION, run, update the digests).
set -euo pipefail
VERSION=1.6.32
here="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "uplot@$VERSION" >/dev/null && tar xzf "uplot-$VERSION.tgz")
cp "$work/package/dist/uPlot.iife.min.js" "$work/package/dist/uPlot.min.css" "$here/"
cp "$work/package/LICENSE" "$here/uPlot.LICENSE"
cd "$here"
sha256sum -c <<SUMS
19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f  uPlot.iife.min.js
df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04  uPlot.min.css
SUMS
echo "uPlot $VERSION vendored in $here"
