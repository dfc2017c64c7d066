#!/usr/bin/env bash
# System packages the end-to-end tests start for real: a PostgreSQL server (instance storage) and Chromium
# (the browser test). Installed from Debian's packages when missing; needs root (or sudo) the first time.
set -euo pipefail
need=()
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
((${#need[@]})) || exit 0
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then SUDO=sudo; else
    echo "test-deps: please install ${need[*]} (Debian packages); their tests are skipped until then" >&2
    exit 0
  fi
fi
echo "test-deps: installing ${need[*]} from Debian's packages"
${SUDO:-} apt-get update -qq
DEBIAN_FRONTEND=noninteractive ${SUDO:-} apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
# The cluster the package creates is not used (tests start their own on a free port): keep it stopped.
${SUDO:-} service postgresql stop >/dev/null 2>&1 || true
