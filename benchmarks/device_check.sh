#!/usr/bin/env bash
# The device check (issue 53), for a lent GPU (or TPU): the compiled kernel tests, then
# single-step throughput at SmolLM2-135M's shape (random weights) with the overlapped loop
# and the synchronous one, HF transformers on the same chip beside them, at 32 and 256
# sequences x 128 tokens. Budget: <= 8 minutes (each part has its own timeout).
#
# Here (CPU, once):  bash benchmarks/device_check.sh --prepare   # the tokenizer into .gpu/
# On the device:     bash benchmarks/device_check.sh              # run tool: carry [".gpu"]
# Figures go to $OUT (the device tool's folder) or /tmp/device_check; record them in
# benchmarks/RESULTS.md with this command, the machine and the date.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
  python -c "from jaxinfer.loading.default import default_model_path; from jaxinfer.loading.gguf import load_gguf; \
load_gguf(default_model_path()).tokenizer.hf.save_pretrained('.gpu/tokenizer')" && echo "ready: .gpu/tokenizer"
  exit $?
fi
out="${OUT:-/tmp}/device_check"
mkdir -p "$out"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>/dev/null
  python -c "import jax, flax, transformers; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'transformers', transformers.__version__)"
  git rev-parse --short HEAD 2>/dev/null; } | tee "$out/machine.txt"
timeout 150 python -m pytest -q -p no:cacheprovider -o addopts="" -n 0 -k "(gpu or GPU) and not Interpret" \
  tests/test_pallas_attention.py tests/test_pallas_quantized_matmul.py 2>&1 | tail -5 | tee "$out/kernels.log"
for n in 32 256; do
  timeout 165 python benchmarks/accelerator_engine.py --tokenizer .gpu/tokenizer --attention pallas \
    --sections throughput --throughput-seqs "$n" --runs float32,float32_sync \
    --out "$out/throughput_$n.json" 2>&1 | grep -v Warning | tail -12 | tee "$out/throughput_$n.log"
done
