#!/usr/bin/env bash
# A real multi-host smat job on one machine: hosts made of network namespaces.
#
#   multihost_test.sh <repo> <mpirun> <smat_launch> <smat_train>
#
# Three namespaces: a "head" holding a bridge (and the launcher: smat_launch and
# mpirun run there), and hosts A and B, each joined to the bridge by a veth pair
# and given an address on a private test subnet (10.213.X.0/24, X from the pid).
# mpirun reaches the hosts through tests/e2e/netns_rsh.sh (its rsh agent: `ip
# netns exec HOST`), Open MPI's TCP is held to the test subnet, and smat_train
# trains tiny_cpu with sp = 2, one rank per host, so the sequence-parallel
# group spans the hosts. Checkpoints go to one directory every host sees (the
# same file system, as a cluster's shared one).
#
# 1. elastic: once a checkpoint is committed, every process of host B is killed
#    and B is taken down (its namespace deleted). smat_launch --elastic probes
#    both hosts, restarts on A alone with dp 1 x sp 1, resumes from the newest
#    intact checkpoint and finishes.
# 2. the host comes back: every process of host A (rank 0's host) is killed and
#    A is down; smat_launch (not elastic) restarts, which fails while A is
#    down, and restarts again on both hosts once A is back, from the newest
#    intact checkpoint, and finishes.
#
# Traffic stays inside the namespaces made here. Exit 77 (CTest: skipped) with
# the reason when this sandbox cannot make network namespaces (not root, no
# ip, no CAP_SYS_ADMIN). Cleans up namespaces, links and processes on every
# exit path.
set -uo pipefail
repo=${1:?repo}
mpirun=${2:?mpirun}
launch=${3:?smat_launch}
train=${4:?smat_train}

skip() {
  echo "SKIPPED: $*"
  exit 77
}
fail() {
  echo "FAIL: $*"
  exit 1
}

[[ $(id -u) -eq 0 ]] || skip "network namespaces need root (ip netns add); running as uid $(id -u)"
command -v ip >/dev/null || skip "'ip' (iproute2) is not installed; scripts/setup.sh installs it"
command -v unshare >/dev/null || skip "'unshare' (util-linux) is not installed"

p=smh$(($$ % 100000))
head=${p}h
host_a=${p}a
host_b=${p}b
net=10.213.$((20 + $$ % 200))
addr_a=$net.1
addr_b=$net.2
work=$(mktemp -d /tmp/smat_multihost.XXXXXX)
launcher_pid=""

