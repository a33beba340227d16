#!/bin/sh
# Run bench/peers/vllm_offline.py under the vLLM CPU venv with the env it needs.
# Usage: /work/peers/run_vllm.sh --workload W.jsonl [--model DIR] [--dtype float32] [--no-prefix-caching] [--dump-outputs OUT.jsonl]
export VLLM_CPU_KVCACHE_SPACE=4
export VLLM_CPU_OMP_THREADS_BIND=0-1
export VLLM_CPU_NUM_OF_RESERVED_CPU=0
export LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:${VLLM_VENV:-/work/peers/vllm-venv}/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"
exec "${VLLM_VENV:-/work/peers/vllm-venv}/bin/python" "$(dirname "$0")/vllm_offline.py" "$@"
