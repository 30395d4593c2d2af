#!/usr/bin/env bash
# End to end: a real Prometheus server scrapes every rank of a 2-rank MPI job
# through the file_sd target files the ranks write (trainer/metrics.h), and the
# series are checked through Prometheus's HTTP API. Everything stays on
# 127.0.0.1; the server, the job and the temporary folder are removed on any
# exit, and every wait is bounded.
#
#   prometheus_scrape_test.sh probe <repo> <mpiexec> <metrics_probe>
#   prometheus_scrape_test.sh probe_nan <repo> <mpiexec> <metrics_probe>
#   prometheus_scrape_test.sh train <repo> <mpiexec> <smat_train> <config> [--set ...]
#
# probe: tests/e2e/metrics_probe (job smat_e2e), stopped by the test once checked.
# probe_nan: the probe ends on a NaN loss as smat_train does (exit 4); the
#        SmatLossNotFinite alert of deploy/prometheus/alerts.yml must fire.
# train: a short smat_train run (metrics on 127.0.0.1, port 0, run.dir in the
#        temporary folder), left to finish by itself.
# Also checks that deploy/prometheus/alerts.yml loads and evaluates without
# errors on live data, and that every query of deploy/grafana/smat.json runs.
# Exit 77 (CTest: skipped) when prometheus or curl is missing.
set -uo pipefail

mode=${1:?mode: probe or train}
repo=${2:?repo}
mpiexec=${3:?mpiexec}
program=${4:?program}
shift 4

for tool in prometheus curl; do
  if ! command -v "$tool" >/dev/null; then
    echo "SKIPPED: '$tool' is not installed (scripts/setup.sh installs it: apt-get install prometheus curl)"
    exit 77
  fi
done

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
unset SMAT_RESTART_COUNT

tmp=$(mktemp -d "${TMPDIR:-/tmp}/smat_prom_e2e.XXXXXX")
run_dir=$tmp/run
mkdir -p "$run_dir/metrics"
prom_pid=""
job_pid=""

