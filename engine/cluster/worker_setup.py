"""Set-up of each worker process `pipe run` starts (a Dask preload: Dask imports this module
in the worker and calls `dask_setup` before the worker takes tasks, at every start and
restart), for the embedded `LocalCluster` and the Slurm jobs alike.

The driver alone writes to trackers (design, Tracking: no credentials on workers), yet a
worker process inherits the driver's environment: the trackers' credentials in it are
removed here, so no stage, and no process a stage starts, can read them. Other variables
stay (a collect stage against a hosted API needs its `OPENAI_API_KEY`; fsspec reads its
storage credentials). Workers of an existing cluster are started by their owner: `dask
worker ADDR --preload engine.cluster.worker_setup` does the same there.

The run's output is pipe's own (its stage lines and progress with a rate): the progress bars
of Hugging Face's libraries (transformers' "Loading weights" and "Writing model shards", the
hub's downloads) are turned off here, by `HF_HUB_DISABLE_PROGRESS_BARS`, which both read as
they are imported, so the processes a stage starts (ranks, engines) inherit it. The
driver's standard output holds the run's result (each stage's headline, evaluate's table):
what a library prints from a worker (DeepSpeed's accelerator notice, which accelerate
imports when transformers saves a model) goes to the worker's standard error instead.
"""

from __future__ import annotations

import os
import sys
from typing import Any

# what the trackers' libraries read (engine.run.tracking): W&B's key, MLflow's HTTP auth
CREDENTIALS = (
    "WANDB_API_KEY",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN",
)

PRELOAD = __name__


def dask_setup(worker: Any) -> None:
    """Drop the tracker credentials from this worker's environment; turn off the Hugging
    Face libraries' progress bars; send what the worker prints to its standard error."""
    for name in CREDENTIALS:
        os.environ.pop(name, None)
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    sys.stdout = sys.stderr  # stdout is the driver's result; a library's print goes to stderr
    if "transformers" in sys.modules:  # imported before this ran (a preload of the user's)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
