#!/usr/bin/env bash
# An emulated cluster on one Linux machine (root): K hosts as network namespaces on a bridge.
#
#   cluster/netns-cluster.sh up K [RATE] [DELAY]   hosts PREFIX1..PREFIXK at 10.77.0.11, .12, ...
#                                                  RATE/DELAY shape each host's link (tc),
#                                                  e.g. "up 2 100mbit 5ms"
#   cluster/netns-cluster.sh agents SECRET_FILE STATE_ROOT   start an agent in every host (background)
#   cluster/netns-cluster.sh exec N CMD...         run CMD inside host N
#   cluster/netns-cluster.sh down                  kill everything in the hosts, remove them
#
# The launcher runs outside, on the bridge (10.77.0.1); mDNS and MLX's ring cross the bridge like a
# switch. PREFIX is $MLXD_NETNS_PREFIX (default "mdh"), so parallel clusters do not collide.
set -euo pipefail
PREFIX=${MLXD_NETNS_PREFIX:-mdh}
BRIDGE=${PREFIX}br0
SUBNET=${MLXD_SUBNET:-10.77.0}
PYTHON=${PYTHON:-python3}

hosts() { ip netns list | awk '{print $1}' | grep -E "^${PREFIX}[0-9]+$" || true; }

down() {
  for ns in $(hosts); do
    ip netns pids "$ns" | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}

# Shape what a host sends (each hop of the ring crosses one such link): netem for latency (and rate)
# where the kernel has it; otherwise tbf for the rate alone, and a warning that latency is not emulated.
shape() {
  local ns=$1 rate=$2 delay=$3
  [ -n "$rate$delay" ] || return 0
  if tc -n "$ns" qdisc add dev eth0 root netem limit 100000 ${delay:+delay $delay} ${rate:+rate $rate} 2>/dev/null; then
    return 0
  fi
  [ -z "$delay" ] || echo "warning: this kernel has no netem qdisc: latency $delay is not emulated" >&2
  [ -z "$rate" ] || tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
}

up() {
  local k=$1 rate=${2:-} delay=${3:-}
  down
  ip link add "$BRIDGE" type bridge
  ip addr add "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up multicast on
  for i in $(seq 1 "$k"); do
    local ns=$PREFIX$i
    ip netns add "$ns"
    ip link add "${PREFIX}v$i" type veth peer name eth0 netns "$ns"
    ip link set "${PREFIX}v$i" master "$BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$SUBNET.$((10 + i))/24" dev eth0
    ip -n "$ns" link set eth0 up multicast on
    ip -n "$ns" route add default via "$SUBNET.1"
    shape "$ns" "$rate" "$delay"
  done
  echo "hosts: $(hosts | tr '\n' ' ')(bridge $BRIDGE at $SUBNET.1)"
}

agents() {
  local secret_file=$1 state_root=$2 i=0
  for ns in $(hosts); do
    i=${ns#"$PREFIX"}
    ip netns exec "$ns" "$PYTHON" -m mlx_diloco agent --secret-file "$secret_file" --name "host$i" \
      --state-dir "$state_root/host$i" > "$state_root/agent-host$i.log" 2>&1 &
  done
}

cmd=${1:-}; shift || true
case "$cmd" in
  up) up "$@" ;;
  down) down ;;
  agents) agents "$@" ;;
  exec) n=$1; shift; exec ip netns exec "$PREFIX$n" "$@" ;;
  *) sed -n '2,13p' "$0"; exit 2 ;;
esac
