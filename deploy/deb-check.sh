#!/usr/bin/env bash
# Builds the agent and collector .deb packages with cargo-deb and checks them
# with dpkg on this machine: install, a configuration edit that survives an
# upgrade, remove (configuration kept) and purge (configuration gone). Needs
# root and dpkg; CI (.ci/run) runs it. It leaves no package installed.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo-deb >/dev/null; then
  cargo install --locked --quiet cargo-deb
fi
packages=(headroom-agent headroom-collector)
dpkg -P "${packages[@]}" >/dev/null 2>&1 || true

# The collector without its `demo` feature: the production binary links no
# NVML and no simulator, and `headroom-collector demo` says so.
cargo build --release --locked --quiet -p headroom-agent
cargo build --release --locked --quiet -p headroom-collector --no-default-features
out=target/debian
rm -rf "$out"
for p in "${packages[@]}"; do
  cargo deb --no-build --quiet -p "$p" --output "$out/first/"
  cargo deb --no-build --quiet -p "$p" --deb-revision 2 --output "$out/second/"
done
version() { dpkg-query -W -f '${Version}' "$1"; }
fail() { echo "deb-check: $*" >&2; exit 1; }

echo "deb-check: install"
dpkg -i "$out"/first/*.deb >/dev/null
for p in "${packages[@]}"; do
  [ -x "/usr/bin/$p" ] || fail "/usr/bin/$p missing after install"
  "/usr/bin/$p" --version >/dev/null || fail "$p --version failed"
  unit=$(dpkg -L "$p" | grep -E "/systemd/system/$p\.service$") || fail "$p ships no unit"
  grep -q '^Type=notify' "$unit" || fail "$unit is not Type=notify"
  [ "$(version "$p")" = "0.1.0-1" ] || fail "$p version $(version "$p")"
  [ -f "/usr/share/doc/$p/docs/architecture.md" ] || fail "$p ships no docs/ beside its README"
done
[ -f /etc/headroom/agent.toml ] && [ -f /etc/headroom/collector.toml ] || fail "configuration missing"
if demo_out=$(/usr/bin/headroom-collector demo 2>&1); then
  fail "the packaged collector runs the demo: it was built with the simulated fleet"
fi
grep -q "without the simulated fleet" <<<"$demo_out" || fail "headroom-collector demo: $demo_out"
for p in "${packages[@]}"; do
  [ -L "/etc/systemd/system/multi-user.target.wants/$p.service" ] || fail "$p.service not enabled on install"
done

echo "deb-check: upgrade keeps a local configuration edit"
echo '# local edit' >> /etc/headroom/agent.toml
DEBIAN_FRONTEND=noninteractive dpkg -i --force-confold "$out"/second/*.deb >/dev/null
for p in "${packages[@]}"; do
  [ "$(version "$p")" = "0.1.0-2" ] || fail "$p not upgraded: $(version "$p")"
done
grep -q '^# local edit' /etc/headroom/agent.toml || fail "the upgrade lost a configuration edit"

echo "deb-check: remove keeps configuration, purge removes it"
dpkg -r "${packages[@]}" >/dev/null
[ ! -e /usr/bin/headroom-agent ] || fail "binary left after remove"
[ -f /etc/headroom/agent.toml ] || fail "remove deleted the configuration"
dpkg -P "${packages[@]}" >/dev/null
[ ! -e /etc/headroom/agent.toml ] && [ ! -e /etc/headroom/collector.toml ] || fail "purge left configuration"
for p in "${packages[@]}"; do
  [ ! -e "/etc/systemd/system/multi-user.target.wants/$p.service" ] || fail "purge left $p.service enabled"
done
echo "deb-check: ok (install, upgrade, remove, purge)"
