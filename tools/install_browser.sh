#!/bin/sh
# Debian's chromium and chromium-driver, for the page's browser tests (tests/test_page_browser.py).
# `make test` runs this first; the tests run it too when the browser is missing. Prints why and
# exits 1 when it cannot install (not root, no apt-get, no package source): the tests then skip.
set -e
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "install_browser: installing chromium and chromium-driver needs root (apt-get)" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_browser: no apt-get on this machine to install chromium and chromium-driver" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >&2
apt-get install -y -q --no-install-recommends chromium chromium-driver >&2
test -x /usr/bin/chromium && test -x /usr/bin/chromedriver
