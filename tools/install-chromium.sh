#!/usr/bin/env bash
# Debian's headless-capable Chromium, for the test that opens `astraflow report`'s page in a
# real browser (tests/browser.py); `.ci/run` calls it. Idempotent: does nothing when
# `chromium` is on the PATH. Needs root (apt).
set -euo pipefail
command -v chromium >/dev/null && exit 0
[[ $(id -u) == 0 ]] || { echo "install-chromium: chromium is missing and this is not root: apt-get install chromium" >&2; exit 1; }
echo "install-chromium: installing chromium (apt)"
install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; }
install || { apt-get update -q >/dev/null && install; }  # a fresh image has no package lists yet
