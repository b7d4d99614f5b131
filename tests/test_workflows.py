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
    "actions/download-artifact": 7,  # v7.0.0: "now runs on Node.js 24"; v6 only preliminarily
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


def test_pages_publishes_the_gpu_edition_the_gpu_workflow_built():
    """pages.yml runs again when the GPU workflow finishes on main and publishes that run's book
    (the artifact gpu.yml uploads, fetched by run id) instead of building the CPU edition; a
    push builds the CPU edition; a failed GPU run publishes nothing."""
    workflows = {w.stem: yaml.safe_load(w.read_text()) for w in WORKFLOWS}
    pages, gpu = workflows["pages"], workflows["gpu"]
    triggers = pages[True]  # YAML 1.1 reads the key `on` as True
    assert triggers["workflow_run"] == {"workflows": [gpu["name"]], "types": ["completed"],
                                        "branches": ["main"]}
    assert "push" in triggers and pages["permissions"]["actions"] == "read"
    build = pages["jobs"]["build"]
    assert "workflow_run.conclusion == 'success'" in build["if"]
    steps = build["steps"]
    upload = next(s for j in gpu["jobs"].values() for s in j["steps"]
                  if s.get("uses", "").startswith("actions/upload-artifact"))
    download = next(s for s in steps if s.get("uses", "").startswith("actions/download-artifact"))
    assert download["with"]["name"] == upload["with"]["name"]
    assert download["with"]["path"] == upload["with"]["path"] == "_build/html"
    assert download["with"]["run-id"] == "${{ github.event.workflow_run.id }}"
    assert download["if"] == "github.event_name == 'workflow_run'"
    make_book = next(s for s in steps if s.get("run") == "make book")
    assert make_book["if"] == "github.event_name != 'workflow_run'"
    order = [s.get("run") or s["uses"].split("@")[0] for s in steps]
    assert order.index("make pdf") > max(order.index("make book"),
                                        order.index("actions/download-artifact"))
