#!/bin/sh
# Installs what the tests need: cgc with its test extras (pytest, hypothesis, torch as an
# oracle, CUDA's compiler wheels) and, from Debian's packages, Chromium for the test that
# looks at `cgc doc`'s pages in a real headless browser. Install the CPU build of torch
# 2.13.0 first (README.md says how): otherwise pip takes PyPI's default CUDA build, several GB.
set -eu
cd "$(dirname "$0")/.."
python3 -m pip install '.[test]'
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    run=""
  elif command -v sudo >/dev/null 2>&1; then
    run="sudo"
  else
    echo "setup-tests: Chromium is missing; install Debian's chromium package as root" >&2
    exit 1
  fi
  $run apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $run apt-get install -y -qq chromium >/dev/null
fi
