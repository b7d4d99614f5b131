"""Run the randomized tests (``pytest -m randomized``) under many seeds, one pytest run per seed:
``--hypothesis-seed=N`` for the Hypothesis tests, ``PAGEDLAB_TEST_SEED=N`` for the tests that pick
their own seeds (the ``seed_offset`` fixture in tests/conftest.py). ``make seeds`` runs seeds 0 to 29.

    python tools/seeds.py [--seeds 0:30] [-- extra pytest arguments]

Prints each seed's result and time, then the seeds that failed with their failing tests; exits
1 if any failed. Rerun one failure with
``PAGEDLAB_TEST_SEED=N python -m pytest -m randomized --hypothesis-seed=N TEST``.
"""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(seed: int, extra: list[str]) -> tuple[int, float, list[str], str]:
    env = {**os.environ, "PAGEDLAB_TEST_SEED": str(seed)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "randomized",
           f"--hypothesis-seed={seed}", *extra]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.monotonic() - start
    out = done.stdout + done.stderr
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.MULTILINE)
    return done.returncode, took, failed, out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0:30", help="a range start:stop (default 0:30)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    start, stop = map(int, args.seeds.split(":"))
    failures, began = {}, time.monotonic()
    for seed in range(start, stop):
        code, took, failed, out = run(seed, args.pytest_args)
        summary = (out.strip().splitlines() or ["(no output)"])[-1]
        print(f"seed {seed}: {summary} ({took:.0f} s)", flush=True)
        if code != 0:
            failures[seed] = failed or [f"pytest exited {code}"]
            print(out[-4000:], flush=True)
    print(f"{stop - start} seeds in {(time.monotonic() - began) / 60:.1f} min; "
          f"{len(failures)} failed")
    for seed, tests in failures.items():
        print(f"  seed {seed}: {', '.join(tests)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
