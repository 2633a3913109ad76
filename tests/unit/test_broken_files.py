"""Every broken pipeline under tests/data/broken gives exit 2, a located message, no traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DATA, run_cli

BROKEN = sorted((DATA / "broken").glob("*.yaml"))
LOCATED = re.compile(r"^[^:\n]+\.yaml:\d+:\d+: ", re.M)

# The full text users see, for the files where the wording matters most.
EXPECTED = {
    "duplicate_key.yaml": "duplicate_key.yaml:5:3: stages.a: duplicate key 'a'",
    "python_object_apply.yaml": "python_object_apply.yaml:1:7: name: tag '!!python/object/apply:os.system' is not allowed; use plain YAML values",
    "empty.yaml": "empty.yaml:1:1: the file is empty; expected a pipeline mapping",
    "root_list.yaml": "root_list.yaml:1:1: expected a mapping of pipeline settings at the top, found a list",
    "invalid_utf8.yaml": "invalid_utf8.yaml:1:10: invalid UTF-8 byte 0xe9; the file must be UTF-8 text",
    "tab_indent.yaml": "tab_indent.yaml:3:1: invalid YAML: a tab character cannot indent YAML; use spaces",
    "unknown_top_key.yaml": "unknown_top_key.yaml:2:1: profiles: unknown field 'profiles'; did you mean 'profile'?",
    "unknown_cluster_key.yaml": "unknown_cluster_key.yaml:4:3: cluster.worker: unknown field 'worker'; did you mean 'workers'?",
    "unknown_stage_key.yaml": "unknown_stage_key.yaml:5:5: stages.a.need: unknown field 'need'; did you mean 'needs'?",
    "unknown_config_key.yaml": "unknown_config_key.yaml:8:31: stages.filter.config.max_lenght: unknown field 'max_lenght'; did you mean 'max_length'?",
    "unknown_backend_key.yaml": "unknown_backend_key.yaml:6:79: stages.collect.config.backend.api_key: unknown field 'api_key'; did you mean 'api_key_env'?",
    "wrong_type_workers.yaml": "wrong_type_workers.yaml:3:12: cluster.workers: expected an integer, found 'two'",
    "wrong_type_quoted_number.yaml": "wrong_type_quoted_number.yaml:5:27: stages.c.config.num_repeats: expected an integer, found '4'",
    "out_of_range_top_p.yaml": "out_of_range_top_p.yaml:5:21: stages.c.config.top_p: expected a number at most 1.0, found 1.5",
    "cycle.yaml": "cycle.yaml:3:28: stages.a.needs: needs form a cycle: 'a' -> 'c' -> 'b' -> 'a' (each needs the next)",
    "self_need.yaml": "self_need.yaml:3:29: stages.a.needs[0]: stage 'a' cannot need itself",
    "dangling_need.yaml": "dangling_need.yaml:4:34: stages.filter.needs[0]: no stage named 'colect'; did you mean 'collect'?",
    "kind_typo.yaml": "kind_typo.yaml:3:13: stages.a.kind: unknown stage kind 'filtr'; expected 'collect', 'dataset', 'evaluate', 'filter', 'rl' or 'train'; did you mean 'filter'?",
    "profile_typo.yaml": "profile_typo.yaml:2:10: profile: unknown profile 'high-performace'; expected 'default', 'high-performance' or 'max-throughput'; did you mean 'high-performance'?",
    "memory_typo.yaml": "memory_typo.yaml:2:9: memory: unknown memory preset 'memory-constrained'; expected 'default' or 'memory_constrained'; did you mean 'memory_constrained'?",
    "role_typo.yaml": "role_typo.yaml:5:23: stages.t.resources.role: expected 'vllm', 'actor', 'critic', 'ref', 'teacher' or 'reward', found 'actr'; did you mean 'actor'?",
    "ratio_role_typo.yaml": "ratio_role_typo.yaml:3:11: resources.ratio.vlm: expected 'vllm', 'actor', 'critic', 'ref', 'teacher' or 'reward', found 'vlm'; did you mean 'vllm'?",
    "start_after_end.yaml": "start_after_end.yaml:5:39: stages.c.config.end_idx: end_idx must be greater than start_idx (100), found 50",
    "same_output.yaml": "same_output.yaml:8:22: stages.b.config.output: '/tmp/shared/rollouts.jsonl' is also written by stage 'a' (output)",
    "bad_scheduler.yaml": "bad_scheduler.yaml:2:22: cluster.scheduler: expected 'local', 'slurm' or a Dask address (tcp://, tls://, ucx://, inproc://), found 'http://127.0.0.1:8786'",
    "slurm_key_typo.yaml": "slurm_key_typo.yaml:4:11: cluster.slurm.partiton: unknown field 'partiton'; did you mean 'partition'?",
    "slurm_bad_walltime.yaml": "slurm_bad_walltime.yaml:4:21: cluster.slurm.walltime: expected a Slurm time such as '04:00:00' or '1-00:00:00', found '8h'",
    "slurm_bad_directive.yaml": "slurm_bad_directive.yaml:5:27: cluster.slurm.job_extra_directives: expected sbatch options such as '--qos=high' (no '#SBATCH'), found '#SBATCH --qos=high'",
    "backend_kind_typo.yaml": "backend_kind_typo.yaml:6:23: stages.c.config.backend.kind: expected 'openai', 'vllm' or 'local', found 'vlm'; did you mean 'vllm'?",
    "defaults_typo.yaml": "defaults_typo.yaml:3:3: defaults.sed: no stage kind has a setting 'sed'; did you mean 'seed'?",
}


def test_there_are_at_least_thirty_broken_files():
    assert len(BROKEN) >= 30


@pytest.mark.parametrize("path", BROKEN, ids=lambda p: p.name)
def test_broken_file_exits_2_with_located_message(path: Path):
    result = run_cli("validate", path.name, cwd=path.parent)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert result.stdout == ""
    assert LOCATED.search(result.stderr), result.stderr
    if path.name in EXPECTED:
        assert result.stderr.strip() == EXPECTED[path.name]


def test_expected_texts_cover_a_dozen_files():
    assert len(EXPECTED) >= 12
    assert set(EXPECTED) <= {p.name for p in BROKEN}


def test_all_errors_reported_at_once_sorted_by_line(tmp_path: Path):
    (tmp_path / "p.yaml").write_text(
        "name: x\n"
        "profile: defualt\n"
        "stages:\n"
        "  collect:\n"
        "    kind: collect\n"
        "    config: {num_samples_in_parallel: fast}\n"
        "  filter:\n"
        "    kind: filter\n"
        "    needs: [colect]\n"
        "    config: {max_lenght: 3}\n"
    )
    result = run_cli("validate", "p.yaml", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [
        "p.yaml:2:10: profile: unknown profile 'defualt'; expected 'default', 'high-performance' "
        "or 'max-throughput'; did you mean 'default'?",
        "p.yaml:6:39: stages.collect.config.num_samples_in_parallel: expected a positive integer "
        "or 'auto', found 'fast'",
        "p.yaml:9:13: stages.filter.needs[0]: no stage named 'colect'; did you mean 'collect'?",
        "p.yaml:10:14: stages.filter.config.max_lenght: unknown field 'max_lenght'; did you mean "
        "'max_length'?",
    ]


def test_python_apply_tag_never_runs(tmp_path: Path):
    marker = tmp_path / "pwned"
    (tmp_path / "evil.yaml").write_text(
        f'name: !!python/object/apply:os.system ["touch {marker}"]\nstages:\n  a: {{kind: filter}}\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "validate", "evil.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(
        "evil.yaml:1:7: name: tag '!!python/object/apply:os.system' is not allowed"
    )
    assert not marker.exists()


def test_missing_file_is_exit_2(tmp_path: Path):
    result = run_cli("validate", "nope.yaml", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.strip() == "nope.yaml: no such file"
