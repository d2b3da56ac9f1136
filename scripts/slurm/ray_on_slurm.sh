#!/bin/bash
# Start a Ray cluster across a Slurm allocation and run a hybridflow recipe on it.
#
#   sbatch --nodes=4 --gpus-per-node=8 scripts/slurm/ray_on_slurm.sh data.train_batch_size=1024
#
# Arguments are Hydra overrides for the entry command (default `python -m recipes.main_ppo`);
# for a recipe entry, trainer.nnodes and trainer.n_gpus_per_node default to the allocation's.
# The Ray head runs on the first node of the allocation, one Ray worker on each other node; the
# entry runs in this batch step (on the head node) once every node has joined, and finds the
# cluster through RAY_ADDRESS, so `ray.init()` / `ray.init(address="auto")` connect to it.
# On exit (success, failure, scancel, time limit) the Ray processes started here are stopped.
# See scripts/slurm/README.md for the settings below; RAY_HEAD_IP sets the address the other
# nodes reach the head at, when the first one `hostname -I` lists is not it (a docker bridge).
#
#SBATCH --job-name=hybridflow
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=16
#SBATCH --output=%x-%j.out
#SBATCH --signal=B:TERM@60

set -euo pipefail

# Environment settings (all optional):
#   HYBRIDFLOW_ENTRY       command to run instead of `python -m recipes.main_ppo`
#   HYBRIDFLOW_WORKDIR     directory to run it in (default: where sbatch was called)
#   RAY_PORT               GCS port of the head (default 6379)
#   RAY_NUM_CPUS           CPUs Ray may use per node (default: $SLURM_CPUS_PER_TASK)
#   RAY_NUM_GPUS           GPUs per node (default: Ray detects them)
#   RAY_OBJECT_STORE_BYTES object store size per node (default: Ray's, 30% of memory)
#   RAY_INCLUDE_DASHBOARD  true|false (default true)
#   RAY_START_EXTRA_ARGS   more `ray start` flags for every node (e.g. --resources='{"x":1}')
#   RAY_WAIT_TIMEOUT_S     seconds to wait for all nodes to join (default 300)
#   PYTHON                 interpreter for the readiness check (default python)
#   RAY_AUTH_MODE, RAY_AUTH_TOKEN[_PATH]  Ray's token auth; default: on, with a fresh per-job token
: "${HYBRIDFLOW_ENTRY:=python -m recipes.main_ppo}"
: "${RAY_PORT:=6379}"
: "${RAY_NUM_CPUS:=${SLURM_CPUS_PER_TASK:-}}"
: "${RAY_INCLUDE_DASHBOARD:=true}"
: "${RAY_WAIT_TIMEOUT_S:=300}"
: "${PYTHON:=python}"
# Ray is stopped only after the entry ended: nothing left to drain (Ray waits 30 s by default).
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "ray_on_slurm.sh: not inside a Slurm job; submit it with sbatch (see scripts/slurm/README.md)" >&2
    exit 2
