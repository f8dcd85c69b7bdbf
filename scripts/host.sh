#!/usr/bin/env bash
# What rebound, its demo and its tests need of the running system, provided where it is missing
# (run as root; idempotent; scripts/deps.sh runs it after installing packages):
#   /dev/fuse        the fuse module loaded
#   fusectl          mounted on /sys/fs/fuse/connections: the tests and the demo read a
#                    connection's waiting requests there and abort a stuck one
#   a cgroup tree    on /sys/fs/cgroup (v2, or v1 hierarchies): rebound limits each driver in a
#                    cgroup of its own
# systemd provides all three at boot; a machine without it (a container, a CI runner) may not.
set -euo pipefail

[ -e /dev/fuse ] || modprobe fuse 2>/dev/null || true
[ -e /dev/fuse ] || { echo "host: /dev/fuse is missing and \`modprobe fuse\` did not add it" >&2; exit 1; }

fusectl=/sys/fs/fuse/connections
if ! mountpoint -q "$fusectl"; then
  echo "host: mounting fusectl on $fusectl" >&2
  mount -t fusectl fusectl "$fusectl" \
    || { echo "host: cannot mount fusectl on $fusectl" >&2; exit 1; }
fi

cgroups=/sys/fs/cgroup
if [ ! -e "$cgroups/cgroup.controllers" ] && [ ! -e "$cgroups/memory/cgroup.procs" ] \
    && ! mountpoint -q "$cgroups"; then
  echo "host: mounting cgroup2 on $cgroups" >&2
  mount -t cgroup2 cgroup2 "$cgroups" \
    || { echo "host: cannot mount cgroup2 on $cgroups" >&2; exit 1; }
fi
