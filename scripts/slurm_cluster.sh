#!/usr/bin/env bash
# Makes sure this machine can run the one-node Slurm cluster the tests start
# (tests/slurm_cluster.py starts and stops the daemons; this script starts none):
# Debian's slurmctld, slurmd, the client tools and munge, a munge key, the state
# directories owned by the `slurm` user, and four fake GPU device files.
# Idempotent. On a developer's machine a failure only makes the Slurm tests skip with
# a reason; under CI (CI=true) it fails, so a green CI never hides missing tests.
set -uo pipefail

# Where the test cluster keeps its state; tests/slurm_cluster.py reads the same variable.
ROOT=${GPUBOT_TEST_SLURM_ROOT:-/var/lib/gpubot-test-slurm}
PACKAGES="slurmctld slurmd slurm-client munge"

fail() {
    echo "slurm_cluster: $1; the Slurm tests will be skipped" >&2
    [ "${CI:-}" = "true" ] && exit 1
    exit 0
}

have_all() {
    [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] \
        && command -v sbatch >/dev/null 2>&1
}

[ "$(id -u)" -eq 0 ] || {
    have_all || fail "Slurm is not installed and installing it needs root"
    fail "the test cluster's daemons and munge key need root"
}

if ! have_all; then
    echo "slurm_cluster: installing $PACKAGES"
    export DEBIAN_FRONTEND=noninteractive
    # Recommends pull 34 more packages (mail, X libraries), none needed. The index is
    # refreshed only when the plain install fails, as in sshd_hosts.sh.
    # shellcheck disable=SC2086
    if ! apt-get install -y -q --no-install-recommends $PACKAGES >/dev/null 2>&1; then
        apt-get update -q >/dev/null 2>&1 || true
        # shellcheck disable=SC2086
        apt-get install -y -q --no-install-recommends $PACKAGES >/dev/null 2>&1 || true
    fi
    have_all || fail "could not install $PACKAGES"
fi
id -u slurm >/dev/null 2>&1 || fail "the slurm package made no 'slurm' user"
id -u munge >/dev/null 2>&1 || fail "the munge package made no 'munge' user"

# munge: a key only munge reads, and the directories its daemon needs (a container
# without systemd never creates /run/munge).
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile=/etc/munge/munge.key >/dev/null 2>&1 \
            || fail "mungekey could not create /etc/munge/munge.key"
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none \
            || fail "could not create /etc/munge/munge.key"
    fi
fi
mkdir -p /run/munge /var/lib/munge /var/log/munge
chown munge: /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge
chmod 0700 /etc/munge /var/lib/munge /var/log/munge
chmod 0755 /run/munge
chmod 0400 /etc/munge/munge.key

# The cluster's directories: slurmctld (as SlurmUser=slurm) writes state and its log,
# slurmd (root) its spool; conf is written by the test session (root). The fake GPUs
# are device files gres.conf names: slurmd accepts symlinks to /dev/null.
mkdir -p "$ROOT/conf" "$ROOT/state" "$ROOT/spool" "$ROOT/log" "$ROOT/dev" \
    || fail "cannot create $ROOT"
chmod 0755 "$ROOT" "$ROOT/conf" "$ROOT/dev"
chown slurm: "$ROOT/state" "$ROOT/log"
chmod 0755 "$ROOT/state" "$ROOT/log"
for i in 0 1 2 3; do
    [ -e "$ROOT/dev/nvidia$i" ] || ln -sf /dev/null "$ROOT/dev/nvidia$i"
done
exit 0
