#!/bin/bash
# Install the Slurm daemons, client tools and munge from the distribution (Debian/Ubuntu), for
# tests/scripts/test_slurm.py, which starts a one-node cluster of its own. Does nothing when
# they are already installed. The packages' own services are not configured or needed.
set -euo pipefail

tools=(sbatch srun sinfo scontrol slurmctld slurmd munged)
missing=()
for tool in "${tools[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || [[ -x "/usr/sbin/$tool" ]] || missing+=("$tool")
done
if ((${#missing[@]} == 0)); then
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm.sh: missing ${missing[*]} and no apt-get here; install Slurm and munge" \
         "with this system's package manager" >&2
    exit 1
fi
sudo=()
if ((EUID != 0)); then
    command -v sudo >/dev/null 2>&1 || { echo "install_slurm.sh: needs root or sudo" >&2; exit 1; }
    sudo=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq slurm-wlm slurmctld slurmd munge >/dev/null
echo "install_slurm.sh: installed $(sbatch --version)"
