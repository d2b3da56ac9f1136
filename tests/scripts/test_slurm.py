"""scripts/slurm/ray_on_slurm.sh on a real one-node Slurm cluster started for the test.

Needs the Debian packages of scripts/slurm/install_slurm.sh and root (slurmd runs jobs as their
user and must be able to switch to it). munged, slurmctld and slurmd run from a temporary
directory on free ports and are stopped at the end; nothing under /etc is used.
"""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hybridflow.ports import free_rendezvous_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "ray_on_slurm.sh"
# The entry the batch script runs: the real PPO-family recipe (a tiny 2-step GRPO run); it joins
# the job's Ray cluster through the RAY_ADDRESS the script exports.
ENTRY = f"{sys.executable} -m recipes.main_ppo"
RECIPE_STEPS = ["trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.test_freq=-1"]
SLURM_TOOLS = ("sbatch", "sinfo", "srun", "scontrol", "slurmctld", "slurmd", "munged")

pytestmark = pytest.mark.slow


def _free_port() -> int:
    return free_rendezvous_port("127.0.0.1")


def _skip_reason() -> str | None:
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None
               and not os.path.exists(f"/usr/sbin/{t}")]
    if missing:
        return f"Slurm tools missing: {missing}; run scripts/slurm/install_slurm.sh"
    if os.geteuid() != 0:
        return "the test Slurm cluster runs slurmd as root; run the test as root"
    return None


def _wait_for(check, timeout_s: float, what: str, logs: list[Path]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    tails = "\n".join(f"--- {p}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
    raise TimeoutError(f"{what} not ready after {timeout_s} s\n{tails}")


def _write_slurm_conf(root: Path, munge_socket: Path) -> Path:
    memory_mb = int(psutil.virtual_memory().total / 2**20 * 0.5)  # below the real total
    conf = root / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=hybridflow-test",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"AuthInfo=socket={munge_socket}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2",
        f"StateSaveLocation={root / 'state'}",
        f"SlurmdSpoolDir={root / 'spool'}",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmctldLogFile={root / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'slurmd.log'}",
        f"NodeName=localhost NodeAddr=127.0.0.1 CPUs=2 RealMemory={memory_mb} State=UNKNOWN",
        "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
    ]) + "\n")
    return conf


@pytest.fixture(scope="module")
def slurm_cluster():
    reason = _skip_reason()
    if reason:
        print(f"skipping Slurm test: {reason}")
        pytest.skip(reason)
    # A short path: munge and Slurm put unix sockets here (108-byte limit).
    root = Path(f"/tmp/hf-slurm-{os.getpid()}")
    shutil.rmtree(root, ignore_errors=True)
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munge_socket = root / "munge" / "munge.socket"
    conf = _write_slurm_conf(root, munge_socket)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = []
    logs = [root / "munged.log", root / "slurmctld.log", root / "slurmd.log"]

    def start(*cmd):  # foreground daemons; their console copy of the log goes to a file
        console = open(root / f"{cmd[0]}.console", "w")
        daemons.append(subprocess.Popen(cmd, env=env, stdout=console, stderr=console))
        console.close()
    try:
        start("munged", "-F", "-f", f"--socket={munge_socket}", f"--key-file={key}",
              f"--pid-file={root / 'munge' / 'munged.pid'}", f"--log-file={logs[0]}",
              f"--seed-file={root / 'munge' / 'munged.seed'}")
        _wait_for(munge_socket.exists, 30, "munged", logs)
        start("slurmctld", "-D", "-c", "-f", str(conf))
        start("slurmd", "-D", "-N", "localhost", "-f", str(conf))

        def node_idle():
            out = subprocess.run(["sinfo", "-h", "-n", "localhost", "-o", "%t"], env=env,
                                 capture_output=True, text=True).stdout.strip()
            return out == "idle"
        _wait_for(node_idle, 60, "Slurm node 'localhost' idle", logs)
        yield root, env
    finally:
        for daemon in reversed(daemons):
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(root, ignore_errors=True)


