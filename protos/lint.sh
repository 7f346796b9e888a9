#!/usr/bin/env bash
# Lint the protos with buf's STANDARD rules (protos/buf.yaml); exits non-zero on
# any finding. On first use installs buf with npm into a cache outside the repo
# (override with TANDEM_BUF_CACHE); buf's version is pinned so the rules CI
# applies do not change under us.
set -euo pipefail

buf_version="1.75.0"
cache_dir="${TANDEM_BUF_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem-buf/$buf_version}"
buf="$cache_dir/node_modules/.bin/buf"

if [[ ! -x "$buf" ]]; then
  echo "Installing @bufbuild/buf@$buf_version into $cache_dir ..." >&2
  npm install --prefix "$cache_dir" --no-audit --no-fund --loglevel=error "@bufbuild/buf@$buf_version" >&2
fi

cd "$(dirname "${BASH_SOURCE[0]}")"
exec "$buf" lint "$@"
