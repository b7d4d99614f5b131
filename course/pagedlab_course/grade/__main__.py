"""``python -m pagedlab_course.grade NOTEBOOK_OR_DIR... [--extra-checks DIR] [--json REPORT] [--csv
GRADEBOOK] [--allow-unsealed]``: grade, print each report and its summary line, write the JSON reports and a CSV
gradebook (one row per file, unreadable ones included); exit 0 only if everything passed."""

import argparse
import csv
import json
import sys
from pathlib import Path

from pagedlab_course.grade import SOLUTIONS, grade_many
from pagedlab_course.grade.sandbox import Limits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedlab_course.grade", description=__doc__)
    parser.add_argument("notebooks", nargs="+", type=Path,
                        help="submitted notebooks (A<n>_*.ipynb), or directories of them")
    parser.add_argument("--extra-checks", action="append", type=Path, default=[], metavar="DIR",
                        help="a directory of an instructor's hidden checks (A<n>*.py); repeatable")
    parser.add_argument("--json", type=Path, metavar="REPORT", help="write the reports here as JSON")
    parser.add_argument("--csv", type=Path, metavar="GRADEBOOK", help="write one row per notebook here")
    parser.add_argument("--solutions", type=Path, default=SOLUTIONS, help="the reference notebooks")
    parser.add_argument("--task", action="append", dest="tasks", metavar="TASK",
                        help="grade only this task (A2.3); repeatable")
    parser.add_argument("--cell-timeout", type=float, default=300.0, help="seconds per cell or hidden check")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for one submission's whole run")
    parser.add_argument("--memory-limit", type=int, default=Limits.memory_mb, metavar="MB",
                        help="memory of one submission's process (heap and private mappings)")
    parser.add_argument("--seed", type=int, help="the seed hidden checks draw their cases from (default: drawn "
                        "now; each report records it, so a grade can be reproduced)")
    parser.add_argument("--allow-unsealed", action="store_true",
                        help="grade a batch even where bubblewrap is not working (each submission then runs "
                             "as your user, kept from your files by the rules alone)")
    args = parser.parse_args(argv)
    for d in args.extra_checks:
        if not d.is_dir():
            parser.error(f"--extra-checks {d}: no such directory")
    notebooks = []
    for nb in args.notebooks:
        if nb.is_dir():
            notebooks += sorted(nb.glob("*.ipynb"))
        elif nb.is_file():
            notebooks.append(nb)
        else:
            parser.error(f"{nb}: no such notebook or directory")
    try:
        reports = grade_many(notebooks, extra_checks=args.extra_checks, solutions=args.solutions,
                             tasks=args.tasks, cell_timeout=args.cell_timeout, timeout=args.timeout,
                             limits=Limits(memory_mb=args.memory_limit), allow_unsealed=args.allow_unsealed, seed=args.seed)
    except ValueError as err:  # an unknown task, or a batch without bubblewrap: nothing was graded
        parser.error(str(err))
    # a lone surrogate from a notebook's text (the judge's results are escaped already,
    # grade/supervise.py) must not end the command before the gradebook is written
    sys.stdout.reconfigure(errors="backslashreplace")
    for report in reports:
        print(report.text(), end="\n\n" if len(reports) > 1 else "\n")
    if args.json:
        args.json.write_text(json.dumps([r.as_dict() for r in reports], indent=1) + "\n")
    if args.csv:
        with args.csv.open("w", newline="", encoding="utf-8", errors="backslashreplace") as f:
            writer = csv.writer(f)
            writer.writerow(["notebook", "assignment", "status", "tasks passed", "tasks", "checks passed", "checks",
                             "hidden passed", "hidden", "sandbox", "seed", "why"])
            for r in reports:
                status = "refused" if r.refused else "passed" if r.passed else "failed"
                writer.writerow([r.notebook, r.assignment, status, sum(t.ok for t in r.tasks), len(r.tasks),
                                 sum(t.passed for t in r.tasks), sum(t.checks for t in r.tasks),
                                 sum(t.hidden_passed for t in r.tasks), sum(t.hidden for t in r.tasks),
                                 r.sandbox, r.seed, "; ".join(r.refused)])
    return 0 if all(r.passed for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