def _processes_of_cluster(gcs_port: int) -> list[str]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if f"--gcs_server_port={gcs_port}" in cmd or ("ray" in cmd and f":{gcs_port}" in cmd):
            found.append(cmd[:200])
    return found


def _submit(root: Path, cluster_env: dict, entry: str, args: list[str], name: str):
    """sbatch --wait the script on the test cluster; returns (exit code, job output, GCS port)."""
    gcs_port = _free_port()
    env = {
        **cluster_env,
        "PATH": f"{Path(sys.executable).parent}:{cluster_env['PATH']}",  # this venv's ray CLI
        "PYTHON": sys.executable,
        "HYBRIDFLOW_ENTRY": entry,
        "HYBRIDFLOW_WORKDIR": str(REPO),
        "RAY_PORT": str(gcs_port),
        "RAY_INCLUDE_DASHBOARD": "false",
        "RAY_OBJECT_STORE_BYTES": str(500 * 10**6),
        # Fixed default ports another Ray on this machine may hold.
        "RAY_START_EXTRA_ARGS": f"--ray-client-server-port={_free_port()} "
                                f"--dashboard-agent-listen-port={_free_port()}",
        "RAY_WAIT_TIMEOUT_S": "120",
    }
    job_out = root / f"{name}.out"
    result = subprocess.run(
        ["sbatch", "--wait", "--nodes=1", "--cpus-per-task=2", "--time=10", f"--job-name={name}",
         f"--output={job_out}", str(SCRIPT), *args],
        env=env, capture_output=True, text=True, timeout=400)
    log = job_out.read_text() if job_out.exists() else "(no job output)"
    print(log)  # shown with pytest -s
    return result.returncode, f"{result.stdout}{result.stderr}\n--- job output\n{log}", gcs_port


def test_ray_on_slurm_runs_a_tiny_grpo_recipe_on_the_allocated_ray_cluster(slurm_cluster):
    from tests.hybridflow.trainer.recipe_runs import make_assets, read_steps, recipe_args

    root, env = slurm_cluster
    run_dir = root / "run"
    assets = make_assets(root / "assets")
    code, log, gcs_port = _submit(root, env, ENTRY, recipe_args(assets, run_dir, *RECIPE_STEPS), "entry-ok")
    assert code == 0, log
    assert "1/1 Ray nodes up" in log
    assert " trainer.nnodes=1" in log.split("ray_on_slurm.sh: running", 1)[1].splitlines()[0]  # from the allocation
    # Ray's own INFO lines are in the run's driver log (the console keeps hybridflow's)
    driver_log = (run_dir / "logs" / "driver.log").read_text()
    assert "Connecting to existing Ray cluster" in driver_log or "Connected to Ray cluster" in driver_log, driver_log

    steps = read_steps(run_dir)
    assert sorted(steps) == [1, 2]
    for record in steps.values():
        assert 0.0 <= record["critic/score/mean"] <= 1.0 and "actor/pg_loss" in record
    assert (run_dir / "hf" / "model.safetensors").exists()  # the recipe's final HF export
    # The trap stopped this job's Ray cluster (and only it: no `ray stop` was needed).
    assert "stopping Ray on 1 node(s)" in log and "ray stop --force" not in log
    assert _processes_of_cluster(gcs_port) == []


def test_failing_entry_fails_the_job_and_still_stops_ray(slurm_cluster):
    root, env = slurm_cluster
    code, log, gcs_port = _submit(root, env, f"{sys.executable} -c",
                                  ["import sys; sys.exit(3)"], "entry-fails")
    # sbatch --wait exits with the job's code: the entry's 3 passed through the trap.
    assert code == 3, log
    assert "stopping Ray on 1 node(s)" in log and "ray stop --force" not in log
    assert _processes_of_cluster(gcs_port) == []
