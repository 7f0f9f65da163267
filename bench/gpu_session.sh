#!/usr/bin/env bash
# One GPU lease, the issue-15 measurements in priority order, every result under $OUT.
#
#   bench/gpu_session.sh served     # 1. the served path: phones over WebSockets into `autoglm-cloud serve`
#   bench/gpu_session.sh engine     # 2. the engine and the direct loop, same machine, same S (cloud_gpu_bench)
#   bench/gpu_session.sh attach     # 3. engine/direct tokens/s into the served records (no GPU work)
#   bench/gpu_session.sh all        # 1 + 2 + 3
#
# Workload: glm4v-9b-random split at 12 (28 cloud layers, bf16, random weights built on the GPU), 512-token
# prompts, 128 greedy tokens per session, S = 1 / 8 / 64 / 256 (SESSIONS to change), the served levels once
# per wire codec (CODECS, default int8-outlier,bf16: the realistic codec and the cheapest one to decode).
# All three stages took about 4 minutes on an H200 (the served one 2.5); outputs:
#   $OUT/cloud_served.json   bench/served_load.py records (docs/results/cloud_served.json is this file)
#   $OUT/served_spy.txt      py-spy collapsed stacks of the server at the largest S (summary in the JSON)
#   $OUT/cloud_gpu_engine.json  cloud_gpu_bench --through-engine (engine.summary: engine/direct tokens/s)
#   $OUT/*.log               each stage's console output
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the results folder}"
SESSIONS=${SESSIONS:-1,8,64,256}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"

served() {
    local spy=()  # py-spy (PyPI; a static binary): on PATH, or in .cache/served-load/ carried to the device
    PATH="$PWD/.cache/served-load:$PATH"
    if command -v py-spy >/dev/null 2>&1; then spy=(--py-spy "$OUT/served_spy.txt")
    else echo "gpu_session.sh: no py-spy on PATH: the served run goes without a profile"; fi
    timeout 580 python3 bench/served_load.py --preset glm4v-9b-random --layer 12 --sessions "$SESSIONS" \
        --prompt 512 --gen 128 --sweep-codecs "${CODECS:-int8-outlier,bf16}" "${spy[@]}" --out "$OUT/cloud_served.json" 2>&1 | tee "$OUT/served.log"
}

engine() {
    timeout 580 python3 bench/cloud_gpu_bench.py --through-engine --sessions "$SESSIONS" --pool-sessions 256 \
        --skip-checks --skip-hf --out "$OUT/cloud_gpu_engine.json" 2>&1 | tee "$OUT/engine.log"
}

attach() {
    python3 bench/served_load.py --attach-engine "$OUT/cloud_gpu_engine.json" --to "$OUT/cloud_served.json"
}

case "${1:-all}" in
    served) served ;;
    engine) engine ;;
    attach) attach ;;
    all) served; engine; attach ;;
    *) echo "usage: $0 served|engine|attach|all" >&2; exit 2 ;;
esac
