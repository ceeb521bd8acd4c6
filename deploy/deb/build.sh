#!/bin/sh
# Builds flotilla's Debian packages with dpkg-deb (no debian/ source tree, no extra tool):
#
#   deploy/deb/build.sh [--arch amd64|arm64|armhf] [--out DIR] [--no-build]
#                       [--only flotilla-agent|flotilla] [--deb-version VERSION]
#
#   amd64, arm64: flotilla-agent_VERSION_ARCH.deb and flotilla_VERSION_ARCH.deb
#   armhf:        flotilla-agent_VERSION_armhf.deb (the coordinator is not built for 32-bit ARM)
#
# --arch defaults to the host's (dpkg --print-architecture); --out to target/deb. The binaries
# are `cargo build --release --target TRIPLE` ones, in target/TRIPLE/release (the release
# profile strips them); another --arch than the host's is cross-compiled with the linkers of
# .cargo/config.toml (Debian's gcc-aarch64-linux-gnu, gcc-arm-linux-gnueabihf; `rustup target
# add` the Rust targets), as .ci/run builds them.
# --no-build packages what is already built. --only builds one of the packages. --deb-version
# replaces the Debian version (default: the workspace's version, "-1"): deploy/deb/ci-check.sh
# packages the same agent binary again as a newer version, for the agent to upgrade itself to.
# CARGO_TARGET_DIR is honoured.
#
# Package metadata lives beside this script: the maintainer scripts in flotilla-agent/ and
# flotilla/ (and the agent's self-upgrade script, flotilla-agent/agent-deb.sh), copyright,
# lintian overrides; the units beside their crates
# (agent/flotilla-agent.service, coordinator/flotilla.service); the conffiles are the default
# configs the binaries print (agent/default-config.toml as is, coordinator/default-config.toml
# with its paths in /var/lib/flotilla). docs/decisions/0049-debian-packages.md says why.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
arch=$(dpkg --print-architecture)
out=
build=1
only=
deb_version=
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch=${2:?--arch needs amd64, arm64 or armhf}; shift 2 ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --no-build) build=0; shift ;;
    --only) only=${2:?--only needs flotilla-agent or flotilla}; shift 2 ;;
    --deb-version) deb_version=${2:?--deb-version needs a version}; shift 2 ;;
    *)
      echo "usage: $0 [--arch amd64|arm64|armhf] [--out DIR] [--no-build]" \
        "[--only flotilla-agent|flotilla] [--deb-version VERSION]" >&2
      exit 2
      ;;
  esac
done

# The strip of the cross binutils that come with the cross gcc (the host's strip reads only
# the host's architecture).
case "$arch" in
  amd64) triple=x86_64-unknown-linux-gnu; packages="flotilla-agent flotilla"; tools=x86_64-linux-gnu- ;;
  arm64) triple=aarch64-unknown-linux-gnu; packages="flotilla-agent flotilla"; tools=aarch64-linux-gnu- ;;
  armhf) triple=armv7-unknown-linux-gnueabihf; packages="flotilla-agent"; tools=arm-linux-gnueabihf- ;;
  *) echo "$0: unknown --arch $arch (amd64, arm64 or armhf)" >&2; exit 2 ;;
esac
if [ -n "$only" ]; then
  case " $packages " in
    *" $only "*) packages=$only ;;
    *) echo "$0: no package $only for $arch (these: $packages)" >&2; exit 2 ;;
  esac
fi

