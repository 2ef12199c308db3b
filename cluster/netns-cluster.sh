#!/usr/bin/env bash
# An emulated cluster on one Linux machine (root): K hosts as network namespaces on a bridge.
#
#   cluster/netns-cluster.sh up K [RATE] [DELAY]   hosts PREFIX1..PREFIXK at 10.77.0.11, .12, ...
#                                                  RATE/DELAY shape each host's link (tc),
#                                                  e.g. "up 2 100mbit 5ms"
#   cluster/netns-cluster.sh cable I J [RATE]      a direct link between hosts I and J (I < J), as a
#                                                  Thunderbolt cable: interface thunderboltJ in host I
#                                                  and thunderboltI in host J on their own /30
#                                                  (10.78.(16I+J).1 and .2), RATE shaping both ends
#                                                  (hostinfo counts thunderbolt* interfaces as
#                                                  Thunderbolt: Linux's thunderbolt-net names them so)
#   cluster/netns-cluster.sh agents SECRET_FILE STATE_ROOT   start an agent in every host (background)
#   cluster/netns-cluster.sh exec N CMD...         run CMD inside host N
#   cluster/netns-cluster.sh down                  kill everything in the hosts, remove them
#
# The launcher runs outside, on the bridge (10.77.0.1); mDNS and MLX's ring cross the bridge like a
# switch. PREFIX is $MLXD_NETNS_PREFIX (default "mdh") and SUBNET $MLXD_SUBNET (default 10.77.0), so
# parallel clusters do not collide: `up` refuses a subnet another interface of this machine holds
# (two bridges on one /24 route each other's traffic into the wrong cluster).
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

# tbf's bucket for RATE (tc's units: 100mbit, 1gbit, ...): 5 ms at the rate, at least 64 KB. A smaller
# bucket loses tokens whenever this machine is busy and the qdisc is served late, and cannot keep
# 1 Gbit/s busy once both directions carry data (two TCP streams, one each way: 64 KB gave 0.69-0.88
# Gbit/s each, 256 KB 0.95); a larger one lets a message's first bytes through at the veth's speed,
# which inflates what a short transfer measures.
burst_for() {
  awk -v r="$1" 'BEGIN { n = r + 0; u = tolower(r); sub(/^[0-9.]+/, "", u)
    s = (u ~ /^t/) ? 1e12 : (u ~ /^g/) ? 1e9 : (u ~ /^m/) ? 1e6 : (u ~ /^k/) ? 1e3 : 1
    if (u ~ /bps$/) s *= 8
    b = n * s / 8 * 0.005; if (b < 65536) b = 65536; printf "%d", b }'
}

# Shape what a host sends on DEV (each hop of the ring crosses one such link): netem for latency (and
# rate) where the kernel has it; otherwise tbf for the rate alone (a 50 ms queue: with less, TCP's
# windows overflow it and a message's last packets wait for a retransmission timeout), and a warning
# that latency is not emulated.
shape() {
  local ns=$1 rate=$2 delay=$3 dev=${4:-eth0}
  [ -n "$rate$delay" ] || return 0
  if tc -n "$ns" qdisc add dev "$dev" root netem limit 100000 ${delay:+delay $delay} ${rate:+rate $rate} 2>/dev/null; then
    return 0
  fi
  [ -z "$delay" ] || echo "warning: this kernel has no netem qdisc: latency $delay is not emulated" >&2
  [ -z "$rate" ] || tc -n "$ns" qdisc add dev "$dev" root tbf rate "$rate" burst "$(burst_for "$rate")" latency 50ms
}

# The interface other than BRIDGE that holds an address in SUBNET.0/24, if any.
holder() {
  ip -o -4 addr show | awk -v net="$SUBNET." -v own="$BRIDGE" \
    'index($4, net) == 1 && $2 != own { print $2; exit }'
}

up() {
  local k=$1 rate=${2:-} delay=${3:-} held
  held=$(holder)
  if [ -n "$held" ]; then
    echo "subnet $SUBNET.0/24 is held by $held (another cluster's bridge?); set MLXD_SUBNET to a free one" >&2
    exit 1
  fi
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
    # TCP small queues: at most 128 KB of a socket's data waits in the shaping qdisc, as a NIC's byte
    # queue limits keep it. With the kernel's 4 MB a socket fills the 50 ms queue of a 100 Mbit/s link
    # and the other direction's ACKs wait behind it: measured, a 4 MB all-reduce got 0.069-0.085
    # Gbit/s of bus bandwidth there, 0.093-0.095 with 128 KB (send/recv: 0.096 with either).
    ip netns exec "$ns" sysctl -qw net.ipv4.tcp_limit_output_bytes=131072 || echo "warning: TCP small queues not set" >&2
    shape "$ns" "$rate" "$delay"
  done
  echo "hosts: $(hosts | tr '\n' ' ')(bridge $BRIDGE at $SUBNET.1)"
}

cable() {
  local i=$1 j=$2 rate=${3:-} net=${MLXD_CABLE_NET:-10.78}.$((16 * $1 + $2))
  [ "$i" -lt "$j" ] && [ "$j" -le 15 ] || { echo "cable I J: hosts I < J <= 15" >&2; exit 2; }
  ip link add "thunderbolt$j" netns "$PREFIX$i" type veth peer name "thunderbolt$i" netns "$PREFIX$j"
  ip -n "$PREFIX$i" addr add "$net.1/30" dev "thunderbolt$j"
  ip -n "$PREFIX$j" addr add "$net.2/30" dev "thunderbolt$i"
  ip -n "$PREFIX$i" link set "thunderbolt$j" up
  ip -n "$PREFIX$j" link set "thunderbolt$i" up
  shape "$PREFIX$i" "$rate" "" "thunderbolt$j"
  shape "$PREFIX$j" "$rate" "" "thunderbolt$i"
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
  cable) cable "$@" ;;
  agents) agents "$@" ;;
  exec) n=$1; shift; exec ip netns exec "$PREFIX$n" "$@" ;;
  *) sed -n '2,19p' "$0"; exit 2 ;;
esac
