#!/usr/bin/env bash
# A throw-away two-node SLURM cluster on this machine, for the launcher test and CI (needs root).
#
#   bash scripts/slurm/local_cluster.sh start    # install packages if missing, start munge + daemons
#   eval "$(bash scripts/slurm/local_cluster.sh env)"   # SLURM_CONF for sbatch/srun/scontrol
#   bash scripts/slurm/local_cluster.sh status   # exit 0 when both nodes answer
#   bash scripts/slurm/local_cluster.sh stop     # stop daemons and jobs, remove namespaces and files
#
# MZB_SLURM_MODE=netns (default): each node runs in its own network, UTS and mount namespace, with its own
#   hostname and address on a private bridge, so jobs really talk across an interface as on two machines.
#   If the namespaces cannot be set up the script falls back to single-host (unless the mode was set).
# MZB_SLURM_MODE=single-host: two slurmd on the host, both on 127.0.0.1 with different ports.
# Other knobs: MZB_SLURM_DIR (state, default /tmp/mzb-slurm), MZB_SLURM_SUBNET (first three octets of a
# /24 used only by this cluster, default 10.213.57), MZB_SLURM_PORT (slurmctld port, default 16817).
set -euo pipefail

STATE_DIR=${MZB_SLURM_DIR:-/tmp/mzb-slurm}
SUBNET=${MZB_SLURM_SUBNET:-10.213.57}
CTLD_PORT=${MZB_SLURM_PORT:-16817}
SLURMD_PORT=$((CTLD_PORT + 1))
BRIDGE=mzbslurm0
NODES=(mzb-n1 mzb-n2)
CONF="$STATE_DIR/slurm.conf"
HOST=$(hostname -s)

say() { echo "local_cluster: $*" >&2; }
die() { say "$*"; exit 1; }

install_packages() {
  local missing=()
  for cmd in slurmctld slurmd sbatch munged; do command -v "$cmd" >/dev/null || missing+=("$cmd"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get to install them"
  say "installing slurmctld slurmd slurm-client munge (missing: ${missing[*]})"
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
      slurmctld slurmd slurm-client munge; } >"$STATE_DIR/apt.log" 2>&1; then
    tail -n 5 "$STATE_DIR/apt.log" >&2
    die "apt-get could not install SLURM"
  fi
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  [ -f /etc/munge/munge.key ] || { mungekey --create >/dev/null 2>&1 || die "cannot create munge key"; }
  chown munge:munge /etc/munge/munge.key
  install -d -o munge -g munge -m 755 /run/munge
  runuser -u munge -- /usr/sbin/munged
  touch "$STATE_DIR/started-munged"   # only a munged we started gets stopped again
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged does not answer"
}

node_address() {  # node index (0-based) -> address the controller uses for it
  if [ "$(cat "$STATE_DIR/mode")" = netns ]; then echo "$SUBNET.$((11 + $1))"; else echo 127.0.0.1; fi
}

write_config() {
  local mode ctld_addr
  mode=$(cat "$STATE_DIR/mode")
  if [ "$mode" = netns ]; then ctld_addr="$SUBNET.1"; else ctld_addr=127.0.0.1; fi
  mkdir -p "$STATE_DIR/ctld" "$STATE_DIR/log"
  cat >"$CONF" <<EOF
# Written by scripts/slurm/local_cluster.sh ($mode mode); no cgroups, no accounting.
ClusterName=mzb
SlurmctldHost=$HOST($ctld_addr)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool-%n
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
# Schedule a batch job as soon as it is submitted (the default waits up to 3 s).
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
# Without accounting, scontrol knows a finished job only while slurmctld keeps it (default 300 s): keep it an hour,
# so that a job submitted early can be read when it is looked at.
MinJobAge=3600
EOF
  # Both "nodes" share this machine's cores; each may use all of them.
  local i cpus
  cpus=$(nproc)
  for i in "${!NODES[@]}"; do
    local port=$SLURMD_PORT
    [ "$mode" = netns ] || port=$((SLURMD_PORT + i))
    echo "NodeName=${NODES[$i]} NodeHostname=${NODES[$i]} NodeAddr=$(node_address "$i") Port=$port CPUs=$cpus State=UNKNOWN" >>"$CONF"
  done
  echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
  # The hosts file each node sees (bind-mounted over /etc/hosts in its mount namespace).
  { echo "127.0.0.1 localhost"; echo "$ctld_addr $HOST"
    for i in "${!NODES[@]}"; do echo "$(node_address "$i") ${NODES[$i]}"; done; } >"$STATE_DIR/hosts"
}

