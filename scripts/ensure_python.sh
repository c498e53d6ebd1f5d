#!/usr/bin/env bash
# Print the path of a working CPython 3.13 for the second test lane (.venv-jax011/).
# Order: $JAXLLM_PYTHON313, then the cached build, then a working `python3.13` on PATH; when none
# works, build CPython from Debian's source package (the upstream tarball, checked by apt against
# the signed archive) into the user cache dir, keyed by version, and reuse it on later runs.
# Progress goes to stderr; only the interpreter's path goes to stdout.
set -euo pipefail

version=3.13.5
series="${version%.*}"
cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/jaxllm"
prefix="$cache_root/cpython-$version"

log() { echo "ensure_python: $*" >&2; }

# A usable interpreter is the right series and has what pip and the venv need.
works() {
    "$1" -c "import sys, ssl, venv, zlib, ctypes, sqlite3, lzma, bz2
assert sys.version_info[:2] == (${series/./, }), sys.version" >/dev/null 2>&1
}

if [ -n "${JAXLLM_PYTHON313:-}" ]; then
    if works "$JAXLLM_PYTHON313"; then
        echo "$JAXLLM_PYTHON313"
        exit 0
    fi
    log "error: JAXLLM_PYTHON313=$JAXLLM_PYTHON313 is not a working CPython $series" \
        "(needs ssl, zlib, ctypes, sqlite3, lzma, bz2 and venv)"
    exit 1
fi
if [ -f "$prefix/.complete" ] && works "$prefix/bin/python$series"; then
    echo "$prefix/bin/python$series"
    exit 0
fi
if command -v "python$series" >/dev/null && works "python$series"; then
    command -v "python$series"
    exit 0
fi

# Build from source. Every missing tool and header package is named at once.
missing=()
for tool in apt-get gcc make tar xz pkg-config; do
    command -v "$tool" >/dev/null || missing+=("$tool")
done
for pkg in libssl-dev zlib1g-dev libffi-dev libbz2-dev liblzma-dev libsqlite3-dev \
           libreadline-dev libncurses-dev uuid-dev; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "error: no working CPython $series found, and building $version needs: ${missing[*]}"
    log "install them (Debian/Ubuntu): apt-get install build-essential pkg-config" \
        "xz-utils libssl-dev zlib1g-dev libffi-dev libbz2-dev liblzma-dev libsqlite3-dev" \
        "libreadline-dev libncurses-dev uuid-dev"
    log "or point JAXLLM_PYTHON313 at an existing CPython $series"
    exit 1
fi

log "building CPython $version into $prefix (once; several minutes)"
start=$SECONDS
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# A private apt state: the system's sources and lists stay untouched, and no root is needed.
apt_dir="$cache_root/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial"
echo "deb-src http://deb.debian.org/debian trixie main" > "$apt_dir/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
          -o "Debug::NoLocking=true" -o "APT::Sandbox::User=$(id -un)")
apt-get "${apt_opts[@]}" -qq update >&2
(cd "$work" && apt-get "${apt_opts[@]}" -qq source --download-only "python$series" >&2)
tarball="$work/python${series}_$version.orig.tar.xz"
if [ ! -f "$tarball" ]; then
    log "error: Debian's python$series source is not version $version:" \
        "$(cd "$work" && ls -- *.orig.tar.* 2>/dev/null || echo 'no tarball downloaded')"
    exit 1
fi
tar -xf "$tarball" -C "$work"
rm -rf "$prefix"
(
    cd "$work/Python-$version"
    # No --enable-optimizations: PGO triples the build time for a test-only interpreter.
    ./configure --prefix="$prefix" --with-ensurepip=install >"$work/configure.log" 2>&1 \
        || { tail -30 "$work/configure.log" >&2; exit 1; }
    make -j"$(nproc)" >"$work/make.log" 2>&1 || { tail -30 "$work/make.log" >&2; exit 1; }
    make install >"$work/install.log" 2>&1 || { tail -30 "$work/install.log" >&2; exit 1; }
)
if ! works "$prefix/bin/python$series"; then
    log "error: the built CPython $version lacks a module (ssl, zlib, ctypes, sqlite3, lzma," \
        "bz2 or venv): check the -dev packages above"
    exit 1
fi
touch "$prefix/.complete"
log "built CPython $version in $((SECONDS - start)) s"
echo "$prefix/bin/python$series"
