#!/bin/bash
# Single-node Slurm on localhost for batchjob's Slurm tests (Debian bookworm, run as root).
# Usage: scripts/slurm/local-cluster.sh install|start|stop|status
# WITH_DBD=1 (default) also runs MariaDB+slurmdbd so `sacct` works: submitit (the Hydra launcher)
# reads job state from sacct, and without it a requeued task looks finished to the submitter.
# Daemons are stopped by the pids in their pid files, never by name.
set -euo pipefail
BASE=${SLURM_LOCAL_DIR:-/tmp/slurmtest}
WITH_DBD=${WITH_DBD:-1}
NODE=$(hostname -s)
R=$BASE/run
case "${1:-}" in
install)
  export DEBIAN_FRONTEND=noninteractive
  pkgs="slurmctld slurmd slurm-client munge"
  [ "$WITH_DBD" = 1 ] && pkgs="$pkgs slurmdbd mariadb-server"
  apt-get update -qq
  apt-get install -y --no-install-recommends $pkgs ;;
start)
  mkdir -p $BASE/{state/ctld,state/d,log/mysql,jobs} $R /run/munge /run/mysqld
  chown munge:munge /run/munge; chown mysql $BASE/log/mysql /run/mysqld 2>/dev/null || true
  # --- munge ---
  [ -s /etc/munge/munge.key ] || mungekey --create --keyfile=/etc/munge/munge.key
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged            # daemonizes; pid in /run/munge/munged.pid
  # --- slurm.conf (node line derived from `slurmd -C`) ---
  read -r CPUS SOCK CORES THR MEM < <(slurmd -C | head -1 | sed -E \
     's/.*CPUs=([0-9]+).*SocketsPerBoard=([0-9]+).*CoresPerSocket=([0-9]+).*ThreadsPerCore=([0-9]+).*RealMemory=([0-9]+).*/\1 \2 \3 \4 \5/')
  MEM=$(( MEM * 90 / 100 ))
  ACCT=accounting_storage/none; [ "$WITH_DBD" = 1 ] && ACCT=accounting_storage/slurmdbd
  cat > /etc/slurm/slurm.conf <<CONF
ClusterName=ci
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
# A requeued job may only start cred_expire+1 s after it ended: 5 is the minimum, so a requeue costs ~6 s.
AuthInfo=cred_expire=5
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$BASE/state/ctld
SlurmdSpoolDir=$BASE/state/d
SlurmctldPidFile=$R/slurmctld.pid
SlurmdPidFile=$R/slurmd.pid
SlurmctldLogFile=$BASE/log/slurmctld.log
SlurmdLogFile=$BASE/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=$ACCT
AccountingStorageHost=localhost
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,bf_interval=1,sched_interval=2
JobRequeue=1
# A requeued/cancelled task gets SIGTERM, then SIGKILL after KillWait: batchjob commits within
# seconds, and a short wait keeps the preemption tests fast.
KillWait=10
ReturnToService=2
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS Sockets=$SOCK CoresPerSocket=$CORES ThreadsPerCore=$THR RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
  if [ "$WITH_DBD" = 1 ]; then
    /usr/sbin/mariadbd --user=mysql --skip-networking --pid-file=/run/mysqld/mariadb.pid \
        --log-error=$BASE/log/mysql/mariadb.err >/dev/null 2>&1 &
    echo $! > $R/mariadb.pid
    for i in $(seq 100); do mariadb -e 'select 1' >/dev/null 2>&1 && break; sleep 0.1; done
    # A controller without saved job state numbers jobs from 1 again: an accounting database kept from an
    # earlier cluster would answer sacct for those ids with the old jobs' final states, and submitit would
    # take a job just submitted for finished. Such a database starts empty.
    [ -e $BASE/state/ctld/job_state ] || mariadb -e 'DROP DATABASE IF EXISTS slurm_acct_db'
    cat > /etc/slurm/slurmdbd.conf <<CONF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=$BASE/log/slurmdbd.log
PidFile=$R/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
CONF
    chmod 600 /etc/slurm/slurmdbd.conf
    slurmdbd
    for i in $(seq 300); do sacctmgr -n show cluster >/dev/null 2>&1 && break; sleep 0.1; done
    sacctmgr -n show cluster format=cluster | grep -qw ci || sacctmgr -i add cluster ci >/dev/null
  fi
  slurmctld
  slurmd
  for i in $(seq 100); do [ "$(sinfo -h -n $NODE -o %T 2>/dev/null)" = idle ] && break; sleep 0.2; done
  sinfo ;;
stop)
  ids=$(squeue -h -o %A 2>/dev/null || true)        # slurmstepd outlives slurmd: cancel jobs first
  if [ -n "$ids" ]; then scancel $ids; for i in $(seq 100); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done; fi
  for e in slurmd:$R/slurmd.pid slurmctld:$R/slurmctld.pid slurmdbd:$R/slurmdbd.pid \
           mariadbd:$R/mariadb.pid munged:/run/munge/munged.pid; do
    name=${e%%:*} f=${e#*:}
    [ -s "$f" ] || continue; pid=$(cat "$f")
    # only kill if the PID still belongs to the expected daemon (stale pid files)
    [ "$(cat /proc/$pid/comm 2>/dev/null)" = "$name" ] && kill "$pid" && \
      for i in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$f"
  done ;;
status)
  sinfo && squeue ;;
*) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
