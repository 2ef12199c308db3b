#!/usr/bin/env bash
# Give one end of a Thunderbolt cable an address on the cable's own /30 (macOS).
#   cluster/thunderbolt-ip.sh "Thunderbolt 1" 192.168.100.1     # on one Mac
#   cluster/thunderbolt-ip.sh "Thunderbolt 1" 192.168.100.2     # on the Mac at the other end
# Use a new /30 per cable: .0/30 (.1, .2), .4/30 (.5, .6), .8/30 (.9, .10)... The launcher then
# routes each ring hop over the cable whose two ends share a /30. `networksetup -listallhardwareports`
# lists the port names. Rings of 3+ Macs: also run  cluster/thunderbolt-ip.sh --disable-bridge
set -euo pipefail
if [ "${1:-}" = "--disable-bridge" ]; then
  sudo networksetup -setnetworkserviceenabled "Thunderbolt Bridge" off
  echo "Thunderbolt Bridge disabled (it would loop traffic around a ring of 3+ Macs)"
  exit 0
fi
[ $# -eq 2 ] || { sed -n '2,8p' "$0"; exit 2; }
port=$1 address=$2
networksetup -listallhardwareports | grep -q "Hardware Port: $port\$" \
  || { echo "no hardware port '$port'; see: networksetup -listallhardwareports" >&2; exit 2; }
sudo networksetup -setmanual "$port" "$address" 255.255.255.252
echo "$port: $address/30"
