#!/usr/bin/env bash
# One GPU lease, the issue-15 measurements in priority order, every result under $OUT.
#
#   bench/gpu_session.sh served     # 1. the served path: phones over WebSockets into `autoglm-cloud serve`
#   bench/gpu_session.sh engine     # 2. the engine and the direct loop, same machine, same S (cloud_gpu_bench)
#   bench/gpu_session.sh attach     # 3. engine/direct tokens/s into the served records (no GPU work)
#   bench/gpu_session.sh all        # 1 + 2 + 3
#   bench/gpu_session.sh nogather   # 4. the served path at S = 8 / 64 with the engine's gather window off (A/B)
#   bench/gpu_session.sh extras     # 5. S = 64 through the engine: sampled (T 0.7, top-p 0.9) vs greedy, and a
#                                   #    4,096-token prompt arriving while 63 sessions decode (prefill stall: first
#                                   #    with the server's default budget and chunk cap, then per cap)
#   bench/gpu_session.sh kvpool     # 6. the fast path's 8-bit KV pools on CUDA (kernels and graphs vs the generic
#                                   #    runner), then S = 64 / 256 through the engine, the bf16 pool vs the int8
#                                   #    and int8v ones in one process, and the sessions x 4,096 each pool holds
#                                   #    (~6 minutes)
#   bench/gpu_session.sh profile    # 7. torch.profiler (CPU + CUDA) of the engine's slow steps: a mixed step (256 and
#                                   #    2,048 prompt positions beside 63 decode rows), S = 64 sampled vs greedy, the
#                                   #    sampler alone, and the host phases of a lockstep decode step (~3 minutes)
#   bench/gpu_session.sh served_mp  # 8. the served path with 1 front-end process vs WORKERS (default 6): one
#                                   #    server each, same levels, side by side (`serve --workers N`)
#   bench/gpu_session.sh mp         # 8 + 2 + attach to 8: the --workers comparison with the engine figures
#   bench/gpu_session.sh speculation  # 9. issue 12: the rig's speculation sweep, cloud drafts, the server on the GPU
#   bench/gpu_session.sh enginetime # 10. the served engine step and its wait for inputs (S = 8 / 64, 1,024 tokens),
#                                   #    then the engine bench at the same context (~5 minutes)
#   bench/gpu_session.sh ab         # 11. this tree's served path against COMPARE's (another checkout), both orders,
#                                   #    S = 64; then --step-codec same beside the default (~6 minutes)
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
#                            (engine.summary_sampling, engine.summary_prefill_stall: "default" = EngineConfig()'s
#                            budget and cap, then caps 0 / 2048 / 512 / 256; about 2 minutes)
#   $OUT/sampler_cuda.json   bench/sampler_bench.py --device cuda: the sampler's sort vs rejection path, S = 64
#   $OUT/cloud_gpu_kvpool.json  bench/kv_pool_gpu_bench.py: arms.{auto,int8,int8v}: sessions.<S>.tokens_per_s,
#                            pool_bytes_per_block, capacity_sessions (x 4,096 at 0.9 of the GPU), peak memory;
#                            arms.<int8|int8v>.vs_auto: the ratios. $OUT/kvpool_gpu_tests.log: the CUDA tests first
#   $OUT/engine_profile.json bench/engine_profile.py: per workload the top ops by device and CPU time, the named
#                            host ranges, step times without the profiler; $OUT/traces/*.json Chrome traces
#   $OUT/cloud_served_mp.json  served_load.py --workers 1,$WORKERS (records carry `workers`), int8-outlier
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
    # WORKERS front ends (default 6, as deploy/k8s runs it) and PROCS load processes (default 3); PRESET / LAYER /
    # PROMPT / GEN change the workload (CPU smoke test of this section:
    #   OUT=/tmp/gs PRESET=wide-cpu LAYER=1 PROMPT=32 GEN=16 SESSIONS=1,8 CODECS=int8-outlier WORKERS=2 PROCS=1 bench/gpu_session.sh served)
    timeout 580 python3 bench/served_load.py --preset "${PRESET:-glm4v-9b-random}" --layer "${LAYER:-12}" \
        --sessions "$SESSIONS" --prompt "${PROMPT:-512}" --gen "${GEN:-128}" --sweep-codecs "${CODECS:-int8-outlier,bf16}" \
        --workers "${WORKERS:-6}" --procs "${PROCS:-3}" "${spy[@]}" --out "$OUT/cloud_served.json" 2>&1 | tee "$OUT/served.log"
}

