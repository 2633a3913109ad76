"""Write the GPU check's summary from what its steps left in the run folder.

Input: the folder `scripts/gpu_check.sh` writes (default runs/gpu-check/): `steps.tsv` (one
line per step: name, status, exit code, seconds, note), `machine.json` (versions and GPUs),
`gpu-tests.xml` (pytest's junit XML) and `quickstart.log` (the GRPO quickstart's output).
Any of them may be missing: a step that was cut or skipped. Output: `summary.md` and
`summary.json` in that folder. Standard library only: it runs even where the install failed.

    python scripts/gpu_summary.py [runs/gpu-check]
    python scripts/gpu_summary.py --machine runs/gpu-check   # write machine.json, with the
                                                            # interpreter that runs the check
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

HEADLINE_LINES = 12


def read_steps(path: Path) -> list[dict[str, Any]]:
    """The steps as run: name, status (ok, failed, timed out, skipped), rc, seconds, note."""
    steps = []
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        name, status, rc, seconds, note = [*line.split("\t"), "", "", "", ""][:5]
        steps.append(
            {
                "step": name,
                "status": status,
                "rc": int(rc) if rc.lstrip("-").isdigit() else None,
                "seconds": float(seconds or 0),
                "note": note,
            }
        )
    return steps


def read_junit(path: Path) -> list[dict[str, Any]]:
    """Each test case of a junit XML: its id, outcome (passed, failed, error, skipped), time and
    the message of a non-pass."""
    if not path.exists():
        return []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return []
    tests = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (found.get("message") or found.text or "").strip().splitlines()[0:1]
                message = message[0][:200] if message else ""
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        tests.append(
            {
                "test": name,
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
            }
        )
    return tests


def headline(path: Path, lines: int = HEADLINE_LINES) -> list[str]:
    """The last lines of the quickstart's output: each stage's headline, evaluation last."""
    if not path.exists():
        return []
    return path.read_text(errors="replace").rstrip().splitlines()[-lines:]


def version_of(module: str) -> str:
    """A module's __version__, or why there is none."""
    try:
        return str(__import__(module).__version__)
    except Exception as e:
        return f"not importable ({type(e).__name__})"


def machine_info() -> dict[str, Any]:
    """Python, the GPUs torch sees, the driver, and the versions that matter; printed too."""
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    for module in ("torch", "transformers", "deepspeed", "numpy"):
        info[module] = version_of(module)
    try:
        import torch

        info["torch_cuda"] = torch.version.cuda
        info["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(info["cuda_devices"])]
    except Exception as e:
        info["cuda_devices"] = 0
        info["torch_error"] = f"{type(e).__name__}: {e}"
    driver = (
        subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        if shutil.which("nvidia-smi")
        else None
    )
    info["driver"] = (
        driver.stdout.split("\n")[0].strip() if driver and driver.returncode == 0 else None
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    info["commit"] = commit.stdout.strip() if commit.returncode == 0 else None
    return info


def summarize(folder: Path) -> dict[str, Any]:
    """Everything the run folder holds, as one dict."""
    machine_path = folder / "machine.json"
    machine = json.loads(machine_path.read_text()) if machine_path.exists() else {}
    tests = read_junit(folder / "gpu-tests.xml")
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    steps = read_steps(folder / "steps.tsv")
    quick = next((s for s in steps if s["step"] == "quickstart"), None)
    return {
        "machine": machine,
        "steps": steps,
        "tests": tests,
        "test_counts": counts,
        "quickstart": {
            "status": quick["status"] if quick else "not run",
            "rc": quick["rc"] if quick else None,
            "seconds": quick["seconds"] if quick else None,
            "note": quick["note"] if quick else "",
            "headline": headline(folder / "quickstart.log"),
        },
    }


def cell(text: str) -> str:
    """Text that keeps a markdown table's columns: its bars escaped."""
    return text.replace("|", "\\|")


def markdown(s: dict[str, Any]) -> str:
    """The summary as markdown: machine, steps, tests, the quickstart's headline."""
    out = ["# GPU check", "", "## Machine", ""]
    out += [f"- {k}: {v}" for k, v in s["machine"].items()] or ["- (not read)"]
    out += ["", "## Steps", "", "| step | status | rc | seconds | note |", "|---|---|---|---|---|"]
    out += [
        f"| {t['step']} | {t['status']} | {t['rc']} | {t['seconds']:.1f} | {t['note']} |"
        for t in s["steps"]
    ]
    counts = ", ".join(f"{n} {k}" for k, n in sorted(s["test_counts"].items())) or "none ran"
    out += ["", f"## gpu tests: {counts}", ""]
    if s["tests"]:
        out += ["| test | result | seconds | message |", "|---|---|---|---|"]
        out += [
            f"| {cell(t['test'])} | {t['outcome']} | {t['seconds']:.1f} | {cell(t['message'])} |"
            for t in s["tests"]
        ]
    q = s["quickstart"]
    out += ["", f"## GRPO quickstart: {q['status']} (rc {q['rc']}) {q['note']}".rstrip(), ""]
    if q["headline"]:
        out += ["```", *q["headline"], "```"]
    return "\n".join(out) + "\n"


def write(folder: Path) -> dict[str, Any]:
    """Write summary.md and summary.json into the folder; the summary."""
    s = summarize(folder)
    (folder / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    (folder / "summary.md").write_text(markdown(s))
    return s


if __name__ == "__main__":
    if sys.argv[1:2] == ["--machine"]:
        info = machine_info()
        Path(sys.argv[2]).mkdir(parents=True, exist_ok=True)
        (Path(sys.argv[2]) / "machine.json").write_text(json.dumps(info, indent=2) + "\n")
        print("\n".join(f"{k}: {v}" for k, v in info.items()))
        sys.exit(0)
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/gpu-check")
    folder.mkdir(parents=True, exist_ok=True)
    done = write(folder)
    print(f"summary: {folder / 'summary.md'} ({done['test_counts'] or 'no tests'})")
