#!/bin/bash
# Single-GPU smoke test: every trainer a few steps in bf16 with SDPA attention, gradient checkpointing on
# and off; one line per run with the mean step time and the peak GPU memory.
#
#   bash launch/smoke_gpu.sh                       # tiny local models (no download), all trainers
#   MODEL=Qwen/Qwen2.5-0.5B-Instruct bash launch/smoke_gpu.sh sft dpo     # a real model, some trainers
#   bash launch/smoke_gpu.sh grpo_vllm grpo_vllm_server   # GRPO with use_vllm: colocated (sleep mode on), a server
#
# Env: MODEL (default: each tiny recipe's model), PYTHON (default python), STEPS (default 3),
#      OUT (default a temporary directory). Exit code: the number of failed runs.
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
STEPS=${STEPS:-3}
OUT=${OUT:-$(mktemp -d)}
TRAINERS=("$@")
[ ${#TRAINERS[@]} -eq 0 ] && TRAINERS=(sft reward dpo ppo grpo)
export WANDB_MODE=offline HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}

# SMOKE_ALLOW_CPU=1 runs the same commands on the CPU (peak memory then reads 0): a check of the script.
[ -n "${SMOKE_ALLOW_CPU:-}" ] || "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
    || { echo "smoke_gpu: no CUDA device visible to $PYTHON"; exit 1; }

# Runs a launch script in-process and reports peak memory: torch's allocator counters only see their own
# process, so the measurement has to happen inside it (atexit also fires on the scripts' normal return).
RUNNER='
import atexit, runpy, sys, time, torch
t0 = time.time()
def report():
    print(f"SMOKE peak_gib={torch.cuda.max_memory_allocated() / 2**30:.2f} wall_s={time.time() - t0:.1f}")
atexit.register(report)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
'

# grpo_vllm / grpo_vllm_server: GRPO with vLLM (needs vLLM in $PYTHON's environment); the server variant starts
# `rl vllm-serve` on the model first and stops it after
VLLM_MODEL=${MODEL:-tiny:llama-hd64}

steps_for() {  # every trainer counts max_steps in optimizer steps (PPO too: a round is num_ppo_epochs x minibatches steps)
    echo "max_steps=$STEPS"
}

failed=0
for trainer in "${TRAINERS[@]}"; do
    extra=()
    server_pid=
    case "$trainer" in
        grpo_vllm) extra=(use_vllm=true vllm_enable_sleep_mode=true model_name="$VLLM_MODEL"); trainer=grpo ;;
        grpo_vllm_server)
            "$PYTHON" -m rl.rollout.vllm_server --model "$VLLM_MODEL" --port 8011 --group-port 51311 \
                --max-model-len 1024 >"$OUT/vllm-server.log" 2>&1 &
            server_pid=$!
            extra=(use_vllm=true vllm_mode=server vllm_server_port=8011 vllm_group_port=51311 model_name="$VLLM_MODEL")
            trainer=grpo ;;
    esac
    recipe=recipes/tiny/$trainer.yaml
    if [ ! -f "launch/$trainer.py" ] || [ ! -f "$recipe" ]; then
        printf "%-7s %-8s SKIP (no launch/%s.py or %s)\n" "$trainer" "-" "$trainer" "$recipe"
        continue
    fi
    for gc in false true; do
        out=$OUT/$trainer-gc$gc
        args=(--config "$recipe" dtype=bfloat16 attn_implementation=sdpa gradient_checkpointing=$gc
              "$(steps_for "$trainer")" output_dir="$out" "report_to=[jsonl]" logging_steps=1)
        [ -n "${MODEL:-}" ] && args+=(model_name="$MODEL")
        args+=("${extra[@]}")
        [ ${#extra[@]} -gt 0 ] && out=$out-vllm && args+=(output_dir="$out")
        log=$out.log
        mkdir -p "$out"
        if "$PYTHON" -c "$RUNNER" "launch/$trainer.py" "${args[@]}" >"$log" 2>&1; then
            peak=$(grep -o 'peak_gib=[0-9.]*' "$log" | tail -1 | cut -d= -f2)
            # mean step time from the metrics (step_time when the trainer logs it, else wall / steps)
            step=$("$PYTHON" - "$out/metrics.jsonl" "$log" "$STEPS" <<'EOF'
import json, re, sys
rows = []
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except OSError:
    pass
times = [r["step_time"] for r in rows if "step_time" in r]
if times:
    print(f"{sum(times) / len(times):.3f}")
else:
    wall = re.findall(r"wall_s=([0-9.]+)", open(sys.argv[2]).read())
    print(f"{float(wall[-1]) / max(1, len(rows) or int(sys.argv[3])):.3f}*" if wall else "?")
EOF
)
            printf "%-7s gc=%-5s ok    step %8ss  peak %6s GiB\n" "$trainer" "$gc" "$step" "$peak"
        else
            failed=$((failed + 1))
            printf "%-7s gc=%-5s FAIL  (%s: %s)\n" "$trainer" "$gc" "$log" "$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-120)"
        fi
    done
    [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
done
echo "smoke_gpu: $failed failed; logs and outputs in $OUT (* = wall time / steps, includes loading)"
exit $failed
