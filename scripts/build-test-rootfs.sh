#!/usr/bin/env bash
# Build (or reuse) the Debian bookworm rootfs that tests boot with systemd-nspawn to get a real systemd
# (no systemd runs as PID 1 on the build machines). Usage: build-test-rootfs.sh [DIR]
#
# - Installs the host tools it needs if missing (debootstrap, systemd-container). systemd-container is
#   installed with --no-install-recommends because its recommends (libnss-mymachines) edit nsswitch.conf.
# - Uses the Debian mirror apt already uses on this host (or $DEBIAN_MIRROR), so no host name lives here.
# - Cached: a stamp file records suite, variant and package list; a changed list rebuilds. The build runs in
#   DIR.tmp and is renamed into place, so an interrupted build never leaves a half rootfs behind.
set -euo pipefail

DIR="${1:-/var/cache/dsv4-agent-test/rootfs-bookworm}"
SUITE=bookworm
VARIANT=minbase
PACKAGES="systemd,systemd-sysv,dbus,python3"
STAMP_NAME=.dsv4-agent-rootfs-stamp
STAMP_TEXT="suite=$SUITE variant=$VARIANT include=$PACKAGES"

log() { printf 'build-test-rootfs: %s\n' "$*" >&2; }

if [[ $(id -u) -ne 0 ]]; then
    log "must run as root (debootstrap and systemd-nspawn need it)"
    exit 1
fi

mkdir -p "$(dirname "$DIR")"
# Two test runs may ask at once: one builds, the other waits and then finds it current.
exec 9>"$DIR.lock"
flock 9
if [[ -f "$DIR/$STAMP_NAME" && "$(cat "$DIR/$STAMP_NAME")" == "$STAMP_TEXT" ]]; then
    log "cached rootfs is current: $DIR"
    exit 0
fi

missing=()
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
command -v systemd-nspawn >/dev/null 2>&1 || missing+=(systemd-container)
if ((${#missing[@]})); then
    log "installing host packages: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Print the first URI that apt on this host uses for "$SUITE" main, from both the one-line format
# (sources.list, *.list) and the deb822 format (*.sources).
find_mirror() {
    local files=()
    [[ -f /etc/apt/sources.list ]] && files+=(/etc/apt/sources.list)
    local f
    for f in /etc/apt/sources.list.d/*.list; do [[ -f $f ]] && files+=("$f"); done
    if ((${#files[@]})); then
        awk -v suite="$SUITE" '
            $1 == "deb" {
                i = 2
                if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
                if ($(i + 1) == suite) { print $i; exit }
            }' "${files[@]}" | head -n1
    fi
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        awk -v suite="$SUITE" '
            BEGIN { RS = ""; FS = "\n" }
            {
                types = ""; uris = ""; suites = ""; enabled = "yes"
                for (n = 1; n <= NF; n++) {
                    line = $n
                    if (line ~ /^[ \t]*#/) continue
                    split(line, kv, ":")
                    key = tolower(kv[1])
                    val = substr(line, length(kv[1]) + 2)
                    gsub(/^[ \t]+|[ \t]+$/, "", val)
                    if (key == "types") types = val
                    else if (key == "uris") uris = val
                    else if (key == "suites") suites = val
                    else if (key == "enabled") enabled = tolower(val)
                }
                if (enabled == "no" || (" " types " ") !~ / deb /) next
                if ((" " suites " ") ~ (" " suite " ")) { split(uris, u, " "); print u[1]; exit }
            }' "$f"
    done | head -n1
}

MIRROR="${DEBIAN_MIRROR:-$(find_mirror | head -n1)}"
if [[ -z "$MIRROR" ]]; then
    log "no apt source for suite '$SUITE' found in /etc/apt/sources.list{,.d/*}; set DEBIAN_MIRROR"
    exit 1
fi

TMP="$DIR.tmp"
rm -rf "$TMP"
log "debootstrap $SUITE ($VARIANT, +$PACKAGES) from $MIRROR into $TMP"
start=$(date +%s)
debootstrap --variant="$VARIANT" --include="$PACKAGES" "$SUITE" "$TMP" "$MIRROR" >"$TMP.log" 2>&1 || {
    log "debootstrap failed; last lines of $TMP.log:"
    tail -n 20 "$TMP.log" >&2
    exit 1
}
rm -f "$TMP.log"

# The tests want a quick, quiet boot: nothing in the container should wait for a network, a getty or
# time sync that will never come.
rm -f "$TMP/etc/machine-id"
: >"$TMP/etc/machine-id" # empty → systemd makes a transient one each boot (no first-boot units)
for unit in systemd-networkd-wait-online.service getty@tty1.service console-getty.service \
    systemd-timesyncd.service apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer; do
    ln -sf /dev/null "$TMP/etc/systemd/system/$unit"
done
apt_clean_dirs=("$TMP/var/cache/apt/archives" "$TMP/var/lib/apt/lists")
for d in "${apt_clean_dirs[@]}"; do find "$d" -maxdepth 1 -type f -delete; done

printf '%s' "$STAMP_TEXT" >"$TMP/$STAMP_NAME"
if [[ -e "$DIR" ]]; then
    rm -rf "$DIR.old"
    mv "$DIR" "$DIR.old"
fi
mv "$TMP" "$DIR"
rm -rf "$DIR.old"
log "built $DIR in $(($(date +%s) - start)) s, $(du -sh "$DIR" | cut -f1)"
