#!/usr/bin/env bash
# Installs smddpd as a systemd service, where smddpd.service runs it:
#   /opt/smddp                  a virtual environment with smddp (no torch: the daemon needs none)
#   /usr/local/bin/smddpd       -> /opt/smddp/bin/smddpd (the unit's ExecStart), smddpctl likewise
#   /etc/systemd/system/smddpd.service, /usr/lib/sysusers.d/smddp.conf (the smddp user and group),
#   /etc/default/smddp          every setting, commented out (kept if it exists)
# then creates the user, and enables and starts the service.
#
# Usage, as root:  bash deploy/systemd/install.sh [WHAT]
#   WHAT is what pip installs: this checkout by default, or a wheel (dist/smddp-*.whl), with
#   extras if wanted: '.[ucx]', 'dist/smddp-0.1.0-cp311-cp311-linux_x86_64.whl[cuda]'.
# DESTDIR=/some/root installs the files under that root and starts nothing (the tests do this).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WHAT=${1:-$(cd "$HERE/../.." && pwd)}
PY=${SMDDP_PYTHON:-$(command -v /usr/bin/python3 || command -v python3)}
D=${DESTDIR:-}
VENV=/opt/smddp

# Without DESTDIR the service is started at the end: check first that systemd runs this
# machine, so that nothing is installed (venv, links, unit, user) where it cannot start.
if [ -z "$D" ] && [ ! -d /run/systemd/system ]; then
    echo "install.sh: systemd is not running on this machine (no /run/systemd/system), so" \
        "smddpd.service could not start; nothing was installed. Run smddpd another way" \
        "(README: 'How it runs'), or set DESTDIR to install the files into a root without" \
        "starting them." >&2
    exit 1
fi

"$PY" -m venv "$D$VENV"
"$D$VENV/bin/python" -m pip install --quiet --upgrade pip
"$D$VENV/bin/python" -m pip install --quiet "$WHAT"
install -d "$D/usr/local/bin" "$D/etc/systemd/system" "$D/usr/lib/sysusers.d" "$D/etc/default"
# Links, not copies: the entry points' #! line names the venv's python.
ln -sfn "$VENV/bin/smddpd" "$D/usr/local/bin/smddpd"
ln -sfn "$VENV/bin/smddpctl" "$D/usr/local/bin/smddpctl"
install -m 0644 "$HERE/smddpd.service" "$D/etc/systemd/system/smddpd.service"
install -m 0644 "$HERE/smddp.sysusers" "$D/usr/lib/sysusers.d/smddp.conf"
if [ ! -e "$D/etc/default/smddp" ]; then
    install -m 0644 "$HERE/smddp.default" "$D/etc/default/smddp"
fi
if [ -n "$D" ]; then
    echo "smddpd installed under $D (nothing started)"
    exit 0
fi
systemd-sysusers
systemctl daemon-reload
systemctl enable --now smddpd.service
echo "smddpd.service is running: /usr/local/bin/smddpctl status; users who train join the smddp group"