setup_network() {  # bridge on the host, one namespace + veth per node; fails without side effects left
  ip link add "$BRIDGE" type bridge || return 1
  ip addr add "$SUBNET.1/24" dev "$BRIDGE" && ip link set "$BRIDGE" up || return 1
  local i
  for i in "${!NODES[@]}"; do
    local ns=${NODES[$i]} veth="mzbveth$i"
    ip netns add "$ns" || return 1
    ip link add "$veth" type veth peer name eth0 netns "$ns" || return 1
    ip link set "$veth" master "$BRIDGE" up || return 1
    ip -n "$ns" addr add "$SUBNET.$((11 + i))/24" dev eth0 || return 1
    ip -n "$ns" link set eth0 up && ip -n "$ns" link set lo up || return 1
  done
}

teardown_network() {
  local ns
  for ns in "${NODES[@]}"; do
    if [ -e "/run/netns/$ns" ]; then
      # Anything still inside (job steps, torchrun) goes with the namespace.
      local pids; pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
      ip netns del "$ns" 2>/dev/null || true
    fi
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}

start_slurmd() {  # node index: slurmd in a private mount (and, in netns mode, network + UTS) namespace
  local i=$1 node=${NODES[$1]} enter=()
  [ "$(cat "$STATE_DIR/mode")" = netns ] && enter=(nsenter "--net=/run/netns/$node")
  # ip netns exec would remount /sys, after which slurmd 22.05 cannot find its cgroup mount.
  setsid "${enter[@]}" unshare --uts --mount sh -c \
    "mount --bind '$STATE_DIR/hosts' /etc/hosts && hostname $node && exec slurmd -D -f '$CONF' -N $node" \
    >>"$STATE_DIR/log/slurmd-$node.out" 2>&1 </dev/null &
  echo $! >"$STATE_DIR/slurmd-$node.launcher.pid"
}

