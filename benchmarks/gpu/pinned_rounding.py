"""Does this torch round pinned host buffers up to a power of two, and does
PYTORCH_CUDA_ALLOC_CONF=pinned_max_round_threshold_mb:N stop it? (docs/benchmarks.md section 6)

    python benchmarks/gpu/pinned_rounding.py [--mib 600] [--json FILE]

Pins one buffer of --mib MiB in a fresh process per setting and reports what the pinned allocator
holds (torch.cuda.host_memory_stats) and the process's locked/resident memory. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, torch
mib = int(sys.argv[1])
t = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
t.fill_(1)
stats = {}
try:
    stats = {k: v for k, v in torch.cuda.host_memory_stats().items()
             if "bytes" in k or "count" in k}
except Exception as error:  # older torch: no host_memory_stats
    stats = {"error": repr(error)}
status = {}
with open("/proc/self/status") as f:
    for line in f:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmLck", "VmPin"):
            status[key] = value.strip()
print(json.dumps({"torch": torch.__version__, "stats": stats, "status": status}))
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=600, help="size of the pinned buffer (default 600: rounds to 1024)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    results = {}
    for setting in ("", "pinned_max_round_threshold_mb:64"):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if setting:
            env["PYTORCH_CUDA_ALLOC_CONF"] = setting
        run = subprocess.run([sys.executable, "-c", CHILD, str(args.mib)], env=env, capture_output=True,
                             text=True, timeout=120)
        last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
        results[setting or "default"] = json.loads(last) if run.returncode == 0 and last else \
            {"exit": run.returncode, "stderr": run.stderr[-2000:]}
        print(setting or "default", json.dumps(results[setting or "default"]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mib": args.mib, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
