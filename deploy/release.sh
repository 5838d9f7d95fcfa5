#!/usr/bin/env bash
# Cuts a release: sets the workspace version, turns CHANGELOG.md's
# Unreleased section into the release's (dated today) and opens a new one,
# builds the two .deb packages and the two container images into
# dist/VERSION/, then commits and tags vVERSION.
#
#   deploy/release.sh VERSION [--no-build] [--no-commit]
#
# --no-build skips packages and images (version and changelog only);
# --no-commit leaves the changes uncommitted and untagged. Images come from
# deploy/container/Containerfile with podman where it can pull the base
# images, else from build-offline.sh (an OCI layout in dist/VERSION/oci).
# Push them with skopeo, e.g.
#   skopeo copy oci:dist/0.2.0/oci:collector docker://REGISTRY/headroom-collector:0.2.0
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: deploy/release.sh VERSION [--no-build] [--no-commit]" >&2; exit 2; }
fail() { echo "release: $*" >&2; exit 1; }
version=${1:-}
[ -n "$version" ] || usage
shift
build=1 commit=1
for arg in "$@"; do
  case "$arg" in
    --no-build) build=0 ;;
    --no-commit) commit=0 ;;
    *) usage ;;
  esac
done
[[ "$version" =~ ^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?$ ]] ||
  fail "\"$version\" is not a semantic version (MAJOR.MINOR.PATCH)"
current=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"$/\1/p' Cargo.toml)
[ -n "$current" ] || fail "no version in Cargo.toml's [workspace.package]"
[ "$version" != "$current" ] || fail "the workspace is already at $version"
if [ "$commit" = 1 ] && [ -n "$(git status --porcelain)" ]; then
  fail "the working tree has uncommitted changes"
fi
grep -q '^## \[Unreleased\]$' CHANGELOG.md || fail "CHANGELOG.md has no \"## [Unreleased]\" section"
notes=$(awk '/^## \[Unreleased\]$/ {on=1; next} /^## \[/ {on=0} on && /^- / {n++} END {print n+0}' CHANGELOG.md)
[ "$notes" -gt 0 ] || fail "CHANGELOG.md's Unreleased section lists nothing"

# Version: the workspace's, then the lock file's entries for its members.
sed -i "/^\[workspace.package\]/,/^\[/s/^version = \".*\"$/version = \"$version\"/" Cargo.toml
cargo update --workspace --offline --quiet

# Changelog: Unreleased becomes the release, a new empty Unreleased above it.
today=$(date -u +%Y-%m-%d)
repo_url=$(sed -n 's/^repository = "\(.*\)"$/\1/p' Cargo.toml | head -n1)
awk -v v="$version" -v d="$today" -v prev="$current" -v url="$repo_url" '
  /^## \[Unreleased\]$/ { print; print ""; print "## [" v "] - " d; next }
  /^\[Unreleased\]: / { print "[Unreleased]: " url "/compare/v" v "...HEAD";
                        print "[" v "]: " url "/compare/v" prev "...v" v; next }
  { print }
' CHANGELOG.md >CHANGELOG.md.new
mv CHANGELOG.md.new CHANGELOG.md

if [ "$build" = 1 ]; then
  dist=dist/$version
  rm -rf "$dist" && mkdir -p "$dist"
  command -v cargo-deb >/dev/null || cargo install --locked --quiet cargo-deb
  # The packaged collector leaves the demo's simulator out (as deb-check.sh
  # checks); the image keeps it, so that `demo` runs in a container.
  cargo build --release --locked -p headroom-agent
  cargo build --release --locked -p headroom-collector --no-default-features
  cargo deb --no-build -p headroom-agent --output "$dist/"
  cargo deb --no-build -p headroom-collector --output "$dist/"
  cargo build --release --locked -p headroom-collector
  if command -v podman >/dev/null &&
     podman build -f deploy/container/Containerfile --target agent --build-arg "VERSION=$version" \
       -t "headroom-agent:$version" . &&
     podman build -f deploy/container/Containerfile --target collector --build-arg "VERSION=$version" \
       -t "headroom-collector:$version" .; then
    podman save --format oci-archive -o "$dist/headroom-agent-$version.oci.tar" "headroom-agent:$version"
    podman save --format oci-archive -o "$dist/headroom-collector-$version.oci.tar" "headroom-collector:$version"
  else
    echo "release: no podman build (no podman, or no base images): building the images offline"
    deploy/container/build-offline.sh target/release "$dist/oci" "$version"
  fi
  (cd "$dist" && find . -maxdepth 1 -type f ! -name SHA256SUMS -printf '%P\n' | sort | xargs -r sha256sum >SHA256SUMS)
fi

if [ "$commit" = 1 ]; then
  git add Cargo.toml Cargo.lock CHANGELOG.md
  git commit -q -m "release $version"
  git tag -a "v$version" -m "Headroom $version"
  echo "release: committed and tagged v$version; push with: git push --follow-tags"
else
  echo "release: $version prepared, not committed"
fi