wait_until() {  # tenths of a second, command...
  local tries=$1; shift
  for _ in $(seq "$tries"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}

nodes_idle() { [ "$(SLURM_CONF=$CONF sinfo -h -N -o '%N %t' | grep -c ' idle$')" -eq ${#NODES[@]} ]; }

nodes_reach_each_other() {  # node 2 opens a TCP connection to node 1's slurmd over the bridge
  nsenter "--net=/run/netns/${NODES[1]}" timeout 2 bash -c "exec 3<>/dev/tcp/$SUBNET.11/$SLURMD_PORT"
}

record_namespaces() {  # mount namespace of each slurmd: every job process of that node lives in it
  local node pid ns
  for node in "${NODES[@]}"; do
    pid=$(cat "$STATE_DIR/slurmd-$node.launcher.pid")
    ns=$(readlink "/proc/$pid/ns/mnt" 2>/dev/null) || continue
    # Never record the host's own namespace: stop kills everything inside the recorded ones.
    [ "$ns" = "$(readlink /proc/$$/ns/mnt)" ] || echo "$ns" >>"$STATE_DIR/mount-namespaces"
  done
}

undo_failed_start() {  # EXIT trap of start: a failed start shows the daemons' logs, then cleans up
  local status=$?
  [ "$status" -eq 0 ] && return 0
  local log
  for log in "$STATE_DIR"/log/*.log; do
    [ -s "$log" ] && { say "--- ${log##*/}:"; tail -n 8 "$log" >&2; }
  done
  cmd_stop
  exit "$status"
}

cmd_start() {
  [ "$(id -u)" -eq 0 ] || die "needs root (daemons run as root, namespaces, /run/munge)"
  [ -d "$STATE_DIR" ] && cmd_stop
  teardown_network  # leftovers of a run whose state directory is gone
  mkdir -p "$STATE_DIR"
  trap undo_failed_start EXIT
  install_packages
  local mode=${MZB_SLURM_MODE:-}
  if [ "${mode:-netns}" = netns ]; then
    if setup_network 2>"$STATE_DIR/network.err"; then mode=netns
    else
      teardown_network
      [ "${MZB_SLURM_MODE:-}" = netns ] && die "network namespaces failed: $(cat "$STATE_DIR/network.err")"
      say "network namespaces failed ($(tr '\n' ' ' <"$STATE_DIR/network.err")); using single-host mode"
      mode=single-host
    fi
  fi
  [ "$mode" = netns ] || [ "$mode" = single-host ] || die "MZB_SLURM_MODE must be netns or single-host"
  echo "$mode" >"$STATE_DIR/mode"
  write_config
  start_munge
  setsid slurmctld -D -c -f "$CONF" >>"$STATE_DIR/log/slurmctld.out" 2>&1 </dev/null &
  echo $! >"$STATE_DIR/slurmctld.launcher.pid"
  wait_until 100 env SLURM_CONF="$CONF" scontrol ping || die "slurmctld did not start"
  local i
  for i in "${!NODES[@]}"; do start_slurmd "$i"; done
  wait_until 200 nodes_idle || die "nodes not idle: $(SLURM_CONF=$CONF sinfo -h -N -o '%N=%t' | tr '\n' ' ')"
  record_namespaces
  if [ "$mode" = netns ]; then
    wait_until 20 nodes_reach_each_other || die "node ${NODES[1]} cannot reach ${NODES[0]} over $BRIDGE"
  fi
  trap - EXIT
  say "two nodes up ($mode mode); export SLURM_CONF=$CONF"
}

kill_pidfile() {  # signal, pid file
  [ -f "$2" ] && kill "-$1" "$(cat "$2")" 2>/dev/null || true
}

cmd_stop() {
  [ -d "$STATE_DIR" ] || { say "not running"; return 0; }
  [ -f "$CONF" ] && SLURM_CONF=$CONF timeout 5 scontrol shutdown >/dev/null 2>&1 || true
  local f
  for f in "$STATE_DIR"/*.launcher.pid; do
    [ -f "$f" ] || continue
    wait_until 30 bash -c "! kill -0 $(cat "$f")" || kill_pidfile KILL "$f"
  done
  # Job steps (slurmstepd, torchrun, workers) outlive slurmd; they share its mount namespace.
  if [ -f "$STATE_DIR/mount-namespaces" ]; then
    local proc own_ns
    own_ns=$(readlink /proc/$$/ns/mnt)
    for proc in /proc/[0-9]*; do
      local ns; ns=$(readlink "$proc/ns/mnt" 2>/dev/null) || continue
      [ "$ns" != "$own_ns" ] && grep -qxF "$ns" "$STATE_DIR/mount-namespaces" &&
        kill -KILL "${proc#/proc/}" 2>/dev/null || true
    done
  fi
  teardown_network
  if [ -f "$STATE_DIR/started-munged" ]; then kill_pidfile TERM /run/munge/munged.pid; fi
  rm -rf "$STATE_DIR"
  say "stopped"
}

cmd_status() {
  [ -f "$CONF" ] || { say "not running"; return 3; }
  echo "mode: $(cat "$STATE_DIR/mode"), SLURM_CONF=$CONF"
  SLURM_CONF=$CONF sinfo -N -o '%N %t %c %o' || return 3
  SLURM_CONF=$CONF squeue
  nodes_idle || [ "$(SLURM_CONF=$CONF sinfo -h -N -o '%t' | grep -cE '^(idle|alloc|mix)')" -eq ${#NODES[@]} ]
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