served_mp() {  # ~4 min on an H200: two server builds, S levels each, one codec (the realistic one)
    # WORKERS front ends + the engine process + PROCS load-generator processes share the host's cores (16 on the
    # H200 host: 6 + 2 + 8). LOOPS (default auto: uvloop where installed) runs every server once per event loop
    # (e.g. LOOPS=asyncio,uvloop); MP_WORKERS replaces the list of front-end counts. The engine process is
    # profiled at the largest level when py-spy is found (as in `served`). CPU smoke test of this section:
    #   OUT=/tmp/gs PRESET=wide-cpu LAYER=1 PROMPT=32 GEN=16 SESSIONS=1,8 WORKERS=2 PROCS=1 bench/gpu_session.sh served_mp
    local spy=()
    PATH="$PWD/.cache/served-load:$PATH"
    if command -v py-spy >/dev/null 2>&1; then spy=(--py-spy "$OUT/served_mp_spy.txt"); fi
    timeout 580 python3 bench/served_load.py --preset "${PRESET:-glm4v-9b-random}" --layer "${LAYER:-12}" \
        --sessions "$SESSIONS" --prompt "${PROMPT:-512}" --gen "${GEN:-128}" --sweep-codecs "${MP_CODEC:-int8-outlier}" \
        --workers "${MP_WORKERS:-1,${WORKERS:-6}}" --loops "${LOOPS:-auto}" --procs "${PROCS:-8}" "${spy[@]}" \
        --out "$OUT/cloud_served_mp.json" 2>&1 | tee "$OUT/served_mp.log"
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

kvpool() {  # ~6 min on the H200: the CUDA tests ~60 s, then one process: model once, one engine build per arm
    # (tuning and graphs each ~60 s), S = 64 / 256 on each. CPU smoke test of the bench (the tests skip without CUDA):
    #   OUT=/tmp/gs KV_PRESET=tiny-glm4v KV_SPLIT=1 KV_SESSIONS=2,4 KV_PROMPT=16 KV_GEN=8 bench/gpu_session.sh kvpool
    # KV_ARMS: the pools in order, ratios against the first (default auto,int8,int8v; add fp8: ~1.5 more minutes);
    # KV_TESTS=0 skips the CUDA tests (to keep one device call under 10 minutes with four arms)
    if [ "${KV_TESTS:-1}" != 0 ]; then
        timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -k cuda tests/cloud_server/test_fast_kv_quant.py \
            2>&1 | tee "$OUT/kvpool_gpu_tests.log" || true
    fi
    timeout 540 python3 bench/kv_pool_gpu_bench.py --preset "${KV_PRESET:-glm4v-9b-random}" --split "${KV_SPLIT:-12}" \
        --sessions "${KV_SESSIONS:-64,256}" --prompt "${KV_PROMPT:-512}" --gen "${KV_GEN:-128}" --kv "${KV_ARMS:-auto,int8,int8v}" \
        --out "$OUT/cloud_gpu_kvpool.json" 2>&1 | tee "$OUT/kvpool.log"
}

profile() {  # ~3.5 min on the H200 (engine build + tuning ~70 s); CPU smoke: see engine_profile.py
    # first the fast runner against the library runner on CUDA (prefill, a flat mixed step, decode graphs) and the
    # sampler's Triton pass against its torch formula, ~40 s
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -k "cuda" tests/cloud_server/test_fast_glm.py \
        tests/cloud_server/engine/test_sampler_kernels.py 2>&1 | tee "$OUT/profile_gpu_tests.log" || true
    timeout 280 python3 bench/engine_profile.py --out "$OUT/engine_profile.json" --trace-dir "$OUT/traces" 2>&1 \
        | tee "$OUT/profile.log"
}

speculation() {  # issue 12 on the deployment's cloud: the rig's speculation sweep with the server on the GPU
    # (SmolLM2 needs its GGUF, 98 MB: more than one device call carries, so it travels in two calls as .gg1/part and
    # .gg2/part, concatenated here; or set AUTOGLM_SMOLLM2_GGUF). The phones, their fronts and the link emulator run
    # on the host's CPU as on the rig. SPEC_RTTS (default 80, the goals' RTT; then 20,150) and SPEC_OUT name a part.
    if [ -z "${AUTOGLM_SMOLLM2_GGUF:-}" ]; then
        cat .gg1/part .gg2/part > /tmp/smollm2.gguf
        export AUTOGLM_SMOLLM2_GGUF=/tmp/smollm2.gguf
    fi
    timeout 580 python3 bench/speculation_bench.py --rtts "${SPEC_RTTS:-80}" --chat 4 --agent-tasks 2 --max-tokens 32 \
        --drafter cloud --cloud-device cuda --bundle /tmp/autoglm-spec-gpu/smollm2-split8 \
        --out "$OUT/${SPEC_OUT:-speculation_gpu_cloud}.json" 2>&1 | tee "$OUT/${SPEC_OUT:-speculation_gpu_cloud}.log"
}

attach() {
    python3 bench/served_load.py --attach-engine "$OUT/cloud_gpu_engine.json" --to "$OUT/cloud_served.json"
}

enginetime() {  # ~5 min: where the engine thread's time goes served (step p50 + input wait p50, busy share,
    # rebuilt batches: autoglm:engine_step_seconds / engine_input_wait_seconds / engine_forward_passes_total), 1,024
    # tokens so the steady decode dominates; the server under py-spy when found. Then the engine bench at the same
    # context (512 + 1,024) to set the served step beside the engine's own. CPU smoke test of this section:
    #   OUT=/tmp/et PRESET=tiny-glm4 LAYER=1 ET_SESSIONS=2 WORKERS=2 bench/gpu_session.sh enginetime
    local spy=()
    PATH="$PWD/.cache/served-load:$PATH"
    if command -v py-spy >/dev/null 2>&1; then spy=(--py-spy "$OUT/enginetime_spy.txt"); fi
    timeout 400 python3 bench/served_load.py --preset "${PRESET:-glm4v-9b-random}" --layer "${LAYER:-12}" \
        --sessions "${ET_SESSIONS:-8,64}" --prompt 512 --gen 1024 --sweep-codecs int8-outlier --workers "${WORKERS:-6}" \
        --procs 3 "${spy[@]}" --out "$OUT/cloud_served_enginetime.json" 2>&1 | tee "$OUT/enginetime.log"
    timeout 400 python3 bench/cloud_gpu_bench.py --preset "${PRESET:-glm4v-9b-random}" --split "${LAYER:-12}" --through-engine \
        --sessions "${ET_SESSIONS:-8,64}" --gen 1024 \
        --max-context 2048 --pool-sessions 64 --skip-checks --skip-hf --out "$OUT/cloud_gpu_engine_enginetime.json" 2>&1 \
        | tee "$OUT/engine_enginetime.log"
}

ab() {  # ~6 min: this tree's served path against another checkout's (COMPARE: e.g. a `git archive` of the tree before
    # a change, under the ignored .cache/), S = 64 (AB_SESSIONS), 6 workers, 3 load processes: once with that tree's
    # server first, once with this tree's first; then this tree with the decode steps in the prompt's codec
    # (--step-codec same) beside its default (policy: fp16 steps, as EdgeClient sends them). CPU smoke test:
    #   OUT=/tmp/ab PRESET=tiny-glm4 LAYER=1 AB_SESSIONS=2 PROMPT=16 GEN=8 COMPARE=/tmp/old bench/gpu_session.sh ab
    : "${COMPARE:?set COMPARE to the other checkout}"
    local common=(--preset "${PRESET:-glm4v-9b-random}" --layer "${LAYER:-12}" --sessions "${AB_SESSIONS:-64}"
                  --prompt "${PROMPT:-512}" --gen "${GEN:-256}" --sweep-codecs int8-outlier --workers 6 --procs 3)
    timeout 200 python3 bench/served_load.py "${common[@]}" --compare-root "$COMPARE" --out "$OUT/ab/served_ab.json" \
        2>&1 | tee "$OUT/ab.log"
    timeout 200 python3 bench/served_load.py "${common[@]}" --server-root "$COMPARE" --compare-root "$PWD" \
        --out "$OUT/ab/served_ab_2.json" 2>&1 | tee -a "$OUT/ab.log"
    timeout 150 python3 bench/served_load.py "${common[@]}" --step-codec same --out "$OUT/ab/served_step_same.json" \
        2>&1 | tee -a "$OUT/ab.log"
}

attach_mp() {
    python3 bench/served_load.py --attach-engine "$OUT/cloud_gpu_engine.json" --to "$OUT/cloud_served_mp.json"
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
        profile) profile ;;
        served_mp) served_mp ;;
        attach_mp) attach_mp ;;
        speculation) speculation ;;
        enginetime) enginetime ;;
        ab) ab ;;
        mp) served_mp; engine; attach_mp ;;
        all) served; engine; attach ;;
        *) echo "usage: $0 [served|engine|attach|all|nogather|extras|kvpool|profile|served_mp|attach_mp|mp|speculation|enginetime|ab]..." >&2
           exit 2 ;;
    esac
done