fi
cd "${HYBRIDFLOW_WORKDIR:-${SLURM_SUBMIT_DIR:-$PWD}}"

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
num_nodes=${#nodes[@]}
head_node=${nodes[0]}
# An IPv4 address of the head that its peers can reach: `hostname -I` lists the interfaces'
# addresses; `hostname --ip-address` is what /etc/hosts says, often a loopback (Debian maps the
# hostname to 127.0.1.1), which is used only if nothing else exists.
head_ip=${RAY_HEAD_IP:-}
if [[ -z "$head_ip" ]]; then
    ips=$(srun --overlap --nodes=1 --ntasks=1 -w "$head_node" \
        bash -c 'hostname -I 2>/dev/null; hostname --ip-address 2>/dev/null' \
        | tr ' ' '\n' | grep -E '^[0-9]+(\.[0-9]+){3}$' || true)
    head_ip=$(grep -v -m 1 '^127\.' <<< "$ips" || head -n 1 <<< "$ips")
fi
if [[ -z "$head_ip" ]]; then
    echo "ray_on_slurm.sh: could not find an IPv4 address of $head_node; set RAY_HEAD_IP" >&2
    exit 2
fi
export RAY_ADDRESS="$head_ip:$RAY_PORT"
# Token authentication for every process of this cluster. Ray turns it on by itself for
# `ray start` when ~/.ray/auth_token exists but not for drivers that connect, so leaving it
# implicit gives "InvalidAuthToken" on some machines; a per-job token in the environment (srun
# passes it to every node) also works where home directories are not shared.
if [[ -z "${RAY_AUTH_MODE:-}" ]]; then
    export RAY_AUTH_MODE=token
    if [[ -z "${RAY_AUTH_TOKEN:-}" && -z "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
        RAY_AUTH_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
        export RAY_AUTH_TOKEN
    fi
fi

ray_args=(--include-dashboard="$RAY_INCLUDE_DASHBOARD" --disable-usage-stats --block)
[[ -n "$RAY_NUM_CPUS" ]] && ray_args+=(--num-cpus="$RAY_NUM_CPUS")
[[ -n "${RAY_NUM_GPUS:-}" ]] && ray_args+=(--num-gpus="$RAY_NUM_GPUS")
[[ -n "${RAY_OBJECT_STORE_BYTES:-}" ]] && ray_args+=(--object-store-memory="$RAY_OBJECT_STORE_BYTES")
read -r -a extra_args <<< "${RAY_START_EXTRA_ARGS:-}"
ray_args+=("${extra_args[@]}")

ray_step_name="ray-node-$SLURM_JOB_ID"  # how the cleanup finds the steps running Ray
ray_step_pids=()
entry_pid=""
stop_ray() {
    local status=$?
    trap - EXIT INT TERM
    if [[ -n "$entry_pid" ]] && kill -0 "$entry_pid" 2>/dev/null; then
        kill -TERM "$entry_pid" 2>/dev/null || true  # scancel/time limit: stop the run first
        wait "$entry_pid" 2>/dev/null || true
    fi
    echo "ray_on_slurm.sh: stopping Ray on $num_nodes node(s)"
    # SIGTERM to the processes of the `ray start --block` steps: Ray's own handler then stops
    # exactly the processes of this cluster. Not `kill` on the srun (srun answers SIGTERM by
    # SIGKILLing the step) and not `ray stop`, which kills every Ray process of this user on
    # the node, other jobs' included; that is only the fallback for a step that hangs.
    local steps
    steps=$(squeue --steps --jobs="$SLURM_JOB_ID" --noheader --format="%i %j" 2>/dev/null \
        | awk -v name="$ray_step_name" '$2 == name { print $1 }') || true
    for step in $steps; do scancel --signal=TERM "$step" 2>/dev/null || true; done
    local deadline=$((SECONDS + 60))
    for pid in "${ray_step_pids[@]}"; do
        while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    done
    for pid in "${ray_step_pids[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            echo "ray_on_slurm.sh: a Ray step did not stop in 60 s; running ray stop --force on all nodes" >&2
            srun --overlap --nodes="$num_nodes" --ntasks="$num_nodes" --ntasks-per-node=1 \
                ray stop --force || true
            break
        fi
    done
    wait 2>/dev/null || true
    exit "$status"
}
trap stop_ray EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

# Slurm 22.05+ no longer passes the job's --cpus-per-task on to srun steps: say it, or a Ray
# node told --num-cpus=$SLURM_CPUS_PER_TASK would be pinned to one CPU
step_cpus=()
[[ -n "${SLURM_CPUS_PER_TASK:-}" ]] && step_cpus=(--cpus-per-task="$SLURM_CPUS_PER_TASK")
echo "ray_on_slurm.sh: Ray head on $head_node ($RAY_ADDRESS), $((num_nodes - 1)) worker node(s)"
srun --overlap --nodes=1 --ntasks=1 -w "$head_node" --job-name="$ray_step_name" "${step_cpus[@]}" \
    ray start --head --node-ip-address="$head_ip" --port="$RAY_PORT" "${ray_args[@]}" &
ray_step_pids+=($!)
for node in "${nodes[@]:1}"; do
    srun --overlap --nodes=1 --ntasks=1 -w "$node" --job-name="$ray_step_name" "${step_cpus[@]}" \
        ray start --address="$RAY_ADDRESS" "${ray_args[@]}" &
    ray_step_pids+=($!)
done

# Wait until every node's raylet is registered and alive, or fail with what is missing.
"$PYTHON" - "$RAY_ADDRESS" "$num_nodes" "$RAY_WAIT_TIMEOUT_S" <<'PY'
import socket, sys, time
address, expected, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + timeout
host, port = address.rsplit(":", 1)
while True:  # GCS port open first: ray.init on a closed port retries for a long time
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        break
    except OSError:
        if time.monotonic() > deadline:
            sys.exit(f"ray_on_slurm.sh: Ray head at {address} did not open its port within "
                     f"{timeout:.0f} s; see the head's lines in this job's output")
        time.sleep(1)
import ray
ray.init(address=address, logging_level="ERROR", log_to_driver=False)
while True:
    alive = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
    if len(alive) >= expected:
        print(f"ray_on_slurm.sh: {len(alive)}/{expected} Ray nodes up: {sorted(alive)}", flush=True)
        break
    if time.monotonic() > deadline:
        sys.exit(f"ray_on_slurm.sh: only {len(alive)} of {expected} Ray nodes joined within "
                 f"{timeout:.0f} s (up: {sorted(alive)}); raise RAY_WAIT_TIMEOUT_S or check the "
                 "workers' lines in this job's output")
    time.sleep(2)
ray.shutdown()
PY

# A recipe told nothing else runs on the allocation's shape: trainer.nnodes from its node count
# and, on a GPU allocation, trainer.n_gpus_per_node from Slurm's GPUs on this node. Values given
# on the command line win (a mismatch with the allocation is then the config check's to name).
if [[ "$HYBRIDFLOW_ENTRY" == *recipes.main_* ]]; then
    given="$*"
    [[ "$given" == *"trainer.nnodes="* ]] || set -- "$@" "trainer.nnodes=$num_nodes"
    if [[ "$given" != *"trainer.n_gpus_per_node="* && "${SLURM_GPUS_ON_NODE:-0}" =~ ^[1-9][0-9]*$ ]]; then
        set -- "$@" "trainer.n_gpus_per_node=$SLURM_GPUS_ON_NODE"
    fi
fi

read -r -a entry <<< "$HYBRIDFLOW_ENTRY"
echo "ray_on_slurm.sh: running ${entry[*]} $*"
# Not exec: the EXIT trap must run after the entry to stop Ray. Run it in the background and
# wait, so a TERM from Slurm (time limit, scancel) reaches the trap without waiting for it.
"${entry[@]}" "$@" &
entry_pid=$!
wait "$entry_pid"
