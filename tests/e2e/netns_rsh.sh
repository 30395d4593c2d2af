#!/usr/bin/env bash
# Open MPI's remote shell for test hosts made of network namespaces
# (tests/e2e/multihost_test.sh): mpirun --mca plm_rsh_agent netns_rsh.sh calls
#
#   netns_rsh.sh [ssh-style options] HOST COMMAND...
#
# and this runs COMMAND (one shell command line, as ssh would) inside the
# namespace that SMAT_NETNS_HOSTS maps HOST to ("10.213.7.1=ns-a 10.213.7.2=ns-b"),
# in a UTS namespace of its own whose host name is the namespace's name, so
# each test host has a name of its own (gethostname: the rank -> host table).
# Exits 255 like ssh when the host is not there (namespace deleted: a host
# that is down), which is what smat_launch --elastic probes for.
set -u
while [[ $# -gt 0 && $1 == -* ]]; do
  case "$1" in
    -o | -p | -l | -i) shift 2 ;;  # ssh options with a value: meaningless here
    *) shift ;;
  esac
done
host=${1:?usage: netns_rsh.sh HOST COMMAND...}
shift
ns=""
for pair in ${SMAT_NETNS_HOSTS:-}; do
  [[ ${pair%%=*} == "$host" ]] && ns=${pair#*=}
done
if [[ -z $ns ]]; then
  echo "netns_rsh.sh: host '$host' is not in SMAT_NETNS_HOSTS ('${SMAT_NETNS_HOSTS:-}')" >&2
  exit 255
fi
if ! ip netns exec "$ns" true 2>/dev/null; then
  echo "netns_rsh.sh: ssh: connect to host $host: host '$ns' is down (no such namespace)" >&2
  exit 255
fi
exec ip netns exec "$ns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$ns" "$*"
