#!/usr/bin/env bash
# Checks the deployment files in deploy/ with the tools that will read them:
#   check_deploy.sh config <repo>     promtool check config (and the rule files it names)
#   check_deploy.sh rules <repo>      promtool check rules, then the alert unit tests
#                                     of tests/e2e/alerts_test.yml (promtool test rules)
#   check_deploy.sh dashboard <repo>  deploy/grafana/smat.json is valid JSON with panels
#                                     and Prometheus queries on smat_ series
#   check_deploy.sh slurm <repo>      deploy/slurm/smat.sbatch: bash -n, then run with fake
#                                     srun/scontrol/smat_train: SIGUSR2 reaches the ranks,
#                                     exit 5 requeues, exit 0 does not
#   check_deploy.sh k8s <repo> [smat_launch]  deploy/k8s/mpijob.yaml parsed (python3 yaml):
#                                     MPIJob v2beta1 structure, volumes, scrape annotations;
#                                     the launcher's arguments through smat_launch --dry_run
#   check_deploy.sh docker <repo>     deploy/docker/Dockerfile: CUDA base, the files it
#                                     uses exist, the README's docker build command
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
  slurm)
    sbatch=$repo/deploy/slurm/smat.sbatch
    bash -n "$sbatch" || { echo "FAIL: $sbatch: syntax"; exit 1; }
    for line in '#SBATCH --signal=B:USR2@' '#SBATCH --requeue' 'srun --mpi=pmix' \
                'scontrol requeue' 'NCCL_NVLS_ENABLE'; do
      grep -qF -- "$line" "$sbatch" || { echo "FAIL: $sbatch lacks '$line'"; exit 1; }
    done
    fake=$(mktemp -d)
    pids=()
    trap 'for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done; rm -rf "$fake"' EXIT
    # srun: records its arguments, drops its options, runs the program.
    cat > "$fake/srun" <<'FAKE'
#!/usr/bin/env bash
echo "$*" >> "$FAKE_DIR/srun.args"
while [[ $1 == -* ]]; do shift; done
exec "$@"
FAKE
    printf '#!/usr/bin/env bash\necho "$*" >> "$FAKE_DIR/scontrol.args"\n' > "$fake/scontrol"
    # smat_train / smat_launch: wait for SIGUSR2 (SIGTERM for smat_launch),
    # then exit 5 as after a checkpoint; FAKE_EXIT: exit with it at once.
    for prog in smat_train smat_launch; do
      sig=USR2
      [[ $prog == smat_launch ]] && sig=TERM
      cat > "$fake/$prog" <<FAKE
