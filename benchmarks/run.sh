#!/usr/bin/env bash
# Named GPU benchmarks (and their GPU tests), each runnable on its own on a machine with NVIDIA GPUs.
#
#   bash benchmarks/run.sh BENCHMARK OUT
#
# Needs: the repository checked out with its packages importable (`uv sync`, or the workspace packages' wheels and
# their dependencies installed with pip: megatron-core, diffusers, liger-kernel, lerobot[dataset]; `uv build --wheel
# packages/X` builds ours, whose entry points register the backends and kernel providers), `nvidia-smi`, and the
# GPUs a benchmark names below. Optional: wheels in `.whl/` (and `.whl2/`, `.whl3/`) are installed into /tmp/site
# first, for a machine without network access or a preinstalled environment; `.tl/` holds TileLang for `tilelang`.
# The end-to-end pi05 benchmarks (e2e*) read a recorded PushT dataset at `.vla_data/pusht224`:
#   loongforge data prepare recipes/embodied/tiny_vla_pusht.yaml data.root=.vla_data/pusht224 \
#     data.repo_id=local/pusht224 data.record.episodes=10 data.record.max_steps=100 data.record.image_size=224
# Writes: OUT/gpu.txt (the GPUs), OUT/<step>.log for every step (the last 25 lines also on stdout), the tables a
# step writes with --out under OUT, and `vla_throughput.py`'s records (appended to
# benchmarks/results/vla_throughput_<policy>_<gpu>.jsonl, copied to OUT). Copy the numbers you keep into
# benchmarks/results/<what>_<model>_<hardware>_<date>.md (a new row in that day's table).
#
# Benchmarks (GPUs, about how long):
#   check  (1 GPU, ~5 min)  fused FP8 codec GPU test + codec timing; flce kernel vs eager/compile;
#                           pi05 model step, ours vs LeRobot's PI05Policy, batch 16
#   e2e    (1 GPU, ~9 min)  pi05 end to end on the recorded dataset (data loading included), ours then LeRobot's
#   fp8    (2 GPUs, ~8 min) delta-FP8 vs bf16 FSDP2 all-gather over 200 steps
#   compile (1 GPU, ~6 min) our pi05 step with train.compile (per-unit torch.compile), batch 16 and 32
#   step   (1 GPU, ~8 min)  pi05 model step ours vs LeRobot's (no profile), then ours with train.compile, batch 16
#   tilelang (1 GPU, ~8 min) TileLang sparse MLA GPU tests + benchmark rows, and the CUDA-graph training test; needs
#         .tl/ (tilelang 0.1.15 and z3-solver unpacked and xz-compressed: `tar -C <unzipped wheel> -cJf
#         .tl/tl.tar.xz .`, same for z3 -> .tl/z3.tar.xz, plus the apache-tvm-ffi 0.1.12 and torch-c-dlpack-ext wheels)
#   graphs (1 GPU, ~9 min)  ours with train.compile_mode reduce-overhead, then train.compile's host + kernel profile
#   e2e_graphs (1 GPU, ~9 min) pi05 end to end on the recorded dataset: ours with CUDA graphs, then LeRobot's loop
#   e2e_pair (1 GPU, ~6 min) the paired end-to-end measurement alone: LeRobot's loop, then ours with CUDA graphs
#   e2e_profile (1 GPU, ~9 min) AdamW kernel GPU tests, the embodied GPU tests of the optimizer, sync-free steps and
#                           CUDA-graph parity; ours end to end with CUDA graphs, then its host + kernel profile
#   b32    (1 GPU, ~8 min) pi05 model step at batch 32 with CUDA graphs; DiT-XL/2 ours vs diffusers (+compile)
#   dit    (1 GPU, ~6 min) DiT-XL/2: ours eager and with train.compile vs diffusers eager and + torch.compile
#   dit_gaf (1 GPU, ~5 min) DiT-XL/2: ours with train.compile, without and with kernels.grad_accum_fusion, vs
#                           diffusers + torch.compile
#   dit_profile (1 GPU, ~3 min) ours with train.compile, then a host + kernel profile of three steps
#   llm    (1 GPU, ~9 min)  fused CE + grad-accum fusion GPU tests; Llama-3.2-1B seq 4096 mbs 8: ours, HF +
#                           torch.compile, then ours with kernels.grad_accum_fusion (A/B)
#   kernels (1 GPU, ~7 min) kernel GPU tests, then every dense kernel's fwd+bwd vs eager / compile / Liger (--rep 200)
#   x2     (2 GPUs, ~8 min) CUDA graphs under ddp / zero1 (test_gpu_compile.py); tiny LLaVA on 1 GPU, pp 2, and
#                           tp 2 with the vision tower whole (parallel.components.vision.tp 1), nccl
#   flce   (1 GPU, ~5 min)  fused CE GPU tests, then its fwd+bwd rows (--rep 400) vs eager / compile / Liger
#   vlm    (1 GPU, ~8 min)  the Qwen-VL packed-vs-padded GPU tests; Qwen3-VL-8B shape ours (and ours with the plain
#                           output layer + CE, A/B) vs transformers eager and compiled, with a profile of our step,
#                           its CPU + CUDA trace (OUT/trace) and the stacks of its host-GPU syncs;
#                           Qwen2.5-VL-3B shape ours vs transformers eager
#   vlm_sft (1 GPU, ~3 min) packed vs padded SFT on variable-size image-text records at the Qwen2.5-VL-3B shape, and
#                           transformers eager on the padded rows
#   accum  (1 GPU, ~9 min)  fused CE GPU tests + its chunk-schedule variants (two-stream overlap), then the CUDA-graph
#                           training tests (one micro-batch and gradient accumulation)
# Every step has its own timeout and its own log under OUT, so a slow step costs only itself; the step timeouts of
# one benchmark add up to <= 520 s.
set -uo pipefail
shopt -s nullglob
phase=${1:?benchmark: check | e2e | fp8 | compile | step | graphs | tilelang | e2e_compile | accum | e2e_graphs | e2e_pair | e2e_profile | b32 | dit | dit_gaf | dit_profile | llm | kernels | x2 | flce | vlm | vlm_sft}
[[ $phase =~ ^(check|e2e|fp8|compile|step|graphs|tilelang|e2e_compile|accum|e2e_graphs|e2e_pair|e2e_profile|b32|dit|dit_gaf|dit_profile|llm|kernels|x2|flce|vlm|vlm_sft)$ ]] || { echo "unknown benchmark '$phase' (check | e2e | fp8 | compile | step | graphs | tilelang | e2e_compile | accum | e2e_graphs | e2e_pair | e2e_profile | b32 | dit | dit_gaf | dit_profile | llm | kernels | x2 | flce | vlm | vlm_sft)" >&2; exit 2; }
out=${2:?usage: bash benchmarks/run.sh BENCHMARK OUT}
mkdir -p "$out"
site=/tmp/site
wheels=(.whl/*.whl .whl2/*.whl)
[[ $phase == e2e* ]] && wheels+=(.whl3/*.whl)
if (( ${#wheels[@]} )); then  # optional: preinstalled environments need none
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "${wheels[@]}" > "$out/pip.log" 2>&1; then
    tail -5 "$out/pip.log"
    exit 3
  fi
fi
PYTHONPATH=$(ls -d packages/*/src | tr '\n' ':')$site
if [[ $phase == tilelang ]]; then
  [[ -f .tl/tl.tar.xz && -f .tl/z3.tar.xz ]] || { echo "tilelang: put .tl/tl.tar.xz and .tl/z3.tar.xz in place (see the header)" >&2; exit 3; }
  mkdir -p /tmp/tlsite && tar -xJf .tl/tl.tar.xz -C /tmp/tlsite && tar -xJf .tl/z3.tar.xz -C /tmp/tlsite \
    && python3 -m pip install -q --no-index --no-deps --no-cache-dir --target /tmp/tlsite .tl/*.whl >> "$out/pip.log" 2>&1 \
    || { echo "tilelang unpack/install failed" >&2; tail -5 "$out/pip.log"; exit 3; }
  PYTHONPATH=$PYTHONPATH:/tmp/tlsite
  python3 -c "import tilelang, z3; print('tilelang', tilelang.__version__)" 2>&1 | tail -3
fi
export PYTHONPATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"

step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2
  shift 2
  echo "=== $name (timeout ${secs}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name: exit $rc after $((SECONDS - t0))s"
  tail -n 25 "$out/$name.log"
  # vla_throughput.py appends its records to benchmarks/results/: a copy in OUT after each step
  find benchmarks/results -name 'vla_throughput_*.jsonl' -newer "$out/gpu.txt" -exec cp {} "$out"/ \; 2>/dev/null || true
}

case $phase in
  check)
    step fp8_delta_test 90 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-kernels/tests/test_gpu.py -k fp8_delta
    step fp8_codec 40 python3 benchmarks/fp8_allgather.py --codec-only
    step flce 130 python3 benchmarks/kernels_bench.py --only flce --out "$out/kernels_flce.md"
    step pi05_step 260 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 15 --warmup 4 \
      --profile
    ;;
  e2e)
    step pi05_e2e_ours 240 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 15 \
      --warmup 4 --only ours --data-root .vla_data/pusht224 --workers 8
    step pi05_e2e_lerobot 280 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 15 \
      --warmup 4 --only lerobot_e2e --data-root .vla_data/pusht224 --workers 8
    ;;
  e2e_compile)
    step pi05_e2e_ours_graphs 330 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 15 \
      --warmup 5 --only ours --compile --compile-mode reduce-overhead --data-root .vla_data/pusht224 --workers 8
    ;;
  e2e_graphs)
    step pi05_e2e_ours_graphs 270 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 12 \
      --warmup 5 --only ours --compile --compile-mode reduce-overhead --data-root .vla_data/pusht224 --workers 8
    step pi05_e2e_lerobot 250 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 12 \
      --warmup 3 --only lerobot_e2e --data-root .vla_data/pusht224 --workers 8
    step find_syncs 45 python3 benchmarks/find_syncs.py
    ;;
  e2e_pair)
    # NOTE: the paired end-to-end measurement alone, LeRobot's loop first (short), then ours with its cold compile
    step pi05_e2e_lerobot 130 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 12 \
      --warmup 3 --only lerobot_e2e --data-root .vla_data/pusht224 --workers 8
    step pi05_e2e_ours_graphs 450 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 12 \
      --warmup 5 --only ours --compile --compile-mode reduce-overhead --data-root .vla_data/pusht224 --workers 8
    ;;
  e2e_profile)
    # NOTE: the profiled run first: on a fresh machine its compile alone takes ~4 minutes
    step pi05_e2e_ours_profile 400 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 10 \
      --warmup 5 --only ours --compile --compile-mode reduce-overhead --data-root .vla_data/pusht224 --workers 8 \
      --profile
    step adamw_test 40 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-kernels/tests/test_gpu.py -k adamw
    step embodied_gpu_tests 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-embodied/tests/test_gpu_compile.py -k "never_wait or kernel_adamw or train_the_eager"
    ;;
  b32)
    step pi05_b32_graphs 250 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 32 --steps 10 \
      --warmup 5 --only ours --compile --compile-mode reduce-overhead
    step dit_xl2 280 python3 benchmarks/dit_throughput.py --preset dit-xl-2-256 --batch 64 --steps 20 --warmup 5 \
      --out "$out/dit_throughput.md"
    ;;
  dit)
    step dit_xl2 500 python3 benchmarks/dit_throughput.py --preset dit-xl-2-256 --batch 64 --steps 20 --warmup 5 \
      --out "$out/dit_throughput.md"
    ;;
  dit_gaf)
    step dit_xl2_gaf 330 python3 benchmarks/dit_throughput.py --preset dit-xl-2-256 --batch 64 --steps 15 \
      --warmup 5 --variants loongforge_compile,loongforge_compile_gaf,diffusers_compile --out "$out/dit_gaf.md"
    ;;
  dit_profile)
    step dit_xl2_profile 300 python3 benchmarks/dit_throughput.py --preset dit-xl-2-256 --batch 64 --steps 12 \
      --warmup 5 --variants loongforge_compile,diffusers_compile --profile --out "$out/dit_profile.md"
    ;;
  llm)
    step flce_tests 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-kernels/tests/test_gpu.py -k flce
    step grad_accum_test 40 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-megatron/tests/device_adapters/test_grad_accum_fusion.py -k cuda
    step llm_1b 450 python3 benchmarks/llm_throughput.py --preset llama3.2-1b --seq 4096 --steps 20 \
      --variants loongforge,hf_compile,loongforge_gaf --mbs loongforge=8,loongforge_gaf=8,hf_compile=8 \
      --out "$out/llm_throughput.md"
    ;;
  kernels)
    step kernel_tests 120 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-kernels/tests/test_gpu.py -k "not tilelang and not sparse_mla"
    step kernels_bench 390 python3 benchmarks/kernels_bench.py --only rms_norm,swiglu,rope,flce --rep 200 \
      --out "$out/kernels.md"
    ;;
  flce)
    step flce_tests 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-kernels/tests/test_gpu.py -k flce
    step flce_bench 300 python3 benchmarks/kernels_bench.py --only flce --rep 400 --out "$out/kernels_flce.md"
    ;;
  x2)
    step graphs_ddp 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-embodied/tests/test_gpu_compile.py -k ddp
    # NOTE: from one HF checkpoint: on GPU megatron draws a random init per TP rank / stage, so it depends on the layout
    python3 -c "import sys; from pathlib import Path; sys.path.insert(0, 'packages/loongforge-megatron/tests'); \
from test_llava import save_llava; save_llava(Path('/tmp/llava_hf'))" > "$out/llava_hf.log" 2>&1
    export NVIDIA_TF32_OVERRIDE=0
    llava=(python3 -m loongforge train recipes/vlm/llava_tiny.yaml accelerator=cuda train.steps=10 logging.interval=1
           model.preset=null model.hf=/tmp/llava_hf checkpoint.load=/tmp/llava_hf train.stage=cpt train.warmup_steps=0)
    step llava_1gpu 60 "${llava[@]}" --output /tmp/llava1
    step llava_pp2 70 "${llava[@]}" parallel.pp=2 --nproc 2 --output /tmp/llava_pp2
    step llava_tp2_vision_whole 70 "${llava[@]}" parallel.tp=2 "parallel.components={vision: {tp: 1}}" --nproc 2 \
      --output /tmp/llava_tp2
    ;;
  vlm)
    vlm=(python3 benchmarks/vlm_throughput.py --layers 4 --vision-depth 8 --batch 4 --seq 2048 --image 448 --steps 4
         --warmup 2)
    step gpu_test_qwen_vl 150 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" \
      packages/loongforge-megatron/tests/test_qwen_vl.py -k "gpu_packed and not moe"
    step vlm_qwen3_vl_8b 245 "${vlm[@]}" --model qwen3-vl-8b --profile --trace "$out/trace" \
      --variants loongforge,loongforge_plain_ce,hf_eager,hf_compile \
      --timeouts loongforge=60,loongforge_plain_ce=45,hf_eager=30,hf_compile=70
    step vlm_qwen2_5_vl_3b 105 "${vlm[@]}" --model qwen2.5-vl-3b --variants loongforge,hf_eager \
      --timeouts loongforge=60,hf_eager=30
    ;;
  vlm_sft)
    # NOTE: every step's records (image sizes, lengths) are new shapes: more steps than the synthetic rows
    step vlm_sft_qwen2_5_vl_3b 150 python3 benchmarks/vlm_throughput.py --layers 4 --vision-depth 8 --batch 4 \
      --seq 2048 --image 448 --steps 12 --warmup 4 --model qwen2.5-vl-3b --sft 96 \
      --variants loongforge_packed,loongforge_padded,hf_eager \
      --timeouts loongforge_packed=60,loongforge_padded=55,hf_eager=30
    ;;
  accum)
    step flce_tests 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-kernels/tests/test_gpu.py -k flce
    step flce_bench 190 python3 benchmarks/kernels_bench.py --only flce --flce-variants --rep 400 \
      --out "$out/kernels_flce.md"
    step graphs_tests 290 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-embodied/tests/test_gpu_compile.py
    ;;
  step)
    step pi05_step 220 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 15 --warmup 4
    step pi05_compile_b16 280 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 15 \
      --warmup 5 --only ours --compile
    ;;
  tilelang)
    step tilelang_tests 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" -x \
      packages/loongforge-kernels/tests/test_gpu.py -k "tilelang or sparse_mla"
    step sparse_mla_bench 150 python3 benchmarks/kernels_bench.py --only sparse_mla --no-compile --out "$out/kernels_sparse_mla.md"
    step graphs_test 200 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      packages/loongforge-embodied/tests/test_gpu_compile.py
    ;;
  graphs)
    step pi05_compile_graphs 300 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 10 \
      --warmup 5 --only ours --compile --compile-mode reduce-overhead
    step pi05_compile_profile 250 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 10 \
      --warmup 5 --only ours --compile --profile
    ;;
  compile)
    step pi05_compile_b16 260 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 16 --steps 15 \
      --warmup 5 --only ours --compile
    step pi05_compile_b32 260 python3 benchmarks/vla_throughput.py --policy lerobot_pi05 --batch 32 --steps 10 \
      --warmup 5 --only ours --compile
    ;;
  fp8)
    export NCCL_NVLS_ENABLE=0  # NVLink multicast off
    step fp8_allgather 520 python3 -m torch.distributed.run --standalone --nproc_per_node 2 \
      benchmarks/fp8_allgather.py --steps 200 --out "$out/fp8_allgather.md"
    ;;
esac
