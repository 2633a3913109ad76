"""`num_threads: auto` for rl: the cores the cluster's other Dask workers leave free, shared
among the processes that compute at once (`stages.rl.run.with_threads`)."""

from __future__ import annotations

import os

import pytest

from engine.stage import Slot, StageContext
from stages.lib.devices import free_cores
from stages.rl import RLConfig
from stages.rl.run import with_threads

CORES = len(os.sched_getaffinity(0))


def ctx(tmp_path: object, slots: tuple[Slot, ...] = ()) -> StageContext:
    return StageContext(
        name="grpo",
        kind="rl",
        stage_dir=str(tmp_path),
        run_dir=str(tmp_path),
        pipeline_dir=str(tmp_path),
        slots=slots,
    )


def config(**values: object) -> RLConfig:
    return RLConfig.model_validate({"input": "x.jsonl", "model": "m", **values})


def test_auto_is_the_default_and_a_count_is_kept(tmp_path):
    assert config().num_threads == "auto"
    cfg, how = with_threads(config(num_threads=3), ctx(tmp_path))
    assert (cfg.threads, how) == (3, "set in the config")


@pytest.mark.parametrize(
    ("values", "busy"),
    [
        ({}, 1),  # the engine and the actor take turns: each gets every free core
        ({"num_processes": 2}, 2),
        ({"async_train": True}, 2),  # the engine generates beside the update
    ],
)
def test_auto_shares_this_machines_cores_among_what_computes_at_once(tmp_path, values, busy):
    """Outside a Dask worker no other worker holds a core: the process's CPU affinity."""
    cfg, how = with_threads(config(**values), ctx(tmp_path))
    assert cfg.threads == max(1, CORES // busy)
    assert how == (
        f"auto: {CORES} free core(s) ({CORES} core(s) here, 0 held by the threads of other "
        f"Dask workers on this host) over {busy} process(es) computing at once"
    )


def test_the_cores_other_workers_hold_are_not_free_and_the_stages_own_workers_are(tmp_path):
    """A real in-process cluster of three one-thread workers on this host: a task on one sees
    the other two's threads held, or one when the stage also runs a task on the second."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(
            n_workers=3, threads_per_worker=1, processes=False, dashboard_address=":0"
        ) as local,
        Client(local) as client,
    ):
        first, second, _ = sorted(client.scheduler_info(n_workers=-1)["workers"])
        alone = ctx(tmp_path)
        spans = ctx(tmp_path, (Slot("n0", first, ()), Slot("n0", second, ())))
        got = [
            client.submit(free_cores, c, workers=[first], pure=False).result()
            for c in (alone, spans)
        ]
    assert [how for _, how in got] == [
        f"{CORES} core(s) here, 2 held by the threads of other Dask workers on this host",
        f"{CORES} core(s) here, 1 held by the threads of other Dask workers on this host",
    ]
    assert [n for n, _ in got] == [max(1, CORES - 2), max(1, CORES - 1)]


def test_bf16_on_a_cpu_without_native_bf16_is_warned_of(tmp_path):
    """bf16 on a CPU whose flags lack avx512_bf16 and amx_bf16 gets the warning (8-50x slower
    than fp32 there: bench/bf16_update.py); with either flag, in fp32, or on a GPU, none."""
    from stages.lib.devices import slow_bf16

    avx2 = tmp_path / "avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    native = tmp_path / "native"
    native.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    warned = slow_bf16("cpu", True, str(avx2))
    assert warned is not None and "set bf16: false" in warned and "8-50x slower" in warned
    assert slow_bf16("cpu", True, str(native)) is None
    assert slow_bf16("cpu", False, str(avx2)) is None
    assert slow_bf16("cuda:0", True, str(avx2)) is None
    assert slow_bf16("cpu", True, str(tmp_path / "missing")) is None