cd "$repo"
target_dir=${CARGO_TARGET_DIR:-target}
case "$target_dir" in /*) ;; *) target_dir="$repo/$target_dir" ;; esac
out=${out:-$target_dir/deb}
mkdir -p "$out"
out=$(cd "$out" && pwd)

version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
deb_version=${deb_version:-$version-1}
maintainer=${DEB_MAINTAINER:-"flotilla maintainers <flotilla@lists.flotilla.dev>"}
# Reproducible: file times and the changelog date come from the last commit. Not exported to
# cargo: the cc crate's build scripts (ring, psm) rebuild when SOURCE_DATE_EPOCH changes, and
# .ci/run's cross builds of the agent, made without it, would be built again here.
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}

# Every architecture, the host's included, builds with an explicit --target, into
# target/TRIPLE/release, so one `cargo build --release --target A --target B` can build the
# coordinator for several architectures at once, their single-threaded link-time optimisations
# side by side, and this script finds them built (.ci/run does that before the deb check).
host_triple=$(rustc -vV | sed -n 's/^host: //p')
bin_dir="$target_dir/$triple/release"
if [ "$triple" = "$host_triple" ]; then
  command -v "${tools}strip" >/dev/null || tools=
fi
if [ "$build" = 1 ]; then
  for p in $packages; do
    case "$p" in
      flotilla-agent) set -- -p flotilla-agent --bin flotilla-agent ;;
      flotilla) set -- -p flotilla-coordinator --bin flotilla ;;
    esac
    cargo build --release --target "$triple" "$@"
  done
fi

# Depends for a binary: libc6 at the newest GLIBC_ symbol version it uses (readelf reads every
# architecture), libgcc-s1 when it links libgcc_s.
shlib_depends() {
  glibc=$(readelf -V --wide "$1" | grep -o 'GLIBC_[0-9][0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -n 1)
  deps="libc6 (>= $glibc)"
  if readelf -d "$1" | grep -q 'NEEDED.*libgcc_s'; then
    deps="$deps, libgcc-s1 (>= 4.2)"
  fi
  echo "$deps"
}

changelog() { # package directory
  doc="$2/usr/share/doc/$1"
  mkdir -p "$doc"
  {
    echo "flotilla ($deb_version) unstable; urgency=medium"
    echo
    echo "  * flotilla $version, packaged by deploy/deb/build.sh."
    echo
    echo " -- $maintainer  $(date -u -R -d "@$epoch")"
  } | gzip -9n > "$doc/changelog.Debian.gz"
  cp "$here/copyright" "$doc/copyright"
  mkdir -p "$2/usr/share/lintian/overrides"
  cp "$here/$1/lintian-overrides" "$2/usr/share/lintian/overrides/$1"
}

# As dh_strip does: symbols and the .comment and .note sections out (the release profile's
# strip leaves .comment, and not every link honours it).
strip_binary() {
  "${tools}strip" --remove-section=.comment --remove-section=.note "$1"
}

finish() { # package directory description-file depends
  pkg=$1
  root=$2
  for script in postinst prerm postrm; do
    install -m 0755 "$here/$pkg/$script" "$root/DEBIAN/$script"
  done
  find "$root/etc" -type f | sed "s#^$root##" | sort > "$root/DEBIAN/conffiles"
  (cd "$root" && find . -path ./DEBIAN -prune -o -type f -print | sed 's#^\./##' | sort |
    xargs md5sum) > "$root/DEBIAN/md5sums"
  size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
  {
    echo "Package: $pkg"
    echo "Source: flotilla"
    echo "Version: $deb_version"
    echo "Architecture: $arch"
    echo "Maintainer: $maintainer"
    echo "Installed-Size: $size"
    echo "Depends: $4"
    echo "Section: admin"
    echo "Priority: optional"
    cat "$3"
  } > "$root/DEBIAN/control"
  find "$root" -exec touch -h -d "@$epoch" {} +
  deb="$out/${pkg}_${deb_version}_$arch.deb"
  SOURCE_DATE_EPOCH=$epoch dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
  echo "$deb"
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
umask 022

for pkg in $packages; do
  root="$work/$pkg"
  mkdir -p "$root/DEBIAN" "$root/usr/bin" "$root/etc/flotilla" "$root/lib/systemd/system"
  case "$pkg" in
    flotilla-agent)
      install -m 0755 "$bin_dir/flotilla-agent" "$root/usr/bin/flotilla-agent"
      strip_binary "$root/usr/bin/flotilla-agent"
      # What `flotilla-agent print-default-config` prints (include_str! of this file), so no
      # ARM binary has to run on the build host. 0600: it may carry an enrollment token.
      install -m 0600 agent/default-config.toml "$root/etc/flotilla/agent.toml"
      install -m 0644 agent/flotilla-agent.service "$root/lib/systemd/system/"
      install -d -m 0700 "$root/var/lib/flotilla-agent"
      # The script target for the agent's own upgrade (docs/operations.md).
      install -D -m 0755 "$here/flotilla-agent/agent-deb.sh" "$root/usr/lib/flotilla/agent-deb.sh"
      ;;
    flotilla)
      install -m 0755 "$bin_dir/flotilla" "$root/usr/bin/flotilla"
      strip_binary "$root/usr/bin/flotilla"
      # `flotilla serve --print-default-config` with the data and the key where the unit
      # keeps them (the default's relative paths would point into /etc/flotilla).
      sed -e 's#^data_dir = "data"$#data_dir = "/var/lib/flotilla"#' \
        -e 's#^coordinator_key = "keys/coordinator.key"$#coordinator_key = "/var/lib/flotilla/keys/coordinator.key"#' \
        coordinator/default-config.toml > "$root/etc/flotilla/coordinator.toml"
      grep -q '^data_dir = "/var/lib/flotilla"$' "$root/etc/flotilla/coordinator.toml"
      grep -q '^coordinator_key = "/var/lib/flotilla/keys/' "$root/etc/flotilla/coordinator.toml"
      chmod 0644 "$root/etc/flotilla/coordinator.toml"
      install -m 0644 coordinator/flotilla.service "$root/lib/systemd/system/"
      # Shell completions and the man page, which `flotilla completions` and `flotilla man`
      # make from the command line's definition. They are the same on every architecture, so
      # the host's build makes them: no ARM binary has to run here.
      host_flotilla="$target_dir/$host_triple/release/flotilla"
      if [ "$triple" != "$host_triple" ] && [ "$build" = 1 ]; then
        cargo build --release --target "$host_triple" -p flotilla-coordinator --bin flotilla
      fi
      [ -x "$host_flotilla" ] || {
        echo "$0: $host_flotilla is missing: the completions and the man page are made with the host's build" >&2
        exit 1
      }
      install -d "$root/usr/share/bash-completion/completions" "$root/usr/share/zsh/vendor-completions" \
        "$root/usr/share/fish/vendor_completions.d" "$root/usr/share/man/man1"
      "$host_flotilla" completions bash > "$root/usr/share/bash-completion/completions/flotilla"
      "$host_flotilla" completions zsh > "$root/usr/share/zsh/vendor-completions/_flotilla"
      "$host_flotilla" completions fish > "$root/usr/share/fish/vendor_completions.d/flotilla.fish"
      "$host_flotilla" man | gzip -9n > "$root/usr/share/man/man1/flotilla.1.gz"
      chmod 0644 "$root/usr/share/bash-completion/completions/flotilla" \
        "$root/usr/share/zsh/vendor-completions/_flotilla" \
        "$root/usr/share/fish/vendor_completions.d/flotilla.fish" "$root/usr/share/man/man1/flotilla.1.gz"
      ;;
  esac
  changelog "$pkg" "$root"
  finish "$pkg" "$root" "$here/$pkg/description" "$(shlib_depends "$root/usr/bin/"*)$(
    [ "$pkg" = flotilla ] && echo ", adduser")"
done
