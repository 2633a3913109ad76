"""`scheduler: slurm` before anything is submitted: how many jobs the plan needs, the job script
`pipe plan --format json` shows, and `pipe validate` not importing dask_jobqueue."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from tests.conftest import ROOT, run_cli


def slurm_plan(tmp_path: Path, cluster: str, stages: str) -> dict[str, Any]:
    (tmp_path / "x.jsonl").write_text("")
    text = f"name: p\ncluster:\n  scheduler: slurm\n{textwrap.indent(textwrap.dedent(cluster), '  ')}stages:\n"
    (tmp_path / "p.yaml").write_text(text + textwrap.indent(textwrap.dedent(stages), "  "))
    result = run_cli("plan", "p.yaml", "--format", "json", cwd=tmp_path)
    assert result.exit_code == 0, result.stderr
    return dict(json.loads(result.stdout)["slurm"])


def test_one_job_per_node_the_placement_uses(tmp_path: Path):
    slurm = slurm_plan(
        tmp_path,
        """\
        gpus: 24
        gpus_per_node: 8
        """,
        """\
        a: {kind: filter, resources: {gpus: 8}, config: {input: x.jsonl}}
        b: {kind: filter, resources: {gpus: 8}, config: {input: x.jsonl}}
        c: {kind: filter, needs: [a, b], resources: {gpus: 4}}
        """,
    )
    # a and b run at the same time on two nodes; c reuses one of them; the third node is unused
    assert (slurm["jobs"], slurm["gpus_per_job"]) == (2, 8)


def test_a_pipeline_without_gpu_stages_needs_one_job_without_gpus(tmp_path: Path):
    slurm = slurm_plan(tmp_path, "gpus: 0\n", "a: {kind: filter, config: {input: x.jsonl}}\n")
    assert (slurm["jobs"], slurm["gpus_per_job"]) == (1, 0)
    assert "gres" not in slurm["job_script"]
    assert "--resources" not in slurm["job_script"]


def test_fewer_gpus_than_a_node_asks_for_only_those(tmp_path: Path):
    slurm = slurm_plan(
        tmp_path,
        "gpus: 2\ngpus_per_node: 8\n",
        "a: {kind: filter, resources: {gpus: 2}, config: {input: x.jsonl}}\n",
    )
    assert (slurm["jobs"], slurm["gpus_per_job"]) == (1, 2)


def test_the_job_script_carries_every_setting_of_the_slurm_block(tmp_path: Path):
    slurm = slurm_plan(
        tmp_path,
        """\
        gpus: 8
        gpus_per_node: 8
        slurm:
          partition: gpu
          account: proj
          walltime: "08:00:00"
          cores: 16
          memory: 64GB
          job_extra_directives: ["--qos=high"]
          job_script_prologue: ["module load cuda/12.4"]
        """,
        "a: {kind: filter, resources: {gpus: 8}, config: {input: x.jsonl}}\n",
    )
    lines = slurm["job_script"].splitlines()
    for line in (
        "#SBATCH -p gpu",
        "#SBATCH -A proj",
        "#SBATCH -t 08:00:00",
        "#SBATCH --cpus-per-task=16",
        "#SBATCH --mem=60G",
        "#SBATCH --gres=gpu:8",
        "#SBATCH --qos=high",
        "module load cuda/12.4",
        'export PIPE_NODE="$(hostname -s):${SLURM_JOB_ID}"',
        f"#SBATCH -e {tmp_path.resolve()}/runs/p/slurm/pipe-worker-%J.err",
    ):
        assert line in lines
    worker = lines[-1]
    assert "distributed.cli.dask_worker tcp://SCHEDULER:PORT" in worker
    assert "--nthreads 16" in worker and "--resources GPU=8" in worker
    # no tracker credentials on workers: a preload drops them from each job's environment
    assert worker.endswith("--preload engine.cluster.worker_setup")


def test_validate_of_a_slurm_pipeline_imports_no_dask_jobqueue(tmp_path: Path):
    (tmp_path / "p.yaml").write_text(
        "name: p\ncluster: {scheduler: slurm, slurm: {partition: gpu}}\n"
        "stages:\n  a: {kind: filter, config: {input: x.jsonl}}\n"
    )
    (tmp_path / "x.jsonl").write_text("")
    code = (
        "import sys\n"
        "from engine.cli import main\n"
        "try:\n"
        "    main(['validate', 'p.yaml'])\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "print('LOADED', 'dask_jobqueue' in sys.modules)\n"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "LOADED False" in proc.stdout
