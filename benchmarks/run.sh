#!/usr/bin/env bash
# Run one named benchmark (its GPU tests first, then the benchmark) on a machine with NVIDIA GPUs.
#
#   bash benchmarks/run.sh NAME OUT
#
# NAME: llm | moe | dsa | fp8 | vlm | dit | wan | qwen_image | vla | smolvla | groot | fastwam | eval | kernels | convert | scaling | hetero_vlm   (benchmarks/README.md says what each measures)
# OUT:  a folder; gets gpu.txt (the GPUs), <step>.log for every step (its last 25 lines also on stdout) and the
#       step's report (<step>.md). Each benchmark also appends its rows to benchmarks/results/<script>.md.
#
# Needs the workspace's packages importable (`uv sync --all-packages`, then run under `uv run`; or them and their
# dependencies installed with pip). Wheels in `.whl/` are installed into /tmp/site first, for a machine without a
# package index. `vla` also runs LeRobot's end-to-end loop when VLA_DATA names a recorded PushT dataset:
#   loongforge data prepare recipes/embodied/tiny_vla_pusht.yaml data.root=.vla_data/pusht224 \
#     data.repo_id=local/pusht224 data.record.episodes=10 data.record.max_steps=100 data.record.image_size=224
# Every step has its own timeout, so a slow step costs only itself.
set -uo pipefail
shopt -s nullglob
names="llm | moe | dsa | fp8 | vlm | dit | wan | qwen_image | vla | smolvla | groot | fastwam | eval | kernels | convert | scaling | hetero_vlm"
name=${1:?usage: bash benchmarks/run.sh NAME OUT   (NAME: $names)}
out=${2:?usage: bash benchmarks/run.sh NAME OUT}
[[ " ${names//|/ } " == *" $name "* ]] || { echo "unknown benchmark '$name' ($names)" >&2; exit 2; }
mkdir -p "$out"
site=/tmp/site
wheels=(.whl/*.whl)
if (( ${#wheels[@]} )); then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "${wheels[@]}" > "$out/pip.log" 2>&1 || { tail -5 "$out/pip.log"; exit 3; }
fi
PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':')$site
export PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
gpus=$(wc -l < "$out/gpu.txt")

step() {  # step NAME SECONDS CMD...
  local step=$1 secs=$2
  shift 2
  echo "=== $step (timeout ${secs}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" > "$out/$step.log" 2>&1
  echo "=== $step: exit $? after $((SECONDS - t0))s"
  tail -n 25 "$out/$step.log"
}
gpu_tests() {  # gpu_tests SECONDS PATH [-k EXPR]: the GPU tests (marker gpu) of PATH
  local secs=$1 path=$2
  shift 2
  step "gpu_tests_$(basename "$path" .py)" "$secs" python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    "$path" "$@"
}

case $name in
  llm)
    gpu_tests 60 packages/loongforge-kernels/tests/test_gpu.py -k flce
    gpu_tests 40 packages/loongforge-megatron/tests/device_adapters/test_grad_accum_fusion.py
    step llm_throughput 450 python3 benchmarks/llm_throughput.py --preset llama3.2-1b --seq 4096 --steps 20 \
      --variants loongforge,hf_compile,loongforge_gaf --mbs loongforge=8,loongforge_gaf=8,hf_compile=8 \
      --out "$out/llm_throughput.md"
    ;;
  moe)
    gpu_tests 90 packages/loongforge-megatron/tests/test_grouped_experts.py
    if (( gpus >= 2 )); then  # expert replicas and the overlapped all-to-all under EP 2 (NCCL)
      export NCCL_NVLS_ENABLE=0  # NVLink multicast off
      gpu_tests 300 packages/loongforge-megatron/tests/test_moe_replicas.py
    fi
    step moe_throughput 450 python3 benchmarks/moe_throughput.py --preset qwen3-30b-a3b --layers 4 --seq 4096 \
      --mbs 2 --steps 20 --variants loongforge,hf_grouped_mm,hf_grouped_mm_compile --timeout 140 \
      --out "$out/moe_throughput.md"
    ;;
  dsa)
    gpu_tests 120 packages/loongforge-megatron/tests/test_sparse_attention_gpu.py
    # NOTE: sparse vs dense at 8k / 16k / 32k; on one H100 the dense 2-layer model at 32k runs 8 steps in ~40 s
    for seq in 8192 16384 32768; do
      step "dsa_throughput_$seq" 330 python3 benchmarks/dsa_throughput.py --preset deepseek-v3.2-lite --layers 2 \
        --seq "$seq" --steps 8 --warmup 3 --variants loongforge_sparse,loongforge_dense --timeout 150 \
        --out "$out/dsa_throughput_$seq.md"
    done
    ;;
  fp8)
    gpu_tests 90 packages/loongforge-kernels/tests/test_gpu_fp8.py
    step fp8_throughput 480 python3 benchmarks/fp8_throughput.py --preset llama3.2-1b --layers 16 --seq 8192 \
      --steps 20 --variants ours_bf16,ours_fp8_tensorwise,ours_fp8_rowwise,torchao_tensorwise --timeout 115 \
      --out "$out/fp8_throughput.md"
    if (( gpus >= 2 )); then
      export NCCL_NVLS_ENABLE=0  # NVLink multicast off
      step fp8_allgather 240 python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
        benchmarks/fp8_allgather.py --steps 100 --out "$out/fp8_allgather.md"
    else
      step fp8_codec 60 python3 benchmarks/fp8_allgather.py --codec-only
    fi
    ;;
  vlm)
    gpu_tests 150 packages/loongforge-megatron/tests/test_qwen_vl.py -k "packed and not moe"
    vlm=(python3 benchmarks/vlm_throughput.py --layers 4 --vision-depth 8 --batch 4 --seq 2048 --image 448)
    step vlm_qwen3_vl_8b 200 "${vlm[@]}" --model qwen3-vl-8b --steps 6 --warmup 2 \
      --variants loongforge,hf_eager,hf_compile --timeout loongforge=60,hf_eager=30,hf_compile=70 \
      --out "$out/vlm_qwen3_vl_8b.md"
    step vlm_sft_qwen2_5_vl_3b 160 "${vlm[@]}" --model qwen2.5-vl-3b --steps 16 --warmup 4 --sft 96 \
      --variants loongforge_packed,loongforge_padded,hf_eager \
      --timeout loongforge_packed=60,loongforge_padded=55,hf_eager=30 --out "$out/vlm_sft_qwen2_5_vl_3b.md"
    ;;
  dit)
    step dit_throughput 500 python3 benchmarks/dit_throughput.py --preset dit-xl-2-256 --batch 64 --steps 20 \
      --warmup 5 --out "$out/dit_throughput.md"
    ;;
  wan)
    wan=(python3 benchmarks/wan_throughput.py --batch 1 --steps 10 --warmup 3)
    # NOTE: on one H100, ours at 1.3B x 32,760 tokens builds and runs 10 steps in about a minute; diffusers'
    # compiled model had not finished its first steps after 150 s
    step wan_t2v_1_3b 840 "${wan[@]}" --preset wan2.1-t2v-1.3b --recompute full \
      --timeout loongforge=130,loongforge_compile=240,diffusers_eager=150,diffusers_compile=300 \
      --out "$out/wan_t2v_1_3b.md"
    step wan_ti2v_5b 300 "${wan[@]}" --preset wan2.2-ti2v-5b --layers 10 --latent 21,44,80 \
      --variants loongforge,diffusers_compile --timeout 140 --out "$out/wan_ti2v_5b.md"
    ;;
  qwen_image)
    step qwen_image 720 python3 benchmarks/qwen_image_throughput.py --layers 8 --batch 2 --steps 10 --warmup 3 \
      --timeout 170 --out "$out/qwen_image_throughput.md"
    ;;
  vla)
    gpu_tests 290 packages/loongforge-embodied/tests/test_gpu_compile.py
    step vla_step 250 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 15 --warmup 4
    if [[ -n ${VLA_DATA:-} ]]; then
      step vla_e2e_lerobot 150 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 12 \
        --warmup 3 --only lerobot_e2e --data-root "$VLA_DATA" --workers 8
      step vla_e2e_ours 300 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 12 \
        --warmup 5 --only ours --compile --compile-mode reduce-overhead --data-root "$VLA_DATA" --workers 8
    fi
    ;;
  smolvla)
    step smolvla_throughput 500 python3 benchmarks/smolvla_throughput.py --batch 64 --steps 20 --warmup 5 \
      --timeout 240 --out "$out/smolvla_throughput.md"
    ;;
  groot)  # GR00T N1.7 at its published size (backbone frozen); the towers and its random init written first
    step groot_throughput 900 python3 benchmarks/policy_throughput.py --policy lerobot_groot --batch 32 --steps 20 \
      --warmup 5 --timeout 360 --out "$out/groot_throughput.md"
    ;;
  fastwam)  # FastWAM at its published size: the action expert (video expert frozen), then all of it at 8 layers
    fastwam=(python3 benchmarks/policy_throughput.py --policy lerobot_fastwam --steps 15 --warmup 4)
    step fastwam_action 1000 "${fastwam[@]}" --batch 8 --timeout 420 --out "$out/fastwam_action.md"
    step fastwam_all_8_layers 800 "${fastwam[@]}" --batch 8 --train all --layers 8 --timeout 330 \
      --out "$out/fastwam_all_8_layers.md"
    ;;
  eval)
    step eval_pusht 560 bash benchmarks/pusht_closed_loop.sh "$out/eval"
    ;;
  kernels)
    gpu_tests 120 packages/loongforge-kernels/tests/test_gpu.py -k "not tilelang and not sparse_mla"
    step kernels_bench 390 python3 benchmarks/kernels_bench.py --only rms_norm,swiglu,rope,flce,moe --rep 200 \
      --out "$out/kernels_bench.md"
    ;;
  scaling)
    export NCCL_NVLS_ENABLE=0  # NVLink multicast off
    step scaling 1200 python3 benchmarks/scaling.py --preset llama3.2-1b --seq 4096 --mbs 2 --steps 12 --warmup 4 \
      --timeout 140 --out "$out/scaling.md"
    ;;
  hetero_vlm)  # the modelled 8-GPU rows need no GPU; pass --vit-tflops / --lm-tflops from one GPU's vlm rows
    step hetero_vlm 900 python3 benchmarks/hetero_vlm.py --out "$out/hetero_vlm.md"
    ;;
  convert)
    step checkpoint_convert_memory 400 python3 benchmarks/checkpoint_convert_memory.py --workdir "$out/convert"
    ;;
esac
