"""Load, part of: the `cluster.slurm` block, what `scheduler: slurm` submits its workers with.

Input: the block as written; output: a frozen `SlurmSpec` (checked like the rest of the
file, located errors). `engine.cluster.slurm` turns it into `dask_jobqueue.SLURMCluster` options;
GPUs per job come from `cluster.gpus_per_node`, not from here.

One name, two sides of one concept (Slurm: the `cluster.slurm` block as the pipeline file
declares it; `engine/cluster/slurm.py`: the jobs started from it).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

# sbatch's --time formats: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_WALLTIME = re.compile(r"^(\d+-\d{1,2}(:\d{1,2}){0,2}|\d+(:\d{1,2}){0,2})$")
_MEMORY = re.compile(r"^\d+(\.\d+)?\s*([kKMGTP]i?B|B)$")


class SlurmSpec(BaseModel):
    """How `scheduler: slurm` asks Slurm for workers: one batch job per node the plan needs."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    partition: str | None = Field(None, description="Partition (sbatch -p); default: Slurm's.")
    account: str | None = Field(None, description="Account to charge (sbatch -A).")
    walltime: str = Field(
        "01:00:00", description="Time limit of each job (sbatch -t), e.g. 04:00:00 or 1-00:00:00."
    )
    cores: int = Field(1, gt=0, description="CPU cores per job; the worker runs that many threads.")
    memory: str = Field("4GB", description="Memory per job, e.g. 64GB (sbatch --mem).")
    job_extra_directives: list[str] = Field(
        default_factory=list,
        description="Extra sbatch options, one per entry, "
        "e.g. ['--qos=high', '--constraint=a100'].",
    )
    job_script_prologue: list[str] = Field(
        default_factory=list,
        description="Shell lines run before the worker starts, e.g. ['module load cuda/12.4'].",
    )
    interface: str | None = Field(
        None, description="Network interface of the scheduler and workers, e.g. ib0 or eth0."
    )
    start_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Fail the run when the jobs' workers have not all connected within this many "
        "seconds; the message gives squeue's reason and the jobs are cancelled.",
    )

    @field_validator("walltime")
    @classmethod
    def _walltime(cls, value: str) -> str:
        if not _WALLTIME.match(value):
            raise ValueError(
                f"expected a Slurm time such as '04:00:00' or '1-00:00:00', found '{value}'"
            )
        return value

    @field_validator("memory")
    @classmethod
    def _memory(cls, value: str) -> str:
        if not _MEMORY.match(value.strip()):
            raise ValueError(f"expected an amount such as '64GB' or '500MiB', found '{value}'")
        return value

    @field_validator("job_extra_directives")
    @classmethod
    def _directives(cls, value: list[str]) -> list[str]:
        for item in value:
            if not item.startswith("-"):
                raise ValueError(
                    f"expected sbatch options such as '--qos=high' (no '#SBATCH'), found '{item}'"
                )
        return value
