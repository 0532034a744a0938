"""Replays traces with `steppool replay --json` and checks each against the replay targets.

For every trace, the strategy `steppool replay` recommends must
  * peak:   reserve less over the whole run than `default-pool` and than the better of the two
            models of PyTorch's allocator (`torch-caching`, `torch-expandable`);
  * cap:    complete on a device no larger than the smallest on which any of those three does;
  * steady: reserve, from the second step on, at most 1.03 x the offline limit plus one 2 MiB
            granule on static shapes, 1.08 x plus one granule otherwise.
A trace has static shapes when its file name contains one of the `--static` words (default:
`static`, as the recorder names its static BERT). A peak target a baseline makes impossible is
marked "at the floor": that baseline reserves no more than the peak of live bytes rounded up to
the 2 MiB granule, which no allocator can go below (it still counts as a miss). One line per
trace, then the count of misses and how many of them are only at the floor.

    cargo build --release -p steppool-cli
    python3 benches/traces/targets.py cli/tests/data/*.csv cli/tests/data/recorded/*.csv \
        cli/tests/data/recorded/*.jsonl
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

MIB = 1 << 20
GRANULE = 2 * MIB
BASELINES = ("default-pool", "torch-caching", "torch-expandable")


def replay(binary, trace, out_dir):
    """The `--json` report of one trace, or the error `steppool` printed."""
    report = os.path.join(out_dir, os.path.basename(trace) + ".replay.json")
    done = subprocess.run([binary, "replay", trace, "--json", report], capture_output=True, text=True)
    if done.returncode != 0:
        return None, done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
    with open(report) as f:
        return json.load(f), None


def misses(report, static):
    """The targets the recommended strategy misses, and a summary of its figures."""
    results = {r["strategy"]: r for r in report["results"]}
    chosen = results[report["recommended"]]
    limit = report["limit_bytes"]
    torch = min(results[name]["peak_reserved_bytes"] for name in BASELINES[1:])
    floor = -(-report["peak_live_bytes"] // GRANULE) * GRANULE
    at_floor = lambda bytes: " at the floor" if bytes <= floor else ""
    missed = []
    pool = results["default-pool"]["peak_reserved_bytes"]
    if chosen["strategy"] == "default-pool" or chosen["peak_reserved_bytes"] >= pool:
        missed.append(f"peak (default-pool{at_floor(pool)})")
    if chosen["peak_reserved_bytes"] >= torch:
        missed.append(f"peak (torch{at_floor(torch)})")
    smallest = min(results[name]["min_capacity_bytes"] for name in BASELINES if results[name]["min_capacity_bytes"])
    if chosen["min_capacity_bytes"] is None or chosen["min_capacity_bytes"] > smallest:
        missed.append("cap")
    factor = 1.03 if static else 1.08
    steady = chosen["steady_peak_reserved_bytes"]
    if steady is None:
        missed.append("steady (one step)")
    elif steady > factor * limit + GRANULE:
        missed.append("steady")
    live = report["peak_live_bytes"]
    own_cap = chosen["min_capacity_bytes"] // MIB if chosen["min_capacity_bytes"] else "-"
    summary = (f"live {live / MIB:8.1f} MiB  {chosen['strategy']:12s} {chosen['overhead']:.3f}x  "
               f"steady/limit {steady / limit if steady is not None else float('nan'):.3f}  "
               f"default-pool {results['default-pool']['overhead']:.3f}x  torch {torch / live:.3f}x  "
               f"smallest device {own_cap}/{smallest // MIB} MiB")
    return missed, summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--steppool", default="target/release/steppool", help="the steppool binary")
    parser.add_argument("--jobs", type=int, default=2, help="replays run at once")
    parser.add_argument("--static", nargs="*", default=["static"], help="file-name words of static-shape traces")
    parser.add_argument("--json-dir", help="keep the --json reports here (default: a temporary folder)")
    args = parser.parse_args()
    out_dir = args.json_dir or tempfile.mkdtemp(prefix="steppool-targets-")
    os.makedirs(out_dir, exist_ok=True)
    missed_traces = floor_only = 0
    with ThreadPoolExecutor(args.jobs) as pool:
        reports = pool.map(lambda trace: (trace, *replay(args.steppool, trace, out_dir)), args.traces)
        for trace, report, error in reports:
            name = os.path.basename(trace)
            if report is None:
                missed_traces += 1
                print(f"{name:42s} ERROR {' '.join(error)}")
                continue
            missed, summary = misses(report, any(word in name for word in args.static))
            missed_traces += bool(missed)
            floor_only += bool(missed) and all("at the floor" in target for target in missed)
            print(f"{name:42s} {summary}  {'MISS: ' + ', '.join(missed) if missed else 'met'}")
    print(f"{missed_traces} of {len(args.traces)} traces miss a target, {floor_only} of them only at the floor")
    return 1 if missed_traces else 0


if __name__ == "__main__":
    sys.exit(main())
