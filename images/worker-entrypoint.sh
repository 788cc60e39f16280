#!/bin/sh
# Entrypoint of the worker image.
#
# 1. Under RunPod (RUNPOD_WEBHOOK_GET_JOB is set by the platform) or with KERNELLAB_MODE=runpod, run
#    the serverless handler instead of the Redis-stream worker.
# 2. Otherwise claim one GPU. `docker compose up --scale worker=N` gives every replica the same device
#    reservation (all GPUs), and compose tells a replica nothing about its index, so each replica takes
#    the first GPU whose lock file it can flock. The lock is held on fd 9, which survives `exec`, so it
#    is released exactly when the worker process dies.
set -eu

if [ "${KERNELLAB_MODE:-}" = "runpod" ] || [ -n "${RUNPOD_WEBHOOK_GET_JOB:-}" ]; then
    export KERNELLAB_MODE=runpod
    exec python /opt/kernellab/runpod/handler.py
fi

if [ -z "${CUDA_VISIBLE_DEVICES:-}" ] && command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader)
    lock_dir=${KERNELLAB_GPU_LOCK_DIR:-/var/lib/kernellab/gpu-locks}
    for gpu in $gpus; do
        exec 9>"$lock_dir/gpu-$gpu.lock"
        if flock --nonblock 9; then
            export CUDA_VISIBLE_DEVICES="$gpu"
            echo "kernellab worker: claimed GPU $gpu" >&2
            break
        fi
    done
    if [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
        echo "kernellab worker: every GPU ($(echo "$gpus" | tr '\n' ' ')) is held by another replica;" \
             "scale the workers to at most the number of GPUs" >&2
        exit 1
    fi
fi

exec "$@"
