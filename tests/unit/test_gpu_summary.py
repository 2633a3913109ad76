"""scripts/gpu_summary.py: the GPU check's summary from a run folder, whole or cut.

Input: steps.tsv, machine.json, a junit XML and a quickstart log written here. Output:
assertions on summary.md and summary.json."""

from __future__ import annotations

import importlib.util
import json

from tests.conftest import ROOT

spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "scripts" / "gpu_summary.py")
gs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gs)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.integration.test_gpu_single" name="test_train[bf16]" time="53.2"/>
<testcase classname="tests.integration.test_memory_measured" name="test_mem[2-True]" time="12.5">
  <failure message="AssertionError: 741.5 MB measured, 391.4 MB estimated (1.89x)">trace</failure>
</testcase>
<testcase classname="tests.integration.test_gpu_rl" name="test_two[a|b]" time="0.001">
  <skipped type="pytest.skip" message="needs 2 CUDA GPU(s); 1 visible">skip</skipped>
</testcase>
</testsuite></testsuites>
"""


def test_a_whole_run_is_summarized(tmp_path):
    (tmp_path / "steps.tsv").write_text(
        "install\tskipped\t\t0\tpipe already installed\n"
        "machine\tok\t0\t3.5\t180 s bound\n"
        "gpu-tests\tfailed\t1\t70.1\t900 s bound\n"
        "quickstart\tok\t0\t237.7\t600 s bound\n"
    )
    (tmp_path / "machine.json").write_text(json.dumps({"torch": "2.11.0+cu130", "cuda_devices": 1}))
    (tmp_path / "gpu-tests.xml").write_text(JUNIT)
    log = [f"line {i}" for i in range(30)] + [
        "  warmup  500  39.8%",
        "  grpo  500  66.4%  +26.6 pts",
    ]
    (tmp_path / "quickstart.log").write_text("\n".join(log) + "\n")
    s = gs.write(tmp_path)
    assert s["test_counts"] == {"passed": 1, "failed": 1, "skipped": 1}
    failed = s["tests"][1]
    assert failed["outcome"] == "failed" and failed["seconds"] == 12.5
    assert failed["message"].startswith("AssertionError: 741.5 MB")
    assert s["quickstart"]["rc"] == 0 and s["quickstart"]["seconds"] == 237.7
    assert s["quickstart"]["headline"][-1] == "  grpo  500  66.4%  +26.6 pts"
    assert len(s["quickstart"]["headline"]) == gs.HEADLINE_LINES
    md = (tmp_path / "summary.md").read_text()
    assert "- torch: 2.11.0+cu130" in md
    assert "## gpu tests: 1 failed, 1 passed, 1 skipped" in md
    assert "| tests.integration.test_gpu_rl::test_two[a\\|b] | skipped | 0.0 | needs 2 CUDA" in md
    assert "| quickstart | ok | 0 | 237.7 | 600 s bound |" in md
    assert json.loads((tmp_path / "summary.json").read_text())["test_counts"]["failed"] == 1


def test_a_cut_run_still_reports(tmp_path):
    (tmp_path / "steps.tsv").write_text(
        "machine\tok\t0\t3.5\t\ngpu-tests\ttimed out\t124\t900.0\t\n"
    )
    (tmp_path / "gpu-tests.xml").write_text(JUNIT[:200])  # written half-way
    s = gs.write(tmp_path)
    assert s["tests"] == [] and s["machine"] == {}
    assert s["steps"][1] == {
        "step": "gpu-tests",
        "status": "timed out",
        "rc": 124,
        "seconds": 900.0,
        "note": "",
    }
    assert s["quickstart"]["status"] == "not run"
    md = (tmp_path / "summary.md").read_text()
    assert "## gpu tests: none ran" in md and "| gpu-tests | timed out | 124 | 900.0 |" in md
