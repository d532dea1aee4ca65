#!/usr/bin/env bash
# Closed-loop PushT, end to end: record the scripted expert, train a recipe on it, then roll the trained policy and
# the random policy out on the same held-out seeds and print the success-rate difference with its 95% interval.
#
#   bash benchmarks/pusht_closed_loop.sh OUT [RECIPE [key=value ...]]
#
# RECIPE defaults to recipes/embodied/tiny_vla_pusht_state.yaml (one GPU, a few minutes). Needs the workspace's
# packages importable with the embodied backend's [eval] extra (`uv sync`; on a machine without network, their
# files on PYTHONPATH). Environment: STEPS=data,train,eval (any subset), TRAIN_TIMEOUT (s, default 300),
# EPISODES (default 50), WORKERS (eval worker processes, default: cores - 2), REPLAN (actions executed per chunk,
# default 8), VIDEOS (mp4s of the trained policy, default 2), RANDOM_BASELINE (0: skip the random policy's rollouts), LOONGFORGE (the CLI, default `loongforge`, else `python3 -m loongforge`), PYTHON (default python3).
# Writes OUT/data.log, OUT/train.log, OUT/run/ (the run, hf/ its exported policy), OUT/eval_trained/ and
# OUT/eval_random/ (summary.json, plot.png, videos), OUT/eval_*.log, and a row per policy appended to
# benchmarks/results/eval_pusht.md (RESULTS: another folder) with the date and hardware.
# SMOKE=1: on CPU, 2 recorded episodes, 2 training steps, 1 evaluation episode of 20 steps each: checks the script;
# records nothing unless RESULTS is set.
set -uo pipefail
out=${1:?usage: bash benchmarks/pusht_closed_loop.sh OUT [RECIPE [key=value ...]]}
recipe=${2:-recipes/embodied/tiny_vla_pusht_state.yaml}
overrides=("${@:3}")
steps=${STEPS:-data,train,eval}
episodes=${EPISODES:-50}
workers=${WORKERS:-$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))}
replan=${REPLAN:-8}
results=${RESULTS:-$(dirname "$0")/results}
max_steps=()
if [[ ${SMOKE:-0} == 1 ]]; then
  overrides+=(accelerator=cpu "data.root=$out/data" data.record.episodes=2 data.record.max_steps=20 train.steps=2
              train.warmup_steps=0 data.num_workers=0 checkpoint.save_interval=null)
  episodes=1 workers=1 VIDEOS=0 RANDOM_BASELINE=0 max_steps=(--max-steps 20 --device cpu)
  results=${RESULTS:-}
fi
if [[ -n ${LOONGFORGE:-} ]]; then read -ra lf <<< "$LOONGFORGE"
elif command -v loongforge > /dev/null; then lf=(loongforge)
else lf=(python3 -m loongforge); fi
mkdir -p "$out"
SECONDS=0
stamp() { echo "[pusht_closed_loop ${SECONDS}s] $*"; }

if [[ $steps == *data* ]]; then
  stamp "recording: ${lf[*]} data prepare $recipe ${overrides[*]}"
  "${lf[@]}" data prepare "$recipe" "${overrides[@]}" > "$out/data.log" 2>&1 || { tail -20 "$out/data.log"; exit 1; }
  tail -2 "$out/data.log"
fi

if [[ $steps == *train* ]]; then
  stamp "training: ${lf[*]} train $recipe --output $out/run ${overrides[*]}"
  timeout "${TRAIN_TIMEOUT:-300}" "${lf[@]}" train "$recipe" --output "$out/run" "${overrides[@]}" > "$out/train.log" 2>&1
  rc=$?
  grep -E "step +[0-9]+/|params|samples/s" "$out/train.log" | tail -8
  if [[ ! -f $out/run/hf/model.safetensors ]]; then
    # NOTE: stopped by TRAIN_TIMEOUT before the end: export the last resume checkpoint (its EMA weights) by
    # resuming it with train.steps at that step
    last=$(ls -d "$out"/run/checkpoints/step_* 2>/dev/null | sed 's/.*step_//' | sort -n | tail -1)
    [[ -n $last ]] || { stamp "training failed (exit $rc) before its first checkpoint"; tail -30 "$out/train.log"; exit 1; }
    stamp "training stopped (exit $rc); exporting the step-$last checkpoint"
    "${lf[@]}" train "$recipe" --output "$out/run" "${overrides[@]}" "train.steps=$last" >> "$out/train.log" 2>&1 \
      || { tail -30 "$out/train.log"; exit 1; }
  fi
fi

if [[ $steps == *eval* ]]; then
  stamp "evaluating the trained policy and the random policy: $episodes episodes, $workers workers"
  "${lf[@]}" eval "$out/run" --episodes "$episodes" --workers "$workers" --replan "$replan" --videos "${VIDEOS:-2}" \
    "${max_steps[@]}" --output "$out/eval_trained" > "$out/eval_trained.log" 2>&1 || { tail -20 "$out/eval_trained.log"; exit 1; }
  [[ ${RANDOM_BASELINE:-1} == 0 ]] || "${lf[@]}" eval "$recipe" "${overrides[@]}" --policy random --episodes "$episodes" --workers "$workers" \
    --videos 0 --output "$out/eval_random" > "$out/eval_random.log" 2>&1 || { tail -20 "$out/eval_random.log"; exit 1; }
  stamp "done"
  # NOTE: the benchmarks folder on the path: its harness owns the results tables
  PYTHONPATH="$(dirname "$0")${PYTHONPATH:+:$PYTHONPATH}" ${PYTHON:-python3} - "$out" "$recipe" "$results" <<'EOF'
import json, os, sys
from pathlib import Path

from loongforge_embodied.eval.wilson import difference_interval

import harness

out, recipe, results = sys.argv[1:4]
s = {k: json.load(open(f"{out}/eval_{k}/summary.json")) for k in ("trained", "random")
     if os.path.isfile(f"{out}/eval_{k}/summary.json")}
for k, v in s.items():
    lo, hi = v["success_ci95"]
    print(f"{k}: success {v['successes']}/{v['episodes']} = {v['success_rate']:.3f} [{lo:.3f}, {hi:.3f}], "
          f"mean max reward {v['mean_max_reward']:.3f}, mean return {v['mean_return']:.2f}, eval {v['eval_s']:.0f} s")
if results and s:
    import torch

    harness.append_rows(Path(results) / "eval_pusht.md", script="pusht_closed_loop.sh", hardware=harness.hardware(
        "cuda" if torch.cuda.is_available() else "cpu"), head=["recipe", "policy", "success", "95% interval",
                                                               "mean max reward"],
        rows=[[Path(recipe).name, k, f"{v['successes']}/{v['episodes']}", "[{:.3f}, {:.3f}]".format(*v["success_ci95"]),
               f"{v['mean_max_reward']:.3f}"] for k, v in s.items()])
if len(s) < 2:
    sys.exit(0)
d, lo, hi = difference_interval(s["trained"]["successes"], s["trained"]["episodes"], s["random"]["successes"],
                                s["random"]["episodes"])
print(f"success rate trained - random: {d:+.3f} (95% Newcombe interval [{lo:+.3f}, {hi:+.3f}])")
EOF
fi
