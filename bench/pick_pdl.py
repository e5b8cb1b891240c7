"""Which ``rollout.decode_pdl`` setting ran S1 faster in ``bench/device_calls.sh p2``'s runs.

    python bench/pick_pdl.py OUT/runs.jsonl   # prints "-S rollout.decode_pdl=true" or nothing

Reads the runs named ``s1_<tokens>_pdl_<true|false>`` (``bench/real_lane.py train`` rows), takes each run's median
seconds per step over steps 2 on (the differences of ``elapsed_s``), writes them to stderr, and prints the option
for phase c's S1 runs: true only where every run finished and true was faster at every length.
"""

import json
import statistics
import sys


def step_seconds(rows: list[dict]) -> float | None:
    """Median seconds per step over steps 2 on (step 1 holds the start-up and the first compilation)."""
    t = [r["elapsed_s"] for r in sorted(rows, key=lambda r: r["step"]) if r.get("elapsed_s") is not None]
    diffs = [b - a for a, b in zip(t, t[1:])]
    return statistics.median(diffs) if diffs else None


def main(path: str) -> int:
    runs = [json.loads(ln) for ln in open(path) if ln.strip()]
    med: dict[tuple[str, str], float | None] = {}
    for r in runs:
        parts = r.get("name", "").split("_")
        if r.get("what") == "train" and len(parts) == 4 and parts[2] == "pdl":
            med[(parts[1], parts[3])] = step_seconds(r["rows"]) if r.get("rc") == 0 else None
            print(f"{r['name']}: rc={r.get('rc')} median s/step {med[(parts[1], parts[3])]}", file=sys.stderr)
    lengths = {t for t, _ in med}
    faster = bool(lengths) and all(
        med.get((t, "true")) is not None and med.get((t, "false")) is not None
        and med[(t, "true")] < med[(t, "false")] for t in lengths)
    print("-S rollout.decode_pdl=true" if faster else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
