#!/usr/bin/env bash
# Debian packages the Triton side needs: libb64 (perf_analyzer), and Debian's python of the venv's version,
# whose libpython the Python-backend stub embeds (python3.X, its venv module and libpython3.X).
set -euo pipefail
py="${1:-python3}"
ver=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
need=()
for pkg in libb64-0d "python${ver}" "python${ver}-venv" "libpython${ver}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "system_deps: missing ${need[*]}; run: sudo apt-get install -y ${need[*]}" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
