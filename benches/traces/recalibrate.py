"""Replays the traces of the committed H200 calibration on the simulated device, with its
pool model before calibration (segments, the committed simulated figures) and with 32 MiB pool units
(the default since), beside the driver's figures (benches/results/2026-11-27-sim-pool-units.md).

    cargo build --release -p steppool-cli && python3 benches/traces/recalibrate.py
"""
import json, subprocess, sys, os, tempfile
from concurrent.futures import ThreadPoolExecutor
files = [('benches/results/2026-11-27-h200-calibration.json', 'cli/tests/data', ['', 'recorded']),
         ('benches/results/2026-11-27-h200-calibration-cuda-recorded.json', 'cli/tests/data/recorded-h200', [''])]
jobs = []
for path, root, subs in files:
    d = json.load(open(path))
    cap = d['capacity_bytes']
    traces = sorted({r['trace'] for r in d['rows']})
    for t in traces:
        f = next((os.path.join(root, s, t) for s in subs if os.path.exists(os.path.join(root, s, t))), None)
        drv = {r['strategy']: r['driver']['peak_reserved_bytes'] for r in d['rows'] if r['trace'] == t}
        old = {r['strategy']: r['simulated']['peak_reserved_bytes'] for r in d['rows'] if r['trace'] == t}
        jobs.append((path, t, f, cap, drv, old))
def run(job):
    path, t, f, cap, drv, old = job
    out = tempfile.mktemp(suffix='.json')
    subprocess.run(['target/release/steppool', 'replay', f, '--capacity', str(cap), '--no-bisect', '--pool-unit', '32MiB',
                    '--json', out], capture_output=True, check=True)
    new = {r['strategy']: r['peak_reserved_bytes'] for r in json.load(open(out))['results']}
    return job, new
M = 1 << 20
with ThreadPoolExecutor(2) as ex:
    res = list(ex.map(run, jobs))
print(f"{'trace':34s} " + "  ".join(f"{s:>26s}" for s in ['default-pool', 'phase-pools', 'arena', 'planned']))
ratios = {s: ([], []) for s in ['default-pool', 'phase-pools', 'arena', 'planned']}
for (path, t, f, cap, drv, old), new in res:
    cells = []
    for s in ['default-pool', 'phase-pools', 'arena', 'planned']:
        ratios[s][0].append(drv[s] / old[s]); ratios[s][1].append(drv[s] / new[s])
        cells.append(f"{drv[s]//M:5d}: {old[s]//M:5d} {drv[s]/old[s]:.2f} | {new[s]//M:5d} {drv[s]/new[s]:.2f}")
    tag = 'gpu ' if 'cuda' in path else ''
    print(f"{tag+t:34s} " + "  ".join(cells))
for s, (o, n) in ratios.items():
    print(f"{s:14s} driver/sim segments {min(o):.2f}-{max(o):.2f}   32 MiB units {min(n):.2f}-{max(n):.2f}   exact {sum(abs(x-1)<1e-9 for x in n)}/{len(n)}")
