#!/usr/bin/env bash
# The pinned dependencies of one checkout, reused by the next fresh clone on this machine.
#
#   venv_cache.sh restore   before scripts/install.sh: when .venv is missing and this machine
#                           keeps a venv installed from the same requirement files, install recipe
#                           and interpreter, copy it (hard links) and point its scripts here;
#                           scripts/install.sh then only confirms the pins (pip finds each one in
#                           place), installs this checkout in editable mode and writes its stamp.
#   venv_cache.sh save      after scripts/install.sh: keep this .venv for the next clone, once per key.
#
# A fresh clone's `make install` took 6.5 min on a 2-core host; from the cache, about a minute.
# HACK_VENV_CACHE names the cache's folder ("" turns it off: the container image does, since a hard
# link to a lower layer's file copies the file into the upper one). The two newest keys are kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV=.venv
ROOT=${HACK_VENV_CACHE-$HOME/.cache/sglang-hack/venvs}
[ -n "$ROOT" ] || exit 0
command -v "$PY" >/dev/null 2>&1 || exit 0
key=$( (cat requirements/*.txt scripts/install.sh; "$PY" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
CACHED=$ROOT/$key
HERE=$(pwd -P)/$VENV

case "${1:-}" in
restore)
    [ ! -e "$VENV" ] && [ -f "$CACHED/origin" ] || exit 0
    echo "install: the pinned dependencies from $CACHED"
    cp -al "$CACHED/venv" "$VENV" 2>/dev/null || { rm -rf "$VENV"; cp -a "$CACHED/venv" "$VENV"; }
    # The stamp says "this checkout is installed": not yet true here (scripts/install.sh writes it).
    rm -f "$VENV/.hack-install-stamp"
    from=$(cat "$CACHED/origin")
    # Scripts, activate files and pyvenv.cfg name the venv's path. sed -i writes new files, so the
    # cached copy (and the checkout it came from) keep theirs.
    { grep -rlsI --fixed-strings "$from" "$VENV/bin" "$VENV/pyvenv.cfg" || true; } | while read -r f; do
        sed -i "s|$from|$HERE|g" "$f"
    done
    ;;
save)
    [ -f "$VENV/.hack-install-stamp" ] && [ ! -e "$CACHED" ] || exit 0
    mkdir -p "$ROOT"
    tmp=$(mktemp -d "$ROOT/.partial.XXXXXX")
    # Written aside and renamed: a half-written copy is never restored.
    if cp -al "$VENV" "$tmp/venv" 2>/dev/null || cp -a "$VENV" "$tmp/venv"; then
        echo "$HERE" > "$tmp/origin"
        mv -T "$tmp" "$CACHED" 2>/dev/null || rm -rf "$tmp"
        ls -1dt "$ROOT"/*/ | tail -n +3 | xargs -r rm -rf
    else
        rm -rf "$tmp"
    fi
    ;;
*)
    echo "usage: scripts/venv_cache.sh restore|save" >&2
    exit 2
    ;;
esac
