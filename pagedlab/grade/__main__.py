"""``python -m pagedlab.grade NOTEBOOK... [--extra-checks DIR] [--json REPORT]``: grade, print
each report and its summary line, write the JSON report; exit 0 only if everything passed."""

import argparse
import json
import sys
from pathlib import Path

from pagedlab.grade import SOLUTIONS, grade_many


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedlab.grade", description=__doc__)
    parser.add_argument("notebooks", nargs="+", type=Path, help="submitted notebooks (A<n>_*.ipynb)")
    parser.add_argument("--extra-checks", action="append", type=Path, default=[], metavar="DIR",
                        help="a directory of an instructor's hidden checks (A<n>*.py); repeatable")
    parser.add_argument("--json", type=Path, metavar="REPORT", help="write the reports here as JSON")
    parser.add_argument("--solutions", type=Path, default=SOLUTIONS, help="the reference notebooks")
    parser.add_argument("--task", action="append", dest="tasks", metavar="TASK",
                        help="grade only this task (A2.3); repeatable")
    parser.add_argument("--cell-timeout", type=float, default=300.0, help="seconds per cell or hidden check")
    args = parser.parse_args(argv)
    for d in args.extra_checks:
        if not d.is_dir():
            parser.error(f"--extra-checks {d}: no such directory")
    for nb in args.notebooks:
        if not nb.is_file():
            parser.error(f"{nb}: no such notebook")
    try:
        reports = grade_many(args.notebooks, extra_checks=args.extra_checks, solutions=args.solutions,
                             tasks=args.tasks, cell_timeout=args.cell_timeout)
    except ValueError as err:  # an unknown assignment or task: nothing was graded
        parser.error(str(err))
    for report in reports:
        print(report.text(), end="\n\n" if len(reports) > 1 else "\n")
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in reports], indent=1) + "\n")
    return 0 if all(r.passed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
