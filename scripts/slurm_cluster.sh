#!/usr/bin/env bash
# Makes sure this machine can run the one-node Slurm cluster the tests start, configured
# as a lab configures theirs (tests/slurm_cluster.py writes the config and starts and
# stops the daemons; this script starts none): Debian's slurmctld, slurmd, slurmdbd, the
# client tools, munge, MariaDB (the accounting database; the tests run their own server
# on its own port and socket, with its data under $ROOT/mysql) and sudo; a munge key;
# the state directories owned by the `slurm` user; eight fake GPU device files (two nodes of four); the lab's
# unix accounts (two people, a shared account for unmapped people, the bot's own
# non-root account, and the group of the shared work directory); and the sudoers file
# that lets the bot's account run Slurm's job tools, and only those, as the people.
# Idempotent. On a developer's machine a failure only makes the Slurm tests skip with
# a reason; under CI (CI=true) it fails, so a green CI never hides missing tests.
set -uo pipefail

# Where the test cluster keeps its state; tests/slurm_cluster.py reads the same variable.
ROOT=${GPUBOT_TEST_SLURM_ROOT:-/var/lib/gpubot-test-slurm}
PACKAGES="slurmctld slurmd slurm-client munge slurmdbd mariadb-server sudo"
# tests/slurm_cluster.py names the same accounts (PEOPLE, SHARED_ACCOUNT, BOT_ACCOUNT,
# LAB_GROUP) and the same sudoers lines (SUDOERS_TEXT).
PEOPLE="gpubot-alice gpubot-bob"
SHARED_ACCOUNT=gpubot-lab
BOT_ACCOUNT=gpubot-slurmbot
LAB_GROUP=gpubot-labgroup
SUDOERS=/etc/sudoers.d/gpubot-test

fail() {
    echo "slurm_cluster: $1; the Slurm tests will be skipped" >&2
    [ "${CI:-}" = "true" ] && exit 1
    exit 0
}

have_all() {
    [ -x /usr/sbin/slurmctld ] && [ -x /usr/sbin/slurmd ] && [ -x /usr/sbin/munged ] \
        && [ -x /usr/sbin/slurmdbd ] && [ -x /usr/sbin/mariadbd ] && [ -x /usr/bin/sudo ] \
        && command -v sbatch >/dev/null 2>&1 && command -v sacctmgr >/dev/null 2>&1 \
        && command -v mariadb-install-db >/dev/null 2>&1 && command -v mariadb >/dev/null 2>&1 \
        && command -v visudo >/dev/null 2>&1
}

[ "$(id -u)" -eq 0 ] || {
    have_all || fail "Slurm is not installed and installing it needs root"
    fail "the test cluster's daemons and munge key need root"
}

if ! have_all; then
    echo "slurm_cluster: installing $PACKAGES"
    export DEBIAN_FRONTEND=noninteractive
    # Recommends pull dozens more packages (mail, X libraries, Perl), none needed. The index is
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
id -u mysql >/dev/null 2>&1 || fail "the mariadb-server package made no 'mysql' user"

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
for i in 0 1 2 3 4 5 6 7; do
    [ -e "$ROOT/dev/nvidia$i" ] || ln -sf /dev/null "$ROOT/dev/nvidia$i"
done

# The accounting database: the tests' own MariaDB (not the machine's, which may run on
# 3306 and is never touched) keeps its data under $ROOT/mysql, owned by mysql.
mkdir -p "$ROOT/mysql" || fail "cannot create $ROOT/mysql"
chown mysql: "$ROOT/mysql"
chmod 0700 "$ROOT/mysql"
if [ ! -d "$ROOT/mysql/data/mysql" ]; then
    rm -rf "$ROOT/mysql/data"
    mariadb-install-db --no-defaults --user=mysql --datadir="$ROOT/mysql/data" \
        --auth-root-authentication-method=socket --skip-test-db >"$ROOT/mysql/install.log" 2>&1 \
        || fail "mariadb-install-db failed (see $ROOT/mysql/install.log)"
fi

# The lab's unix accounts: people, the shared account of people the bot maps to no
# account of their own, and the bot's own (not root). Jobs run in their homes' name
# (HOME), so each home is the account's and readable.
for account in $PEOPLE $SHARED_ACCOUNT $BOT_ACCOUNT; do
    if ! id -u "$account" >/dev/null 2>&1; then
        useradd --create-home --shell /bin/sh --user-group "$account" \
            || fail "useradd $account failed"
    fi
    home=$(getent passwd "$account" | cut -d: -f6)
    if [ ! -d "$home" ]; then
        mkdir -p "$home" && chown "$account": "$home" || fail "cannot create the home of $account"
    fi
    chmod 0755 "$home"
done
getent group "$LAB_GROUP" >/dev/null 2>&1 || groupadd "$LAB_GROUP" || fail "groupadd $LAB_GROUP failed"
for account in $BOT_ACCOUNT $PEOPLE $SHARED_ACCOUNT; do
    id -nG "$account" | tr ' ' '\n' | grep -qx "$LAB_GROUP" \
        || usermod -a -G "$LAB_GROUP" "$account" || fail "cannot add $account to $LAB_GROUP"
done
# The shared work directories (tests/slurm_cluster.py's lab_workdir) live under here.
mkdir -p "$ROOT/work" && chmod 0755 "$ROOT/work" || fail "cannot create $ROOT/work"

# The bot's account may run sbatch, scancel and scontrol as a person or the shared
# account, without a password, and nothing else; SLURM_CONF (and SLURM_TIME_FORMAT)
# survive sudo's env_reset. Written only when it differs, checked before it is installed.
sudoers_text="# gpubot's Slurm test cluster (scripts/slurm_cluster.sh)
Defaults:$BOT_ACCOUNT env_keep += \"SLURM_CONF SLURM_TIME_FORMAT\"
$BOT_ACCOUNT ALL=($(echo "$PEOPLE $SHARED_ACCOUNT" | tr ' ' ',')) NOPASSWD: /usr/bin/sbatch, /usr/bin/scancel, /usr/bin/scontrol, /usr/bin/srun
"
if [ "$(cat "$SUDOERS" 2>/dev/null)" != "${sudoers_text%$'\n'}" ]; then
    candidate=$(mktemp /etc/sudoers.d/.gpubot-test.XXXXXX) || fail "cannot write /etc/sudoers.d"
    printf '%s' "$sudoers_text" >"$candidate"
    chmod 0440 "$candidate"
    if ! visudo -cqf "$candidate" >/dev/null 2>&1; then
        rm -f "$candidate"
        fail "visudo rejects the sudoers lines for $BOT_ACCOUNT"
    fi
    mv -f "$candidate" "$SUDOERS" || fail "cannot install $SUDOERS"
fi
chmod 0440 "$SUDOERS"
exit 0
