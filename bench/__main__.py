"""`make bench`: runs every benchmark module and writes one JSON of figures.

Each module in BENCHES exposes `run() -> dict[str, object]`; a failing bench is
recorded with its error instead of hiding the others' figures. A module may also
expose `headline(figures) -> list[str]`: the lines printed together at the end, so
the figures that have goals are read side by side rather than dug out of the JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
import traceback
from pathlib import Path

BENCHES: list[str] = [
    "runner_overhead",
    "simulate",
    "slack_latency",
    "history",
    "digest_advice",
    "host_bootstrap",
    "multinode",
    "run_end",
    "live_runs",
    "slurm",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("--out", type=Path, default=Path("bench-results.json"))
    parser.add_argument("--only", action="append", default=[], help="run only these benches")
    args = parser.parse_args(argv)
    results: dict[str, object] = {
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    failed = False
    headlines: list[str] = []
    for name in BENCHES:
        if args.only and name not in args.only:
            continue
        print(f"bench: {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            module = importlib.import_module(f"bench.{name}")
            figures = module.run()
        except Exception:
            failed = True
            figures = {"error": traceback.format_exc()}
        figures["bench_wall_s"] = round(time.perf_counter() - t0, 2)
        results[name] = figures
        print(json.dumps({name: figures}, indent=2), flush=True)
        headline = getattr(module, "headline", None) if "error" not in figures else None
        if headline is not None:
            headlines += [f"{name}: {line}" for line in headline(figures)]
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for line in headlines:
        print(line)
    print(f"bench: wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
