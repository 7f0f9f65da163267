#!/usr/bin/env bash
# One GPU lease, the issue-15 measurements in priority order, every result under $OUT.
#
#   bench/gpu_session.sh served     # 1. the served path: phones over WebSockets into `autoglm-cloud serve`
#   bench/gpu_session.sh engine     # 2. the engine and the direct loop, same machine, same S (cloud_gpu_bench)
#   bench/gpu_session.sh attach     # 3. engine/direct tokens/s into the served records (no GPU work)
#   bench/gpu_session.sh all        # 1 + 2 + 3
#   bench/gpu_session.sh nogather   # 4. the served path at S = 8 / 64 with the engine's gather window off (A/B)
#   bench/gpu_session.sh extras     # 5. S = 64 through the engine: sampled (T 0.7, top-p 0.9) vs greedy, and a
#                                   #    4,096-token prompt arriving while 63 sessions decode (prefill stall)
#   bench/gpu_session.sh kvpool     # 6. S = 64 / 256 through the engine on the generic runner: the bf16 KV pool,
#                                   #    then the int8 one (--kv-cache-dtype int8), same workload, side by side
#   bench/gpu_session.sh all extras # several sections: run in the order given
#
# Workload: glm4v-9b-random split at 12 (28 cloud layers, bf16, random weights built on the GPU), 512-token
# prompts, 128 greedy tokens per session, S = 1 / 8 / 64 / 256 (SESSIONS to change), the served levels once
# per wire codec (CODECS, default int8-outlier,bf16: the realistic codec and the cheapest one to decode).
# All three stages took about 4 minutes on an H200 (the served one 2.5); outputs:
#   $OUT/cloud_served.json   bench/served_load.py records (docs/results/cloud_served.json is this file)
#   $OUT/served_spy.txt      py-spy collapsed stacks of the server at the largest S (summary in the JSON)
#   $OUT/cloud_gpu_engine.json  cloud_gpu_bench --through-engine (engine.summary: engine/direct tokens/s, with
#                            overlap scheduling and without it: engine.sessions / engine.sessions_sync)
#   $OUT/cloud_gpu_extras.json  cloud_gpu_bench --through-engine --sampling --prefill-stall at S = 64
#                            (engine.summary_sampling, engine.summary_prefill_stall; about 2 minutes)
#   $OUT/sampler_cuda.json   bench/sampler_bench.py --device cuda: the sampler's sort vs rejection path, S = 64
#   $OUT/cloud_gpu_kvpool_{bf16,int8}.json  cloud_gpu_bench --through-engine --generic-runner, bf16 pool vs
#                            --kv-cache-dtype int8 (engine.sessions: tokens/s; engine.build: kv_pool_bytes_per_block)
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
    # PRESET / LAYER / PROMPT / GEN change the workload (CPU smoke test of this section:
    #   OUT=/tmp/gs PRESET=wide-cpu LAYER=1 PROMPT=32 GEN=16 SESSIONS=1,8 CODECS=int8-outlier bench/gpu_session.sh served)
    timeout 580 python3 bench/served_load.py --preset "${PRESET:-glm4v-9b-random}" --layer "${LAYER:-12}" \
        --sessions "$SESSIONS" --prompt "${PROMPT:-512}" --gen "${GEN:-128}" --sweep-codecs "${CODECS:-int8-outlier,bf16}" \
        "${spy[@]}" --out "$OUT/cloud_served.json" 2>&1 | tee "$OUT/served.log"
}

engine() {
    timeout 580 python3 bench/cloud_gpu_bench.py --through-engine --sessions "$SESSIONS" --pool-sessions 256 \
        --skip-checks --skip-hf --out "$OUT/cloud_gpu_engine.json" 2>&1 | tee "$OUT/engine.log"
}

nogather() {  # ~1 min: is waiting for a decode cohort's states (AsyncEngine gather window) worth it here?
    timeout 580 python3 bench/served_load.py --preset "${PRESET:-glm4v-9b-random}" --layer "${LAYER:-12}" \
        --sessions "${AB_SESSIONS:-8,64}" --prompt "${PROMPT:-512}" --gen "${GEN:-128}" --sweep-codecs int8-outlier \
        --gather-max-ms 0 --out "$OUT/cloud_served_nogather.json" 2>&1 | tee "$OUT/served_nogather.log"
}

extras() {
    timeout 580 python3 bench/cloud_gpu_bench.py --through-engine --sessions 64 --pool-sessions 64 --max-context 8192 \
        --sampling --prefill-stall --skip-checks --skip-hf --out "$OUT/cloud_gpu_extras.json" 2>&1 | tee "$OUT/extras.log"
    # the sampler alone at S = 64 over the 151,552-token vocabulary: the sort it did before vs its rejection sampler
    timeout 120 python3 bench/sampler_bench.py --device cuda --repeats 50 --out "$OUT/sampler_cuda.json" 2>&1 \
        | tee -a "$OUT/extras.log"
}

kvpool() {  # the generic runner both times (the fast path reads a 16-bit pool only); the direct loop rides along
    local kv
    for kv in bf16 int8; do
        local pool=(--generic-runner); [ "$kv" = int8 ] && pool=(--kv-cache-dtype int8)
        timeout 580 python3 bench/cloud_gpu_bench.py --through-engine --sessions "${KV_SESSIONS:-64,256}" \
            --pool-sessions 256 --skip-checks --skip-hf "${pool[@]}" --out "$OUT/cloud_gpu_kvpool_$kv.json" 2>&1 \
            | tee "$OUT/kvpool_$kv.log"
    done
}

attach() {
    python3 bench/served_load.py --attach-engine "$OUT/cloud_gpu_engine.json" --to "$OUT/cloud_served.json"
}

[ $# -gt 0 ] || set -- all
for section in "$@"; do
    case "$section" in
        served) served ;;
        engine) engine ;;
        attach) attach ;;
        nogather) nogather ;;
        extras) extras ;;
        kvpool) kvpool ;;
        all) served; engine; attach ;;
        *) echo "usage: $0 [served|engine|attach|all|nogather|extras|kvpool]..." >&2; exit 2 ;;
    esac
done
