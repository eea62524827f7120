#!/usr/bin/env bash
# On a CUDA machine with no network: a fresh round of the default draft's training data and a
# warm-started training run (models/train_draft.py, every stage on the GPU) in one call
# (~8 min with the defaults; a device call may run 10).
#   bash scripts/gpu_train_draft.sh                 (PYTHON=... picks python)
# Expects what scripts/gpu_engine.sh expects: .whl/*.whl (the gguf wheel) and the target's GGUF
# at .gpu/target.gguf (or its parts .gpu/target.gguf.part*, joined in name order).
# Budget (minutes): GEN_MIN (round 1 answers, 3.5), ROUND2_MIN (follow-up turns, 0.75),
# TRAIN_MIN (2); PROMPTS (round 1 prompts built, 20000), BATCH (answers sampled at once, 256),
# SEED (3: seeds 0-2 and 4-9 were sampled on the CPU, so these prompts and answers are new),
# ALPHA_WEIGHT (the total-variation loss's weight, 4, as the committed draft was trained).
# Trains on every committed seed (models/smollm2-draft-answers/, unpacked first; UNPACK=0 skips
# them, as a CPU smoke test should) and the new one.
# Writes under $OUT (default .cache/gpu-train): train.log, answers/s$SEED.jsonl.xz (the new
# seed's answers, packed) and draft/ (what `train_draft.py --stage export` writes: the layers,
# norm and fc, the kept vocabulary, the logit scale and the run's meta). Back on the CPU: copy
# answers/ into models/smollm2-draft-answers/ and draft/ over models/smollm2-draft/, run
# scripts/fetch_models.py, then python -m blockspec.models.eval_draft --compare <the previous draft>.
set -uo pipefail
out=${OUT:-.cache/gpu-train}
py=${PYTHON:-python3}
gguf=${GGUF:-.gpu/target.gguf}
models=${MODELS:-.gpu/models}
work=${WORK:-/tmp/draft-train}
device=${DEVICE:-cuda}  # DEVICE=cpu with tiny budgets: the CPU smoke test of this script
mkdir -p "$out"
exec > >(tee -a "$out/train.log") 2>&1
start=$SECONDS
# The code as the installed package blockspec (pyproject.toml maps the folders), without
# installing it: a folder whose blockspec/ links to this checkout's folders.
view=$(mktemp -d) && mkdir "$view/blockspec"
for d in service workers verification protos loadtest models; do ln -s "$PWD/$d" "$view/blockspec/$d"; done
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 PYTHONPATH=$view:$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$view:$PWD
fi
if [ ! -f "$gguf" ] && compgen -G "$gguf.part*" >/dev/null; then
    ls "$gguf".part* | sort | xargs cat >"$gguf"
fi
timeout "${CONVERT_TIMEOUT:-90}" "$py" scripts/gpu_models.py --gguf "$gguf" --out "$models" || exit 1
common=(--device "$device" --target "$models/smollm2-135m-instruct" --work "$work"
    --seed "${SEED:-3}" --batch "${BATCH:-256}" --threads "${THREADS:-8}")
stage() {  # stage NAME [flags]: one stage of train_draft.py, timed
    echo "== $1 ($((SECONDS - start)) s)"
    "$py" -m blockspec.models.train_draft --stage "$@" "${common[@]}" || exit 1
}
[ "${UNPACK:-1}" = 0 ] || stage unpack
stage generate --round 1 --prompts "${PROMPTS:-20000}" --gen-minutes "${GEN_MIN:-3.5}"
stage generate --round 2 --round2-prompts "${ROUND2_PROMPTS:-3000}" \
    --round2-minutes "${ROUND2_MIN:-0.75}"
stage pack --packed "$out/answers"
stage features --feature-batch "${FEATURE_BATCH:-64}"
# validation and calibration on the new seed's answers, which the warm start never trained on
stage train --init-draft models/smollm2-draft --train-minutes "${TRAIN_MIN:-2}" --bf16 \
    --val-seed "${SEED:-3}" \
    --batch-tokens "${BATCH_TOKENS:-16384}" --alpha-weight "${ALPHA_WEIGHT:-4}"
stage export --out "$out/draft"
echo "== done in $((SECONDS - start)) s"
