"""Interleaved no-op drains of two checkouts (A, B): medians of N rounds each.

    python benchmarks/ab_drain.py --a /path/to/main --b . --rounds 7 [noop_drain.py options]
    python benchmarks/ab_drain.py --a . --b . --b-args=--middleware   # one checkout, two setups
    python benchmarks/ab_drain.py --a /path/to/main --b . --script typed_values.py --shape plain

Each round runs A then B (then B then A on the next round, so neither always goes first), each
in a fresh process with PYTHONPATH set to its checkout, on its own database.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def once(checkout: str, dsn: str, extra: list[str], script: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}
    out = subprocess.run(
        [sys.executable, str(HERE / script), "--dsn", dsn, *extra],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if line.startswith("RESULT "))
    return dict(json.loads(line[len("RESULT ") :]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--a", required=True)
    parser.add_argument("--b", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--base-dsn", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--b-args", default="", help="more noop_drain.py options for B only")
    parser.add_argument("--script", default="noop_drain.py", help="or typed_values.py")
    args, extra = parser.parse_known_args()
    dsns = {}
    for name in ("a", "b"):
        db = f"aioq_ab_{name}_{os.getpid()}"
        subprocess.run(
            ["psql", f"{args.base_dsn}/postgres", "-qc", f'CREATE DATABASE "{db}"'], check=True
        )
        dsns[name] = f"{args.base_dsn}/{db}"
    results: dict[str, list[float]] = {"a": [], "b": []}
    figures: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}  # every figure, by key
    try:
        for round_ in range(args.rounds):
            order = ("a", "b") if round_ % 2 == 0 else ("b", "a")
            for name in order:
                more = args.b_args.split() if name == "b" else []
                got = once(getattr(args, name), dsns[name], [*extra, *more], args.script)
                results[name].append(got.get("jobs_per_s", got.get("small_done_s", 0.0)))
                for key, value in got.items():
                    if isinstance(value, int | float):
                        figures[name].setdefault(key, []).append(value)
            print(f"round {round_}: a {results['a'][-1]:.1f}, b {results['b'][-1]:.1f}", flush=True)
    finally:
        for dsn in dsns.values():
            db = dsn.rsplit("/", 1)[1]
            subprocess.run(
                ["psql", f"{args.base_dsn}/postgres", "-qc", f'DROP DATABASE "{db}" WITH (FORCE)'],
                check=False,
            )
    for name in ("a", "b"):
        values = sorted(results[name])
        print(
            f"{name}: median {statistics.median(values):.1f} (min {values[0]:.1f}, max {values[-1]:.1f})"
        )
    change = statistics.median(results["b"]) / statistics.median(results["a"]) - 1
    print(f"b against a: {change:+.1%}")
    for key in sorted(figures["a"].keys() & figures["b"].keys()):
        a, b = statistics.median(figures["a"][key]), statistics.median(figures["b"][key])
        print(f"{key}: a median {a:.2f}, b median {b:.2f}; b against a: {b / a - 1:+.1%}")


if __name__ == "__main__":
    main()
