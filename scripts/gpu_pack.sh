#!/usr/bin/env bash
# Prepare, on a machine with PyPI and the embedded default installed (scripts/setup.sh), what scripts/gpu_check.sh needs on a
# bare, offline GPU machine that has torch, transformers, peft and accelerate but not trl / llguidance / datasets:
#   .whl/  wheels (trl, llguidance, datasets + dill + multiprocess, and this repo's pins of transformers and peft), ~19 MB
#   .gpu/tokenizer/  the SmolLM2-135M tokenizer (3.5 MB; the tiny random policy's vocabulary, so the spec grammar compiles)
#   .gpu/data/gsm8k/ the GSM8K mirror (4.9 MB; the testbed world's questions)
# Both folders are git-ignored (.git/info/exclude); pass them to the device tool's `carry`. Usage: bash scripts/gpu_pack.sh
set -euo pipefail
cd "$(dirname "$0")/.."
for d in .whl .gpu; do grep -qx "/$d/" .git/info/exclude 2>/dev/null || echo "/$d/" >> .git/info/exclude; done
rm -rf .whl .gpu && mkdir -p .whl .gpu/data
pip_dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "$@"; }
pin() { grep -E "^$1==" requirements.txt | head -1; }
pip_dl "$(pin trl)" "$(pin llguidance)" "$(pin datasets)" "$(pin transformers)" "$(pin peft)" dill==0.4.1 multiprocess==0.70.19
tok=$(.venv/bin/python -c "from lemon.policy.model import converted_dir; print(converted_dir('smollm2-135m'))")
mkdir -p .gpu/tokenizer && cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json "$tok"/chat_template.jinja .gpu/tokenizer/ 2>/dev/null || \
  cp "$tok"/tokenizer* .gpu/tokenizer/
data=$(.venv/bin/python -c "from lemon.benchmarks.data import default_data_dir; print(default_data_dir())")
cp -r "$data/gsm8k" .gpu/data/ && chmod -R u+w .gpu
du -sh .whl .gpu
