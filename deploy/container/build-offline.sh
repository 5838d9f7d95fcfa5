#!/usr/bin/env bash
# Builds the images of deploy/container/Containerfile without pulling
# anything, for machines that cannot reach a registry: the runtime base is
# assembled from this Debian host's own files in distroless/cc's layout
# (glibc and the libraries the binary links, CA certificates, a `nonroot`
# user 65532, /tmp) and each image is written into an OCI image layout with
# umoci, tagged `agent` and `collector`.
#
#   deploy/container/build-offline.sh BIN_DIR OUT_LAYOUT [VERSION]
#
# BIN_DIR holds headroom-agent and headroom-collector (target/release);
# they are copied without their debug info. Needs root (file ownership),
# umoci, and objcopy. Push with skopeo:
#   skopeo copy oci:OUT_LAYOUT:collector docker://REGISTRY/headroom-collector:VERSION
set -euo pipefail
bin_dir=${1:?usage: build-offline.sh BIN_DIR OUT_LAYOUT [VERSION]}
out=${2:?usage: build-offline.sh BIN_DIR OUT_LAYOUT [VERSION]}
repo=$(cd "$(dirname "$0")/../.." && pwd)
version=${3:-$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/Cargo.toml" | head -n1)}
source_url=$(sed -n 's/^repository = "\(.*\)"$/\1/p' "$repo/Cargo.toml" | head -n1)
licence=$(sed -n 's/^license = "\(.*\)"$/\1/p' "$repo/Cargo.toml" | head -n1)
for tool in umoci objcopy ldd; do
  command -v "$tool" >/dev/null || { echo "build-offline.sh: $tool not found" >&2; exit 1; }
done
for binary in headroom-agent headroom-collector; do
  [ -x "$bin_dir/$binary" ] || { echo "build-offline.sh: no $bin_dir/$binary (cargo build --release)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "build-offline.sh: run as root (the image's files belong to root and 65532)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -d "$out" ] || umoci init --layout "$out"

# The files of the base every image shares.
base_files() {
  local root=$1 binary=$2
  mkdir -p "$root/etc/ssl/certs" "$root/tmp" "$root/usr/local/bin" "$root/usr/lib/x86_64-linux-gnu"
  chmod 1777 "$root/tmp"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' >"$root/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$root/etc/group"
  mkdir -p "$root/home/nonroot" && chown 65532:65532 "$root/home/nonroot"
  printf 'hosts: files dns\n' >"$root/etc/nsswitch.conf"
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
  # The dynamic loader and every library the binary links, from this host's
  # Debian packages, at the paths they have there.
  ldd "$binary" | awk '/=> \// {print $3} /^\t\// {print $1}' | while read -r lib; do
    cp --parents -L "$lib" "$root/"
  done
  # Where the NVIDIA runtime's ldconfig hook finds the mounted libraries.
  printf '/usr/lib/x86_64-linux-gnu\n' >"$root/etc/ld.so.conf"
}

build() {
  local name=$1 title=$2 description=$3
  local bundle=$work/$name
  umoci new --image "$out:$name"
  umoci unpack --image "$out:$name" "$bundle" >/dev/null
  local root=$bundle/rootfs
  mkdir -p "$root/usr/local/bin"
  objcopy --strip-debug "$bin_dir/$title" "$root/usr/local/bin/$title"
  base_files "$root" "$root/usr/local/bin/$title"
  if [ "$name" = collector ]; then
    mkdir -p "$root/var/lib/headroom" && chown 65532:65532 "$root/var/lib/headroom"
  fi
  umoci repack --image "$out:$name" "$bundle"
  local config=(--image "$out:$name"
    --os linux --architecture amd64 --author "Headroom"
    --config.user 65532:65532
    --config.entrypoint "/usr/local/bin/$title"
    --config.label "org.opencontainers.image.title=$title"
    --config.label "org.opencontainers.image.description=$description"
    --config.label "org.opencontainers.image.version=$version"
    --config.label "org.opencontainers.image.source=$source_url"
    --config.label "org.opencontainers.image.licenses=$licence"
    --manifest.annotation "org.opencontainers.image.version=$version")
  if [ "$name" = collector ]; then
    config+=(--config.cmd serve --config.workingdir /var/lib/headroom
      --config.exposedports 50051/tcp --config.exposedports 8080/tcp)
  fi
  umoci config "${config[@]}"
  umoci gc --layout "$out"
}

build agent headroom-agent "Headroom's per-node GPU memory agent"
build collector headroom-collector "Headroom's collector: storage, rules, alerts and dashboard"
echo "build-offline.sh: $out:agent and $out:collector, version $version"
