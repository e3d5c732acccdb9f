#!/usr/bin/env bash
# Makes sure OpenSSH's sshd can run on this machine, so the SSH tests can start their
# own sshd per fake GPU host (tests/ssh_hosts.py does that; this script starts none).
# Idempotent. On a developer's machine a failed install only makes the SSH tests skip
# with a reason; under CI (CI=true) it fails, so a green CI never hides missing tests.
set -uo pipefail

# GPUBOT_SSHD overrides the binary checked (to exercise the install path).
SSHD=${GPUBOT_SSHD:-/usr/sbin/sshd}

if [ ! -x "$SSHD" ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "sshd_hosts: $SSHD is missing and installing it needs root; SSH tests will be skipped" >&2
        [ "${CI:-}" = "true" ] && exit 1
        exit 0
    fi
    echo "sshd_hosts: installing openssh-server"
    export DEBIAN_FRONTEND=noninteractive
    # The package index is refreshed only when the plain install fails: on a warm
    # machine that saves a network round trip, on a fresh one it is needed.
    if ! apt-get install -y -q openssh-server >/dev/null 2>&1; then
        apt-get update -q >/dev/null 2>&1 || true
        apt-get install -y -q openssh-server >/dev/null 2>&1 || true
    fi
    if [ ! -x "$SSHD" ]; then
        echo "sshd_hosts: could not install openssh-server; SSH tests will be skipped" >&2
        [ "${CI:-}" = "true" ] && exit 1
        exit 0
    fi
fi

# sshd refuses to start as root without its privilege-separation directory, which
# a container without systemd never creates.
if [ "$(id -u)" -eq 0 ]; then
    mkdir -p /run/sshd
    chmod 0755 /run/sshd
fi
exit 0