cleanup() {
  local rc=$?
  if [[ -n "$job_pid" ]] && kill -0 "$job_pid" 2>/dev/null; then
    kill -TERM "$job_pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$job_pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$job_pid" 2>/dev/null
  fi
  if [[ -n "$prom_pid" ]] && kill -0 "$prom_pid" 2>/dev/null; then
    kill -TERM "$prom_pid" 2>/dev/null
    for _ in $(seq 50); do kill -0 "$prom_pid" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$prom_pid" 2>/dev/null
  fi
  wait 2>/dev/null
  if ((rc != 0)) && ((rc != 77)); then
    echo "--- job log"; tail -n 40 "$tmp/job.log" 2>/dev/null
    echo "--- prometheus log"; tail -n 20 "$tmp/prometheus.log" 2>/dev/null
  fi
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

fail() { echo "FAIL: $*"; exit 1; }

# --- Prometheus on a free loopback port --------------------------------------
cat >"$tmp/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 900ms
  evaluation_interval: 1s
rule_files:
  - $repo/deploy/prometheus/alerts.yml
scrape_configs:
  - job_name: smat
    honor_labels: true
    file_sd_configs:
      - files: ["$run_dir/metrics/rank_*.json"]
        refresh_interval: 1s
EOF

prom_port=""
for attempt in 1 2 3 4 5; do
  port=$((20000 + RANDOM % 40000))
  prometheus --config.file="$tmp/prometheus.yml" --storage.tsdb.path="$tmp/tsdb" \
    --web.listen-address="127.0.0.1:$port" --log.level=warn >"$tmp/prometheus.log" 2>&1 &
  prom_pid=$!
  for _ in $(seq 100); do  # 20 s
    kill -0 "$prom_pid" 2>/dev/null || break
    if curl -sf --noproxy '*' --max-time 2 "http://127.0.0.1:$port/-/ready" >/dev/null; then
      # Ready, and still ours: a server already on that port would answer
      # while this one exits for want of the port.
      sleep 0.5
      kill -0 "$prom_pid" 2>/dev/null && prom_port=$port
      break
    fi
    sleep 0.2
  done
  [[ -n "$prom_port" ]] && break
  kill -KILL "$prom_pid" 2>/dev/null; wait "$prom_pid" 2>/dev/null; prom_pid=""
  echo "prometheus did not start on port $port (attempt $attempt): $(tail -n 2 "$tmp/prometheus.log")"
done
[[ -n "$prom_port" ]] || fail "could not start prometheus on 127.0.0.1"
echo "prometheus $(prometheus --version 2>&1 | head -n 1 | awk '{print $3}') on 127.0.0.1:$prom_port"

api="http://127.0.0.1:$prom_port/api/v1"
# query EXPR -> the value of a single-sample result ("" if none).
query() {
  curl -sf --noproxy '*' --max-time 5 -G "$api/query" --data-urlencode "query=$1" |
    sed -n 's/.*"value":\[[^,]*,"\([^"]*\)"\].*/\1/p'
}
# expect_value EXPR WANT
expect_value() {
  local got
  got=$(query "$1")
  [[ "$got" == "$2" ]] || fail "$1 = '${got}', expected $2"
  echo "ok: $1 = $got"
}

# --- the job ----------------------------------------------------------------
case "$mode" in
  probe)
    job=smat_e2e
    "$mpiexec" -np 2 --oversubscribe --bind-to none "$program" "$run_dir" 90 \
      >"$tmp/job.log" 2>&1 &
    job_pid=$!
    ;;
  probe_nan)
    job=smat_e2e
    "$mpiexec" -np 2 --oversubscribe --bind-to none "$program" "$run_dir" 90 nan \
      >"$tmp/job.log" 2>&1 &
    job_pid=$!
    for _ in $(seq 300); do  # 60 s: the alert fires on the rules' next evaluation
      [[ "$(query "count(ALERTS{alertname=\"SmatLossNotFinite\",alertstate=\"firing\",job=\"$job\"})")" == 1 ]] && break
      sleep 0.2
    done
    expect_value "count(ALERTS{alertname=\"SmatLossNotFinite\",alertstate=\"firing\",job=\"$job\"})" 1
    # The ranks reach their NaN at different steps, so the alert can fire on
    # the first rank's before the second's is scraped: wait for both.
    nonfinite="count(last_over_time(smat_loss_is_finite{job=\"$job\"}[5m]) == 0)"
    for _ in $(seq 150); do  # 30 s
      [[ "$(query "$nonfinite")" == 2 ]] && break
      sleep 0.2
    done
    expect_value "$nonfinite" 2
    for _ in $(seq 150); do  # 30 s
      kill -0 "$job_pid" 2>/dev/null || break
      sleep 0.2
    done
    kill -0 "$job_pid" 2>/dev/null && fail "the job did not end within 30 s of its NaN"
    wait "$job_pid"
    job_rc=$?
    job_pid=""
    ((job_rc == 4)) || fail "the job exited with $job_rc, expected 4 (non-finite loss)"
    grep -q "loss marked non-finite at step .*, scraped" "$tmp/job.log" ||
      fail "no rank saw its NaN scraped before exiting"
    echo "PASS: SmatLossNotFinite fired for a job that ended on a NaN loss (exit 4)"
    exit 0
    ;;
  train)
    config=${1:?config}
    shift
    job=smat_e2e_train
    "$mpiexec" -np 2 --oversubscribe --bind-to none "$program" --config "$config" \
      --set metrics.host=127.0.0.1 --set metrics.port=0 --set metrics.job_name=$job \
      --set run.dir="$run_dir" --set checkpoint.dir="$run_dir/checkpoints" "$@" \
      >"$tmp/job.log" 2>&1 &
    job_pid=$!
    ;;
  *) fail "unknown mode '$mode'" ;;
esac

for _ in $(seq 300); do  # 60 s for both ranks to start serving
  [[ -f "$run_dir/metrics/rank_0.json" && -f "$run_dir/metrics/rank_1.json" ]] && break
  kill -0 "$job_pid" 2>/dev/null || fail "the job ended before both ranks served metrics"
  sleep 0.2
done
[[ -f "$run_dir/metrics/rank_1.json" && -f "$run_dir/metrics/rank_0.json" ]] ||
  fail "no target files under $run_dir/metrics after 60 s"
echo "targets: $(cat "$run_dir"/metrics/rank_*.json | tr -d '\n')"
grep -q "serves metrics on http://127.0.0.1:" "$tmp/job.log" ||
  fail "the job did not print where its metrics are served"

# Both ranks scraped, with a step past 1 (file_sd refresh + a scrape or two).
for _ in $(seq 120); do  # 60 s
  [[ "$(query "count(smat_step{job=\"$job\"} >= 2)")" == 2 ]] && break
  kill -0 "$job_pid" 2>/dev/null || fail "the job ended before Prometheus scraped two steps"
  sleep 0.5
done

# --- what arrived --------------------------------------------------------------
expect_value "count(up{job=\"smat\"} == 1)" 2
expect_value "count(smat_step{job=\"$job\"})" 2
expect_value "count(smat_step{job=\"$job\",rank=\"0\"})" 1
expect_value "count(smat_step{job=\"$job\",rank=\"1\"})" 1
expect_value "count(smat_tokens_total{job=\"$job\"} > 0)" 2
expect_value "count(smat_step_duration_seconds_count{job=\"$job\"} > 0)" 2
expect_value "count(smat_loss_is_finite{job=\"$job\"} == 1)" 2
expect_value "count(smat_restarts_total{job=\"$job\"} == 0)" 2
expect_value "count(smat_comm_seconds_total{job=\"$job\",op=\"all_reduce\"})" 2
expect_value "count(smat_learning_rate{job=\"$job\"} > 0)" 2
for r in 0 1; do
  first=$(query "smat_step{job=\"$job\",rank=\"$r\"}")
  for _ in $(seq 40); do  # 20 s for the step to move on
    sleep 0.5
    now=$(query "smat_step{job=\"$job\",rank=\"$r\"}")
    awk -v a="$first" -v b="$now" 'BEGIN { exit !(b > a) }' && break
  done
  awk -v a="$first" -v b="$now" 'BEGIN { exit !(b > a) }' ||
    fail "smat_step of rank $r did not increase ($first -> $now)"
  echo "ok: smat_step of rank $r increased ($first -> $now)"
done
# A checkpoint with its size was recorded by both ranks (probe: step 5;
# train: pass --set checkpoint.every_steps=N with 2N steps well before the
# end, since an asynchronous save reports the bytes of the newest *committed*
# shard, which is the previous save's).
for _ in $(seq 120); do  # 60 s
  [[ "$(query "count(smat_checkpoint_bytes{job=\"$job\"} > 0)")" == 2 ]] && break
  kill -0 "$job_pid" 2>/dev/null || fail "the job ended before both ranks reported a checkpoint"
  sleep 0.5
done
expect_value "count(smat_last_checkpoint_timestamp_seconds{job=\"$job\"} > 1.7e9)" 2
expect_value "count(smat_checkpoint_bytes{job=\"$job\"} > 0)" 2
expect_value "count(smat_comm_bytes_total{job=\"$job\",op=\"all_reduce\"} > 0)" 2
expect_value "count(smat_device_memory_bytes{job=\"$job\"} > 0)" 2
expect_value "count(smat_loss{job=\"$job\"} > 0 < 100)" 2
if [[ "$mode" == probe ]]; then
  # The probe's ranks process 1024 and 2048 tokens a step: rank labels must
  # not be swapped or merged.
  tokens0=$(query "smat_tokens_total{job=\"$job\",rank=\"0\"} / smat_step{job=\"$job\",rank=\"0\"}")
  tokens1=$(query "smat_tokens_total{job=\"$job\",rank=\"1\"} / smat_step{job=\"$job\",rank=\"1\"}")
  awk -v a="$tokens0" -v b="$tokens1" 'BEGIN { exit !(a > 900 && a < 1150 && b > 1900 && b < 2200) }' ||
    fail "tokens per step of ranks 0/1 are $tokens0/$tokens1, expected about 1024/2048"
  echo "ok: tokens per step by rank $tokens0 / $tokens1"
fi

# --- the shipped alert rules load and evaluate on live data ----------------------
rules=$(curl -sf --noproxy '*' --max-time 5 "$api/rules")
grep -q '"name":"SmatNoStepProgress"' <<<"$rules" || fail "alerts.yml not loaded: $rules"
if grep -q '"health":"err"' <<<"$rules"; then fail "an alert rule fails to evaluate: $rules"; fi
echo "ok: $(grep -o '"health":"ok"' <<<"$rules" | wc -l) alert rules evaluate"

# --- every dashboard query runs (and returns data for the probe) ------------------
if [[ -f "$repo/deploy/grafana/smat.json" ]]; then
  empty=0
  total=0
  while IFS= read -r expr; do
    expr=${expr//\\\"/\"}
    expr=${expr//'$job'/$job}
    expr=${expr//'$__rate_interval'/30s}
    total=$((total + 1))
    answer=$(curl -s --noproxy '*' --max-time 5 -G "$api/query" --data-urlencode "query=$expr")
    grep -q '"status":"success"' <<<"$answer" || fail "dashboard query fails: $expr -> $answer"
    grep -q '"result":\[\]' <<<"$answer" && { empty=$((empty + 1)); echo "empty: $expr"; }
  done < <(sed -n 's/^ *"expr": "\(.*\)",\{0,1\}$/\1/p' "$repo/deploy/grafana/smat.json")
  ((total > 10)) || fail "found only $total queries in deploy/grafana/smat.json"
  if [[ "$mode" == probe ]] && ((empty > 0)); then
    fail "$empty of $total dashboard queries returned no data for a job that sets every series"
  fi
  echo "ok: $total dashboard queries run, $empty without data"
fi

# --- the job ends by itself and withdraws its targets -------------------------------
[[ "$mode" == probe ]] && touch "$run_dir/stop"
for _ in $(seq 600); do  # 120 s
  kill -0 "$job_pid" 2>/dev/null || break
  sleep 0.2
done
kill -0 "$job_pid" 2>/dev/null && fail "the job did not finish within 120 s"
wait "$job_pid"
job_rc=$?
job_pid=""
((job_rc == 0)) || fail "the job exited with $job_rc"
ls "$run_dir"/metrics/rank_*.json >/dev/null 2>&1 &&
  fail "target files left after a clean exit: $(ls "$run_dir/metrics")"
echo "PASS: 2 ranks scraped by Prometheus on 127.0.0.1:$prom_port"
