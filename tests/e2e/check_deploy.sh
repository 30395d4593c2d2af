#!/usr/bin/env bash
# Checks the deployment files in deploy/ with the tools that will read them:
#   check_deploy.sh config <repo>     promtool check config (and the rule files it names)
#   check_deploy.sh rules <repo>      promtool check rules, then the alert unit tests
#                                     of tests/e2e/alerts_test.yml (promtool test rules)
#   check_deploy.sh dashboard <repo>  deploy/grafana/smat.json is valid JSON with panels
#                                     and Prometheus queries on smat_ series
# Exit 77 (CTest: skipped) when the tool is missing; scripts/setup.sh installs
# prometheus (which ships promtool).
set -euo pipefail
what=${1:?config, rules or dashboard}
repo=${2:?repo}

need() {
  if ! command -v "$1" >/dev/null; then
    echo "SKIPPED: '$1' is not installed ($2)"
    exit 77
  fi
}

case "$what" in
  config)
    need promtool "scripts/setup.sh installs it: apt-get install prometheus"
    # The example paths of the file_sd job do not exist here: promtool warns, not fails.
    promtool check config "$repo/deploy/prometheus/prometheus.yml"
    ;;
  rules)
    need promtool "scripts/setup.sh installs it: apt-get install prometheus"
    promtool check rules "$repo/deploy/prometheus/alerts.yml"
    cd "$repo/tests/e2e"  # alerts_test.yml names the rule file relative to itself
    promtool test rules alerts_test.yml
    ;;
  dashboard)
    need python3 "the JSON check uses python3 -m json.tool"
    file=$repo/deploy/grafana/smat.json
    python3 -m json.tool "$file" >/dev/null || { echo "FAIL: $file is not valid JSON"; exit 1; }
    python3 - "$file" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
panels = d["panels"]
exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
assert d.get("uid") and d.get("title"), "dashboard needs a uid and a title"
assert len(panels) >= 8, f"only {len(panels)} panels"
assert all("smat_" in e for e in exprs), [e for e in exprs if "smat_" not in e]
for name in ["smat_loss", "smat_tokens_total", "smat_step_duration_seconds_bucket",
             "smat_comm_seconds_total", "smat_checkpoint_duration_seconds",
             "smat_restarts_total", "smat_device_memory_bytes"]:
    assert any(name in e for e in exprs), f"no panel shows {name}"
ids = [p["id"] for p in panels]
assert len(ids) == len(set(ids)), "panel ids repeat"
print(f"ok: {len(panels)} panels, {len(exprs)} queries")
EOF
    ;;
  *)
    echo "unknown check '$what'"; exit 2 ;;
esac
