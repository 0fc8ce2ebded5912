#!/usr/bin/env bash
# The checks a session runs on a lent CUDA machine, in one go (docs/results.md, "On a GPU"):
# tests/gpu, the HL1 breakdown on one GPU (plain DDP against OmniLearn's loop), a one-GPU `omnilearn bench` at HL1,
# the default job on the GPU, and the refusal of two workers on one GPU. Results go to $OUT (default /tmp/gpu_out).
# A missing mnist1d travels as a wheel in .whl/ (pip download --no-deps -d .whl mnist1d).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMNILEARN_CACHE=/tmp/omnilearn_cache
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/device.txt"
echo "== tests/gpu"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log"
echo "== HL1 breakdown, 1 GPU (the default job's model and batch; plain DDP and OmniLearn interleaved)"
timeout 120 torchrun --standalone --nproc-per-node 1 tools/hl1_breakdown.py --device cuda --blocks 50 --steps 40 2>&1 \
    | grep -v '^step ' | tee "$OUT/hl1_cuda.log"
if [ -d .gpu_before/src ]; then  # a baseline tree (git archive <commit> src | tar -x -C .gpu_before), same tool
    echo "== HL1 breakdown, 1 GPU, the baseline tree's omnilearn"
    PYTHONPATH=$PWD/.gpu_before/src${PYTHONPATH#$PWD/src} timeout 120 torchrun --standalone --nproc-per-node 1 \
        tools/hl1_breakdown.py --device cuda --blocks 50 --steps 40 2>&1 | grep -v '^step ' | tee "$OUT/hl1_cuda_before.log"
fi
echo "== HL1 breakdown, 1 GPU, A/A control (both loops plain DDP: the ratio's own spread)"
timeout 120 torchrun --standalone --nproc-per-node 1 tools/hl1_breakdown.py --device cuda --blocks 50 --steps 40 --aa 2>&1 \
    | grep -v '^step ' | tee "$OUT/hl1_cuda_aa.log"
echo "== HL1 breakdown, 1 GPU, meetings 10x rarer (control interval 150)"
timeout 120 torchrun --standalone --nproc-per-node 1 tools/hl1_breakdown.py --device cuda --blocks 50 --steps 40 \
    --control-interval 150 2>&1 | grep -v '^step ' | tee "$OUT/hl1_cuda_ci150.log"
echo "== bench HL1, 1 GPU"
[ -n "${SKIP_BENCH:-}" ] || timeout 150 python3 -m omnilearn bench --device cuda --workers 1 --speeds HL1 --arms uniform,model --repeats 4 \
    --steps 200 --no-plots --out /tmp/bench_cuda --overwrite 2>&1 | tail -8 | tee "$OUT/bench_cuda.log"
echo "== the default job on the GPU"
timeout 90 python3 -m omnilearn train --device cuda --workers 1 --out /tmp/train_cuda --overwrite 2>&1 \
    | tail -6 | tee "$OUT/train_cuda.log"
echo "== two workers on one GPU (a refusal)"
python3 -m omnilearn train --device cuda --workers 2 --out /tmp/train_cuda2 --overwrite >"$OUT/refusal.log" 2>&1
echo "exit $?" >>"$OUT/refusal.log"
cat "$OUT/refusal.log"
