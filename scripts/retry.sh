#!/usr/bin/env bash
# retry.sh TRIES PAUSE_S COMMAND...: run COMMAND until it succeeds, at most TRIES times, PAUSE_S
# seconds apart (doubling). For install steps whose only failure mode worth retrying is the
# network: a real error (a missing version) fails the same way each time and ends the run.
set -u
tries=$1; pause=$2; shift 2
for ((i = 1; i <= tries; i++)); do
    "$@" && exit 0
    rc=$?
    if ((i < tries)); then
        echo "retry.sh: '$*' failed (rc $rc), try $((i + 1))/$tries in ${pause}s" >&2
        sleep "$pause"; pause=$((pause * 2))
    fi
done
echo "retry.sh: '$*' failed $tries times (rc $rc); the network or the package index is the likely cause" >&2
exit "$rc"