#!/usr/bin/env bash
[[ -n \${FAKE_EXIT:-} ]] && exit \$FAKE_EXIT
trap 'echo "got $sig" >> "\$FAKE_DIR/$prog.signals"; exit 5' $sig
touch "\$FAKE_DIR/ready"
for _ in \$(seq 300); do sleep 0.1; done
exit 1
FAKE
    done
    chmod +x "$fake"/*
    run_sbatch() {  # MODE: the script in the background, SIGUSR2 once the job runs
      rm -f "$fake/ready"
      FAKE_DIR=$fake PATH=$fake:$PATH SMAT_BIN=$fake SMAT_MODE=$1 SLURM_JOB_ID=42 \
        SLURM_NTASKS=2 bash "$sbatch" configs/tiny_cpu.textproto --set run.steps=5 \
        > "$fake/out.$1" 2>&1 &
      local pid=$!
      pids+=("$pid")
      for _ in $(seq 100); do [[ -e $fake/ready ]] && break; sleep 0.05; done
      [[ -e $fake/ready ]] || { echo "FAIL: the job of mode $1 did not start"; cat "$fake/out.$1"; exit 1; }
      kill -USR2 "$pid"
      code=0
      wait "$pid" || code=$?
    }
    run_sbatch srun
    [[ $code == 5 ]] || { echo "FAIL: srun mode exited $code, expected 5"; cat "$fake/out.srun"; exit 1; }
    grep -q -- "--mpi=pmix" "$fake/srun.args" || { echo "FAIL: srun without --mpi=pmix"; exit 1; }
    grep -qx "got USR2" "$fake/smat_train.signals" || { echo "FAIL: SIGUSR2 did not reach smat_train"; exit 1; }
    grep -qx "requeue 42" "$fake/scontrol.args" || { echo "FAIL: exit 5 did not requeue"; exit 1; }
    run_sbatch launch
    [[ $code == 5 ]] || { echo "FAIL: launch mode exited $code, expected 5"; cat "$fake/out.launch"; exit 1; }
    grep -qx "got TERM" "$fake/smat_launch.signals" || { echo "FAIL: smat_launch was not sent SIGTERM"; exit 1; }
    [[ $(grep -c "requeue 42" "$fake/scontrol.args") == 2 ]] || { echo "FAIL: launch mode did not requeue"; exit 1; }
    # A finished job (exit 0) and one past SMAT_MAX_REQUEUES are not requeued.
    FAKE_DIR=$fake FAKE_EXIT=0 PATH=$fake:$PATH SMAT_BIN=$fake SLURM_JOB_ID=42 \
      bash "$sbatch" c.textproto > "$fake/out.done" 2>&1 || { echo "FAIL: exit 0 job"; exit 1; }
    code=0
    FAKE_DIR=$fake FAKE_EXIT=5 PATH=$fake:$PATH SMAT_BIN=$fake SLURM_JOB_ID=42 \
      SLURM_RESTART_COUNT=3 SMAT_MAX_REQUEUES=3 bash "$sbatch" c.textproto > "$fake/out.max" 2>&1 || code=$?
    [[ $code == 5 ]] || { echo "FAIL: exit 5 job past its requeues exited $code"; exit 1; }
    [[ $(grep -c "requeue 42" "$fake/scontrol.args") == 2 ]] ||
      { echo "FAIL: requeued a finished job or one past SMAT_MAX_REQUEUES"; exit 1; }
    echo "ok: smat.sbatch: SIGUSR2 forwarded (srun: USR2 to the ranks, launch: TERM to smat_launch), exit 5 requeued, exit 0 and the requeue cap not"
    ;;
  k8s)
    need python3 "the YAML check uses python3"
    python3 -c 'import yaml' 2>/dev/null ||
      { echo "SKIPPED: python3 has no yaml module (scripts/setup.sh installs python3-yaml)"; exit 77; }
    python3 - "$repo" "${3:-}" <<'EOF'
import os, re, subprocess, sys, tempfile
import yaml
repo, launch = sys.argv[1], sys.argv[2]
docs = [d for d in yaml.safe_load_all(open(f"{repo}/deploy/k8s/mpijob.yaml")) if d]
kinds = {d["kind"]: d for d in docs}
assert set(kinds) == {"PersistentVolumeClaim", "MPIJob"}, kinds.keys()
pvc, job = kinds["PersistentVolumeClaim"], kinds["MPIJob"]
assert "ReadWriteMany" in pvc["spec"]["accessModes"], "checkpoints need a volume every pod mounts"
assert job["apiVersion"] == "kubeflow.org/v2beta1", job["apiVersion"]
spec = job["spec"]
slots = spec["slotsPerWorker"]
launcher = spec["mpiReplicaSpecs"]["Launcher"]
worker = spec["mpiReplicaSpecs"]["Worker"]
assert launcher["replicas"] == 1
lc = launcher["template"]["spec"]["containers"][0]
wc = worker["template"]["spec"]["containers"][0]
assert lc["command"][0].endswith("/smat_launch"), lc["command"]
def mounts(pod, c):
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
              for v in pod["template"]["spec"].get("volumes", [])}
    return {m["mountPath"]: claims.get(m["name"]) for m in c.get("volumeMounts", [])}
for pod, c in ((launcher, lc), (worker, wc)):
    assert mounts(pod, c).get("/checkpoints") == pvc["metadata"]["name"], mounts(pod, c)
args = lc["args"]
sets = [a.split("=", 1)[1] for a in args if a.startswith("--set=")]
assert any(s.startswith("checkpoint.dir=/checkpoints/") for s in sets), sets
ann = worker["template"]["metadata"]["annotations"]
assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == "9400", ann
ports = sorted(p["containerPort"] for p in wc["ports"] if p["name"].startswith("metrics-"))
assert ports == list(range(9400, 9400 + slots)), f"one metrics port per local rank: {ports}"
assert int(wc["resources"]["limits"]["nvidia.com/gpu"]) == slots, "one GPU per slot"
env = {e["name"]: e.get("value") for e in lc.get("env", [])}
assert env.get("NCCL_NVLS_ENABLE") == "0", env
exports = [args[i + 1] for i, a in enumerate(args) if a == "-x"]
assert "NCCL_NVLS_ENABLE" in exports, exports
scrape = yaml.safe_load(open(f"{repo}/deploy/k8s/prometheus-scrape.yml"))["scrape_configs"][0]
assert scrape["honor_labels"] is True and scrape["kubernetes_sd_configs"][0]["role"] == "pod"
keep = {tuple(r["source_labels"]): r["regex"] for r in scrape["relabel_configs"]
        if r.get("action") == "keep"}
port_re = keep[("__meta_kubernetes_pod_container_port_name",)]
assert all(re.fullmatch(port_re, p["name"]) for p in wc["ports"]), port_re
assert keep[("__meta_kubernetes_pod_annotation_prometheus_io_scrape",)] == ann["prometheus.io/scrape"]
ranks = worker["replicas"] * slots
print(f"ok: mpijob.yaml: {worker['replicas']} workers x {slots} slots, checkpoints on "
      f"PVC {pvc['metadata']['name']}, metrics ports {ports[0]}-{ports[-1]}")
if launch:
    # The launcher's arguments as smat_launch reads them, on the hostfile the
    # operator writes (paths inside the image mapped to this checkout).
    with tempfile.TemporaryDirectory() as d:
        hostfile = os.path.join(d, "hostfile")
        with open(hostfile, "w") as f:
            for w in range(worker["replicas"]):
                f.write(f"{job['metadata']['name']}-worker-{w}.svc slots={slots}\n")
        argv = [launch] + [a.replace("/opt/smat/src", repo) for a in args] + ["--dry_run"]
        out = subprocess.run(argv, env=dict(os.environ, OMPI_MCA_orte_default_hostfile=hostfile),
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, (argv, out.stdout, out.stderr)
        assert out.stdout.startswith(f"mpirun -np {ranks} --hostfile {hostfile} "), out.stdout
        print(f"ok: smat_launch --dry_run with the launcher's arguments: {out.stdout.strip()}")
EOF
    ;;
  docker)
    file=$repo/deploy/docker/Dockerfile
    grep -qE '^ARG CUDA_IMAGE=nvidia/cuda:[0-9.]+-devel-' "$file" || { echo "FAIL: no CUDA devel base image"; exit 1; }
    grep -qE '^FROM \$\{CUDA_IMAGE\}' "$file" || { echo "FAIL: FROM is not the CUDA image"; exit 1; }
    grep -q 'bash scripts/setup.sh --deps-only' "$file" || { echo "FAIL: packages not from scripts/setup.sh"; exit 1; }
    [[ -f $repo/scripts/setup.sh ]] || { echo "FAIL: scripts/setup.sh missing"; exit 1; }
    grep -q -- '--deps-only' "$repo/scripts/setup.sh" || { echo "FAIL: setup.sh has no --deps-only"; exit 1; }
    grep -q 'SMAT_CUDA' "$repo/CMakeLists.txt" || { echo "FAIL: CMakeLists.txt has no SMAT_CUDA"; exit 1; }
    # The build command of the Dockerfile's header and of the README must be the same.
    cmd=$(grep -oE 'docker build -f deploy/docker/Dockerfile -t [^ ]+ \.' "$file" | head -1)
    [[ -n $cmd ]] || { echo "FAIL: no docker build command in the Dockerfile header"; exit 1; }
    grep -qF -- "$cmd" "$repo/README.md" || { echo "FAIL: README lacks '$cmd'"; exit 1; }
    # Every path into the image's sources that the deploy files name exists here.
    for path in $(grep -ohE '/opt/smat/src/[A-Za-z0-9_./-]+' "$repo/deploy/k8s/mpijob.yaml" "$file"); do
      [[ -e $repo/${path#/opt/smat/src/} ]] || { echo "FAIL: $path: no ${path#/opt/smat/src/} here"; exit 1; }
    done
    echo "ok: Dockerfile: CUDA base, packages from scripts/setup.sh, the README's '$cmd'"
    ;;
  *)
    echo "unknown check '$what'"; exit 2 ;;
esac
