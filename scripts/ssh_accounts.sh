#!/usr/bin/env bash
# Makes the unix accounts that the isolated SSH test hosts log in as, and the wheel
# cache their bootstrap installs from (tests/ssh_hosts.py, start_isolated_lab): the two
# bootstrapped hosts' and two per xdist worker for the SSH layer's own tests.
#
# Each account is a stranger to the bot: its own home (0700), a login shell, no group
# of the bot's, and nothing on PATH but the system's /usr/bin/python3. So a test that
# bootstraps one meets what a team's own GPU server offers, not the bot's venv.
#
# The wheel cache holds pyproject's `train` extra as wheels (torch from the pinned wheel
# on disk), readable by every account: the suite's bootstrap from nothing then installs
# offline (PIP_NO_INDEX) and in well under two minutes, and once per machine is the only
# download. Idempotent. On a developer's machine a failure makes those tests skip with a
# reason; under CI (CI=true) it fails, so a green CI never hides them.
set -uo pipefail

ACCOUNTS=${GPUBOT_TEST_HOST_ACCOUNTS:-gpubot-host-a gpubot-host-b}
# The SSH layer's strangers, two per pytest-xdist worker (tests/ssh_hosts.py,
# worker_accounts): PYTEST_WORKERS as `make test` passes it, at least 2 ("auto": the CPUs).
workers=${PYTEST_WORKERS:-2}
[ "$workers" = "auto" ] && workers=$(nproc)
case "$workers" in ''|*[!0-9]*) workers=2 ;; esac
[ "$workers" -lt 2 ] && workers=2
PREFIX=${GPUBOT_TEST_SSH_ACCOUNT_PREFIX:-gpubot-ssh}
for i in $(seq 0 $((workers - 1))); do
    ACCOUNTS="$ACCOUNTS $PREFIX$i-a $PREFIX$i-b"
done
WHEELS=${GPUBOT_TEST_WHEELS:-/var/cache/gpubot-test-wheels}
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}

fail() {
    echo "ssh_accounts: $1; the isolated-host tests will be skipped" >&2
    [ "${CI:-}" = "true" ] && exit 1
    exit 0
}

[ "$(id -u)" -eq 0 ] || fail "creating the test host accounts needs root"
[ -x /usr/bin/python3 ] || fail "/usr/bin/python3 is missing (the hosts' only Python)"
command -v useradd >/dev/null 2>&1 || fail "useradd is missing"

for account in $ACCOUNTS; do
    if ! id -u "$account" >/dev/null 2>&1; then
        echo "ssh_accounts: creating account $account"
        useradd --create-home --shell /bin/bash --user-group "$account" \
            || fail "useradd $account failed"
    fi
    home=$(getent passwd "$account" | cut -d: -f6)
    [ -d "$home" ] || { mkdir -p "$home" && chown "$account": "$home"; } \
        || fail "cannot create the home of $account"
    chmod 0700 "$home"
    # sshd without PAM refuses a locked account ("!" in shadow) even with a key:
    # "*" is no password at all, so only the test key logs in.
    if [ "$(getent shadow "$account" | cut -d: -f2)" != "*" ]; then
        usermod -p '*' "$account" || fail "cannot unlock $account for key logins"
    fi
done

# The wheels, keyed on the requirement list: a changed extra downloads again.
requirements=$("$PYTHON" - "$HERE/../pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["train"]))
EOF
) || fail "cannot read the train extra from pyproject.toml"
stamp="$WHEELS/.requirements"
if [ "$(cat "$stamp" 2>/dev/null)" != "$requirements" ]; then
    echo "ssh_accounts: filling the wheel cache $WHEELS"
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086  # one requirement a line, none with spaces
    "$PYTHON" -m pip download -q --only-binary=:all: -d "$WHEELS" $requirements \
        || fail "pip download of the train extra into $WHEELS failed"
    printf '%s\n' "$requirements" > "$stamp.part" && mv -f "$stamp.part" "$stamp"
fi
chmod -R a+rX "$WHEELS"
exit 0
