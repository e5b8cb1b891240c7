#!/usr/bin/env bash
# What bench/s1_speed.sh needs carried besides .lane (bench/lane_assets.sh), made here (a CPU machine with pip):
#   .speed/static_main.py  the static-cache decoder as it was before issue 26 (the profile's "before")
#   .speed/main/opdkit     the kit as it was before (the S1 table's "today's default"; SPEED_BASE, default 6d586c5)
#   .whl/                  TRL 1.16.0 and what the device lacks for it: datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19
# .speed/ and .whl/ are git-ignored: carry them (run(carry=[".lane", ".speed", ".whl"]), ~11 MB).
# Run from the repository root: bash bench/speed_assets.sh
set -euo pipefail
cd "$(dirname "$0")/.."
base=$(git rev-parse "${SPEED_BASE:-6d586c5}")  # issue 26's starting point: main after issue 25's merge
rm -rf .speed && mkdir -p .speed/main
git show "$base:opdkit/engines/static.py" > .speed/static_main.py
git archive "$base" opdkit | tar -x -C .speed/main
echo "$base" > .speed/BASE
P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download -q --no-deps $P -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
du -sh .speed .whl
