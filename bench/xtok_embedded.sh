#!/usr/bin/env bash
# Cross-tokenizer OPD on the embedded task (docs/cross_tokenizer.md): the character-level student
# trained by the embedded teacher (one tokenizer: the control) and by the embedded BPE teacher
# (a byte-level BPE of its own, teacher.tokenizer=own), k1 and rkl, over seeds; each final checkpoint
# evaluated, then `opdkit report` (clustered SEs) against the control of the same loss.
#
#   bash bench/xtok_embedded.sh OUT [SEEDS...]        # default seeds 0 1 2; runs params.yaml's budget
#
# OUT/teacher_bpe is built once (opdkit embedded --bpe-teacher, cached); a finished run or eval is
# reused. Arms: control_k1, xtok_k1, control_rkl, xtok_rkl (prefix map), xtok_rkl_exact (exact map).
set -euo pipefail
OUT=${1:?usage: bash bench/xtok_embedded.sh OUT [SEEDS...]}
shift
SEEDS=${*:-0 1 2}
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's opdkit
mkdir -p "$OUT/evals"
python -m opdkit embedded --bpe-teacher --out "$OUT/teacher_bpe" -p params.yaml --quiet
COMMON=(-p params.yaml -S tracking=none -S publish.every_steps=0 --quiet)
declare -A ARM=(
  [control_k1]="-S loss.name=k1"
  [xtok_k1]="-S loss.name=k1 -S teacher.tokenizer=own -S teacher.path=$OUT/teacher_bpe"
  [control_rkl]="-S loss.name=rkl"
  [xtok_rkl]="-S loss.name=rkl -S teacher.tokenizer=own -S teacher.path=$OUT/teacher_bpe"
  [xtok_rkl_exact]="-S loss.name=rkl -S teacher.tokenizer=own -S teacher.vocab_map=exact -S teacher.path=$OUT/teacher_bpe"
)
for ref in teacher teacher_bpe student; do  # the references: both teachers, the student before training
  model=$( [ "$ref" = teacher_bpe ] && echo "$OUT/teacher_bpe" || echo "opdkit/embedded/assets/$ref" )
  [ -f "$OUT/evals/$ref.json" ] || python -m opdkit eval --model "$model" --out "$OUT/evals/$ref.json" \
    --tag "arm=$ref" -p params.yaml --quiet
done
for seed in $SEEDS; do
  for arm in control_k1 xtok_k1 control_rkl xtok_rkl xtok_rkl_exact; do
    run="$OUT/runs/$arm/seed$seed"
    # shellcheck disable=SC2086
    [ -f "$run/run.json" ] && grep -q '"completed"' "$run/run.json" || \
      python -m opdkit train --out "$run" "${COMMON[@]}" -S seed="$seed" ${ARM[$arm]}
    ckpt=$(ls -d "$run"/checkpoints/checkpoint-* | sort -V | tail -1)
    ev="$OUT/evals/$arm/seed$seed.json"
    mkdir -p "$(dirname "$ev")"
    [ -f "$ev" ] || python -m opdkit eval --model "$ckpt" --out "$ev" --tag "arm=$arm" --tag "seed=$seed" \
      -p params.yaml --quiet
  done
done
for loss in k1 rkl; do
  python -m opdkit report "$OUT"/evals/control_$loss "$OUT"/evals/xtok_$loss* --baseline "control_$loss" \
    --out "$OUT/report_$loss.json" > /dev/null
done
python - "$OUT" <<'EOF'
import json, pathlib, sys
from opdkit.studies.report import format_report
out = pathlib.Path(sys.argv[1])
for ref in ("teacher", "teacher_bpe", "student"):
    e = json.loads((out / "evals" / f"{ref}.json").read_text())
    print(f"{ref:12s} accuracy {e['accuracy']:.4f} +- {e['stderr']:.4f} (clustered stderr)")
for loss in ("k1", "rkl"):
    r = json.loads((out / f"report_{loss}.json").read_text())
    print(format_report(r))
    for name, g in r["groups"].items():
        print(f"  {name}: mean within-eval stderr {g['mean_stderr']:.4f}, seeds {g['seeds']}")
EOF
