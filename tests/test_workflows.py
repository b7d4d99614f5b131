"""The GitHub workflows run on today's runners: GitHub removed Node 20 from them on 2026-09-16,
so every action must be at a major whose action.yml says `using: node24` (issue 48)."""
import re
from pathlib import Path

import yaml

WORKFLOWS = sorted(Path(".github/workflows").glob("*.yml"))

# The first major of each action that runs on Node 24, from its release notes.
NODE24_MAJOR = {
    "actions/checkout": 5,  # v5.0.0: "Updated to the node24 runtime"
    "actions/setup-python": 6,  # v6.0.0: node24
    "actions/upload-artifact": 6,  # v6.0.0: "now runs on Node.js 24 (runs.using: node24)"
    "actions/upload-pages-artifact": 5,  # v5.0.0: its internal upload-artifact moved to v7
    "actions/deploy-pages": 5,  # v5.0.0: node24
}


def uses(workflow: Path) -> list[str]:
    steps = [step for job in yaml.safe_load(workflow.read_text())["jobs"].values()
             for step in job.get("steps", [])]
    return [step["uses"] for step in steps if "uses" in step]


def test_every_action_runs_on_node_24():
    seen = set()
    for workflow in WORKFLOWS:
        for ref in uses(workflow):
            name, version = ref.split("@")
            assert name in NODE24_MAJOR, f"{workflow}: {name} has no known Node 24 major"
            major = int(re.match(r"v(\d+)", version).group(1))
            assert major >= NODE24_MAJOR[name], f"{workflow}: {ref} runs on Node 20"
            seen.add(name)
    assert seen == set(NODE24_MAJOR), "an action listed here is used by no workflow"


def test_the_drift_workflow_tests_the_python_floor_pyproject_claims():
    floor = re.search(r'^requires-python = "(.+)"$', Path("pyproject.toml").read_text(), re.M)[1]
    drift = yaml.safe_load(Path(".github/workflows/drift.yml").read_text())
    pythons = {row["versions"]: row["python"]
               for row in drift["jobs"]["test"]["strategy"]["matrix"]["include"]}
    assert floor == f">={pythons['lowest']}"
