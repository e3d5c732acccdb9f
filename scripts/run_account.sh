#!/usr/bin/env bash
# Makes sure the unprivileged account that runs training runs exists (GPUBOT_RUN_AS;
# tests/core/test_run_isolation.py uses it): no password, /bin/sh, its own home, and in
# no group of the bot's. Idempotent. On a developer's machine a missing account only
# makes those tests skip with a reason; under CI (CI=true) it fails, so a green CI
# never hides them.
set -uo pipefail

ACCOUNT=${GPUBOT_TEST_RUN_AS:-gpubot-run}

fail() {
    echo "run_account: $1; the run-isolation tests will be skipped" >&2
    [ "${CI:-}" = "true" ] && exit 1
    exit 0
}

if ! id -u "$ACCOUNT" >/dev/null 2>&1; then
    [ "$(id -u)" -eq 0 ] || fail "account $ACCOUNT is missing and creating it needs root"
    echo "run_account: creating account $ACCOUNT"
    if command -v useradd >/dev/null 2>&1; then
        useradd --create-home --shell /bin/sh --user-group "$ACCOUNT" || fail "useradd $ACCOUNT failed"
    elif command -v adduser >/dev/null 2>&1; then  # busybox (Alpine)
        adduser -D -s /bin/sh "$ACCOUNT" || fail "adduser $ACCOUNT failed"
    else
        fail "neither useradd nor adduser is installed"
    fi
fi

home=$(getent passwd "$ACCOUNT" | cut -d: -f6)
if [ -z "$home" ] || [ ! -d "$home" ]; then
    [ "$(id -u)" -eq 0 ] || fail "the home of $ACCOUNT ($home) is missing"
    mkdir -p "$home" && chown "$ACCOUNT": "$home" && chmod 0750 "$home" \
        || fail "cannot create the home of $ACCOUNT"
fi
exit 0