cleanup() {
  [[ -n $launcher_pid ]] && kill -9 "$launcher_pid" 2>/dev/null
  for ns in "$host_a" "$host_b" "$head"; do
    if ip netns list 2>/dev/null | grep -qw "^$ns"; then
      ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    fi
  done
  sleep 0.2
  for ns in "$host_a" "$host_b" "$head"; do
    ip netns del "$ns" 2>/dev/null
  done
  # veth ends left in the root namespace by a half-made host (normally each
  # pair goes with its namespace).
  for l in "${p}a0" "${p}b0" "${p}a1" "${p}b1"; do ip link del "$l" 2>/dev/null; done
  # Open MPI's session directories of the hosts (ompi.<host name>.<uid>), which
  # the daemons killed with their hosts leave behind.
  rm -rf "${OMPI_MCA_orte_tmpdir_base:-${TMPDIR:-/tmp}}/ompi.$host_a.$(id -u)" \
    "${OMPI_MCA_orte_tmpdir_base:-${TMPDIR:-/tmp}}/ompi.$host_b.$(id -u)"
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

if ! out=$(ip netns add "$head" 2>&1); then
  skip "this sandbox cannot create network namespaces: ip netns add: $out"
fi
ip -n "$head" link set lo up
ip -n "$head" link add br0 type bridge || skip "cannot create a bridge inside a namespace"
ip -n "$head" addr add "$net.254/24" dev br0
ip -n "$head" link set br0 up

# host NAME ADDRESS SUFFIX: a namespace with eth0 = ADDRESS on the bridge.
# eth0 has the same MAC address each time a host is made, as a machine that
# reboots keeps its NIC: with a new one, a peer that still holds the old
# address (REACHABLE for up to 45 s after their last traffic) sends into the
# void until it expires: the restarts after host A came back hung one after
# another (and in a trial, host B's first connection to a re-made host took
# 28 s).
make_host() {
  local ns=$1 address=$2 s=$3
  ip netns add "$ns" || return 1
  ip link add "${p}${s}0" type veth peer name "${p}${s}1" || return 1
  ip link set "${p}${s}0" netns "$head" || return 1
  ip link set "${p}${s}1" netns "$ns" || return 1
  ip -n "$head" link set "${p}${s}0" master br0 up || return 1
  ip -n "$ns" link set "${p}${s}1" name eth0 || return 1
  ip -n "$ns" link set eth0 address "02:53:4d:00:00:0$s" || return 1
  ip -n "$ns" addr add "$address/24" dev eth0 || return 1
  ip -n "$ns" link set eth0 up || return 1
  ip -n "$ns" link set lo up
}
make_host "$host_a" "$addr_a" a || skip "cannot create veth pairs or addresses in namespaces"
make_host "$host_b" "$addr_b" b || skip "cannot create veth pairs or addresses in namespaces"

# take_down NS: every process of the host killed, then the host gone (its
# namespace deleted: the rsh agent fails for it, as ssh to a dead node).
take_down() {
  local ns=$1 pids
  pids=$(ip netns pids "$ns")
  [[ -n $pids ]] || fail "no process runs on host $ns to kill"
  echo "killing every process of host $ns: $(echo $pids)"
  echo "$pids" | xargs -r kill -9
  # The namespace goes once the processes are gone, so their sockets close
  # (the peers see the connections end) before the host's link disappears.
  local deadline=$((SECONDS + 10))
  while [[ -n $(ip netns pids "$ns") ]] && ((SECONDS < deadline)); do sleep 0.05; done
  ip netns del "$ns"
}

export SMAT_NETNS_HOSTS="$addr_a=$host_a $addr_b=$host_b"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
printf '%s slots=1\n%s slots=1\n' "$addr_a" "$addr_b" > "$work/hosts"

# The hosts answer through the agent and get their own names.
for h in "$addr_a" "$addr_b"; do
  name=$(ip netns exec "$head" "$repo/tests/e2e/netns_rsh.sh" "$h" hostname) ||
    fail "the rsh agent cannot reach $h"
  [[ $name == "$host_a" || $name == "$host_b" ]] || fail "host $h calls itself '$name'"
done

# launch RUN_DIR EXTRA...: smat_launch in the head namespace, in the background.
# --hang_timeout: Open MPI 4.1's mpirun sometimes hangs after "ORTE has lost
# communication with a remote daemon" (seen here about one time in three when
# a host dies); the launcher ends such an mpirun and restarts, as it would on a
# cluster. A step line comes every ~50 ms, so 6 s of silence is no slow step.
launch_job() {
  local dir=$1
  shift
  ip netns exec "$head" "$launch" --hostfile "$work/hosts" \
    --config "$repo/configs/tiny_cpu.textproto" --train "$train" --mpirun "$mpirun" \
    --set parallel.sp=2 --set run.steps=36 --set run.log_every=1 --set run.eval_every=0 \
    --set data.batch_size=4 --set optimizer.warmup_steps=2 --set checkpoint.every_steps=4 \
    --set checkpoint.keep_last=3 --set "run.dir=$dir" \
    --mpirun_arg --mca --mpirun_arg plm_rsh_agent --mpirun_arg "$repo/tests/e2e/netns_rsh.sh" \
    --mpirun_arg --mca --mpirun_arg plm_rsh_no_tree_spawn --mpirun_arg 1 \
    --mpirun_arg --mca --mpirun_arg routed --mpirun_arg direct \
    --mpirun_arg --mca --mpirun_arg pml --mpirun_arg ob1 \
    --mpirun_arg --mca --mpirun_arg btl --mpirun_arg tcp,self \
    --mpirun_arg --mca --mpirun_arg btl_tcp_if_include --mpirun_arg "$net.0/24" \
    --mpirun_arg --mca --mpirun_arg oob_tcp_if_include --mpirun_arg "$net.0/24" \
    --mpirun_arg --bind-to --mpirun_arg none \
    -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM \
    --max_restarts 4 --backoff 1 --probe_timeout 5 --hang_timeout 6 "$@" > "$dir.out" 2>&1 &
  launcher_pid=$!
}

# wait_for SECONDS CMD...: polls CMD every 0.1 s.
wait_for() {
  local deadline=$((SECONDS + $1))
  shift
  until "$@"; do
    ((SECONDS < deadline)) || return 1
    sleep 0.1
  done
}
committed_step() {  # the newest committed checkpoint's step, 0 when none
  local d
  d=$(ls "$1/checkpoints" 2>/dev/null | grep -E '^step_[0-9]+$' | sort | tail -1)
  [[ -n $d ]] && echo $((10#${d#step_})) || echo 0
}
past_step() { (($(committed_step "$1") >= $2)); }
attempt_ended() { grep -q "smat_launch: attempt $2 ended" "$1.out"; }
finish_launcher() {  # waits (60 s at most) for smat_launch; its exit code in $code
  local waited=0
  while kill -0 "$launcher_pid" 2>/dev/null && ((waited < 600)); do
    sleep 0.1
    waited=$((waited + 1))
  done
  kill -9 "$launcher_pid" 2>/dev/null
  wait "$launcher_pid"
  code=$?
  launcher_pid=""
}
expect_in() {  # expect_in FILE TEXT
  grep -qF -- "$2" "$1" || fail "'$2' not in $1:
$(tail -40 "$1")"
}

# ---- 1. elastic: host B dies for good --------------------------------------
run1=$work/elastic
launch_job "$run1" --elastic
wait_for 40 past_step "$run1" 8 || fail "no checkpoint of step >= 8 within 40 s:
$(tail -30 "$run1.out")"
take_down "$host_b"
wait_for 30 attempt_ended "$run1" 0 || fail "attempt 0 did not end after host B died:
$(tail -30 "$run1.out")"
newest=$(committed_step "$run1")
echo "attempt 0 ended; newest committed checkpoint: step $newest"
finish_launcher
cat "$run1.out" | grep -E "^smat: [0-9]+ ranks?|^ +[0-9]+  smh|smat_launch: (elastic|attempt|restart)|resumed|done:|^  (attempt|result)" | sed 's/^/  | /'
[[ $code == 0 ]] || fail "smat_launch --elastic exited $code:
$(tail -40 "$run1.out")"
log0=$run1/launch/attempt_0.log
log1=$run1/launch/attempt_1.log
expect_in "$log0" "smat: 2 ranks launched by Open MPI on 2 hosts"
expect_in "$log0" "0  $host_a"
expect_in "$log0" "1  $host_b"
expect_in "$log0" "grid dp 1 x sp 2"
expect_in "$run1.out" "smat_launch: elastic: host $addr_b does not answer"
expect_in "$run1.out" "smat_launch: elastic: attempt 1 on 1 of 2 hosts ($addr_a:1): --np 1, parallel.dp=1 parallel.sp=1"
expect_in "$log1" "smat: 1 rank launched by Open MPI on 1 host"
expect_in "$log1" "grid dp 1 x sp 1"
((newest >= 8)) || fail "newest checkpoint step $newest < 8"
expect_in "$log1" "smat: resumed from $run1/checkpoints/step_$(printf %08d "$newest") at step $newest"
expect_in "$log1" "smat: done: 36 steps"
[[ $(cat "$run1/checkpoints/latest") == step_00000036 ]] || fail "latest is not step_00000036"
echo "ok: elastic: host B killed after step $newest's checkpoint; resumed on host A alone (dp 1 x sp 1) from step $newest and finished 36 steps"

# ---- 2. host A dies and comes back; restart on both hosts -----------------
make_host "$host_b" "$addr_b" b || fail "cannot re-create host B"
run2=$work/comeback
launch_job "$run2" --backoff 2
wait_for 40 past_step "$run2" 8 || fail "no checkpoint of step >= 8 within 40 s:
$(tail -30 "$run2.out")"
take_down "$host_a"
wait_for 30 attempt_ended "$run2" 0 || fail "attempt 0 did not end after host A died:
$(tail -30 "$run2.out")"
newest=$(committed_step "$run2")
echo "attempt 0 ended; newest committed checkpoint: step $newest"
# The first restart finds host A still down (mpirun cannot start its daemon
# there) and fails; then A comes back and the next restart runs on both hosts.
wait_for 30 attempt_ended "$run2" 1 || fail "attempt 1 did not end while host A was down:
$(tail -30 "$run2.out")"
grep -q "smat_launch: attempt 1 ended .*exit 0," "$run2.out" && fail "attempt 1 finished without host A"
echo "attempt 1 failed while host A was down; host A comes back"
make_host "$host_a" "$addr_a" a || fail "cannot bring host A back"
finish_launcher
cat "$run2.out" | grep -E "^smat: [0-9]+ ranks?|smat_launch: (attempt|restart)|resumed|done:|^  (attempt|result)" | sed 's/^/  | /'
[[ $code == 0 ]] || fail "smat_launch exited $code:
$(tail -40 "$run2.out")"
last=$(ls "$run2/launch" | grep -E '^attempt_[0-9]+\.log$' | sort -t_ -k2 -n | tail -1)
((${#last} > 0)) && [[ $last == attempt_2.log ]] || fail "expected the job to finish in attempt 2, the last is $last"
expect_in "$run2/launch/$last" "smat: 2 ranks launched by Open MPI on 2 hosts"
expect_in "$run2/launch/$last" "grid dp 1 x sp 2"
((newest >= 8)) || fail "newest checkpoint step $newest < 8"
expect_in "$run2/launch/$last" "smat: resumed from $run2/checkpoints/step_$(printf %08d "$newest") at step $newest"
expect_in "$run2/launch/$last" "smat: done: 36 steps"
echo "ok: host A killed after step $newest's checkpoint, back on both hosts ($last) from step $newest; finished 36 steps"
echo "1 passed, 0 failed"
