#!/usr/bin/env bash
# Start the services tests/jobs/cluster/ runs against, from Debian's packages, on a machine with
# no systemd (CI, a container): a PostgreSQL cluster and a single-node Slurm (munged, slurmctld,
# slurmd) with two fake GPUs. Root only; idempotent (a second run finds them up). `.ci/run` calls
# it after installing postgresql, slurm-wlm and munge.
#
#   bash scripts/cluster_services.sh            # both
#   bash scripts/cluster_services.sh slurm      # only Slurm
#   bash scripts/cluster_services.sh postgres   # only PostgreSQL
#
# Prints the lines to export (OFFLOAD_JOBS_TEST_PG=...). The tests make their own database in
# that cluster per test; without it they start a private cluster from the same binaries.
set -euo pipefail

what=${1:-all}
PG_PORT=${OFFLOAD_TEST_PG_PORT:-54329}
PG_DIR=${OFFLOAD_TEST_PG_DIR:-/var/tmp/offload-jobs-pg}
SLURM_GPUS=${OFFLOAD_TEST_SLURM_GPUS:-2}

pg_bin() {
    local d
    for d in /usr/lib/postgresql/*/bin; do [ -x "$d/initdb" ] && { echo "$d"; return; }; done
    return 1
}

start_postgres() {
    local bin
    bin=$(pg_bin) || { echo "postgres: no initdb under /usr/lib/postgresql/*/bin (apt-get install postgresql)" >&2; return 1; }
    # The server refuses to run as root; the package's postgres user owns the cluster.
    if [ ! -s "$PG_DIR/PG_VERSION" ]; then
        mkdir -p "$PG_DIR" && chown postgres:postgres "$PG_DIR" && chmod 700 "$PG_DIR"
        runuser -u postgres -- "$bin/initdb" -D "$PG_DIR" -A trust -U postgres --no-sync >/dev/null
        cat >>"$PG_DIR/postgresql.conf" <<EOF
listen_addresses = '127.0.0.1'
port = $PG_PORT
unix_socket_directories = '$PG_DIR'
max_connections = 200
fsync = off
synchronous_commit = off
EOF
    fi
    if ! runuser -u postgres -- "$bin/pg_ctl" -D "$PG_DIR" status >/dev/null 2>&1; then
        runuser -u postgres -- "$bin/pg_ctl" -D "$PG_DIR" -l "$PG_DIR/server.log" -w -t 60 start >/dev/null
    fi
    echo "export OFFLOAD_JOBS_TEST_PG=postgresql+psycopg://postgres@127.0.0.1:$PG_PORT/postgres"
}

start_slurm() {
    command -v slurmctld >/dev/null || { echo "slurm: no slurmctld (apt-get install slurm-wlm munge)" >&2; return 1; }
    local host cpus mem
    host=$(hostname -s)
    cpus=$(( $(nproc) > 8 ? $(nproc) : 8 ))  # declared, not real: short test jobs share the cores
    mem=$(awk '/MemTotal/ {print int($2 / 1024 * 0.8)}' /proc/meminfo)
    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
    chown munge:munge /run/munge
    [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null;
                                     chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
    if [ ! -f /etc/slurm/slurm.conf ] || grep -q "^# offload-jobs test node" /etc/slurm/slurm.conf; then
        cat >/etc/slurm/slurm.conf <<EOF
# offload-jobs test node (scripts/cluster_services.sh): one node, fake GPUs, no accounting daemon
ClusterName=offload
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmdParameters=config_overrides
GresTypes=gpu
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ReturnToService=2
MinJobAge=600
KillWait=10
InactiveLimit=0
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem Gres=gpu:$SLURM_GPUS State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
        local last=$(( SLURM_GPUS - 1 ))
        echo "NodeName=$host Name=gpu File=/dev/tty[0-$last]" >/etc/slurm/gres.conf
    fi
    pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
    pgrep -x slurmctld >/dev/null || slurmctld
    pgrep -x slurmd >/dev/null || slurmd
    local i
    for i in $(seq 1 60); do
        if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
            echo "slurm: node $host up ($(sinfo -h -o '%T %G'))"
            return 0
        fi
        # A node left DOWN/DRAIN by an earlier run comes back.
        [ "$i" = 10 ] && scontrol update nodename="$host" state=resume 2>/dev/null || true
        sleep 1
    done
    echo "slurm did not come up; see /var/log/slurm/" >&2
    return 1
}

case $what in
    postgres) start_postgres ;;
    slurm) start_slurm ;;
    all) start_postgres; start_slurm ;;
    *) echo "usage: $0 [all|postgres|slurm]" >&2; exit 2 ;;
esac
