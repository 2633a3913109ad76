"""The reference policy for real: GRPO with kl_coef > 0, the `ref` role on a simulated node
of its own (`dask worker --resources GPU=n`, ranks on the CPU with gloo), its ranks scoring
each batch before the actor's update."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import SimWorker, dask_cluster
from tests.integration.test_placement_cluster import PIPE, report, run

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GRPO = """\
    name: grpo
    cluster: {{gpus: {gpus}, gpus_per_node: {per_node}}}
    resources: {{ratio: {{vllm: 1, actor: 1, ref: 1}}}}
    stages:
      rl:
        kind: rl
        config:
          input: data.jsonl
          model: {{hidden_size: 32, num_layers: 1, num_heads: 2, vocab_size: 300}}
          verifier: {{kind: regex, pattern: "[0-9]"}}
          kl_coef: 0.5
          zero_stage: {zero}
          num_repeats: 4
          rollout_batch_size: 8
          train_batch_size: 32
          micro_train_batch_size: {micro}
          learning_rate: 0.01
          max_steps: 4
          max_output_tokens: 4
          save_steps: 4
"""


def rl_run(tmp_path: Path, per_node: int, zero: int = 0, micro: int = 32) -> dict[str, Any]:
    """Plan, then run on 3 simulated nodes of `per_node` GPUs; the stage's report."""
    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = GRPO.format(gpus=3 * per_node, per_node=per_node, zero=zero, micro=micro)
    (tmp_path / "p.yaml").write_text(textwrap.dedent(text))
    planned = run(
        PIPE, tmp_path, "plan", "p.yaml", "--cluster", f"3x{per_node}", "--format", "json"
    )
    assert planned.returncode == 0, planned.stderr
    plan = {p["role"]: p["node"] for p in json.loads(planned.stdout)["placement"]["rl"]}
    assert plan == {"vllm": "node0", "actor": "node1", "ref": "node2"}
    devices = ",".join(str(d) for d in range(per_node))
    workers = [SimWorker(per_node, f"node{i}", devices) for i in range(3)]
    with dask_cluster(workers, tmp_path) as address:
        result = run(PIPE, tmp_path, "run", "p.yaml", "--scheduler", address)
    assert result.returncode == 0, result.stderr[-3000:]
    record: dict[str, Any] = report(tmp_path / "runs/grpo")["stages"]["rl"]
    placed = {p["role"]: p["node"] for p in record["placement"]}
    assert placed == plan
    return record


def test_grpo_takes_the_kl_from_the_reference_ranks_on_their_own_node(tmp_path: Path):
    record = rl_run(tmp_path, per_node=1)
    stage = tmp_path / "runs/grpo/rl"
    ref_log = (stage / "ref_log.txt").read_text()
    # its one rank ran on the ref role's node, in fp32 (bf16 off), and the actor loaded none
    assert re.search(r"reference on node node2 \(CUDA_VISIBLE_DEVICES 0\), rank 0 of 1, ", ref_log)
    assert "frozen reference, torch.float32" in ref_log
    assert json.loads((stage / "rl_result.json").read_text())["reference"] == "ref role's ranks"
    assert record["metrics"]["reference"] == "ref role's ranks"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    updated = [r for r in rows if r["updates"]]
    assert len(updated) >= 2, rows
    # the first update starts from the reference's weights; after it the policy has moved
    assert all(r["kl"] is not None and r["kl"] >= 0 for r in updated)
    assert all(r["kl"] > 0 for r in updated[1:])


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_without_devices_the_reference_loads_in_each_actor_rank(tmp_path: Path, algorithm: str):
    rows = [{"prompt": f"{a} + {b} =", "answer": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = textwrap.dedent(GRPO.format(gpus=0, per_node=1, zero=0, micro=16))
    extra = f"kl_coef: 0.5\n      num_processes: 2\n      algorithm: {algorithm}"
    text = text.replace("kl_coef: 0.5", extra)
    (tmp_path / "p.yaml").write_text(text)
    result = run(PIPE, tmp_path, "run", "p.yaml")
    assert result.returncode == 0, result.stderr[-3000:]
    stage = tmp_path / "runs/grpo/rl"
    assert not (stage / "ref_log.txt").exists()
    actor_log = (stage / "actor_log.txt").read_text()
    assert "frozen reference in the actor's ranks, torch.float32" in actor_log
    assert json.loads((stage / "rl_result.json").read_text())["reference"] == "actor's ranks"
    rows = [json.loads(x) for x in (stage / "metrics.jsonl").read_text().splitlines()]
    updated = [r for r in rows if r["updates"]]
    assert len(updated) >= 2, rows
    if algorithm == "ppo":  # the KL is in each token's reward, asked of the actor's ranks
        assert all(r["value_loss"] is not None for r in updated)
    else:
        assert all(r["kl"] > 0 for r in updated[1:])


def test_two_zero3_reference_ranks_score_an_uneven_batch_like_one_whole_model(tmp_path: Path):
    """The ref role's job under ZeRO-3: 5 samples over 2 ranks at micro batch 2 (3 and 2
    samples: the second rank pads a pass), answers gathered back in order."""
    import logging
    import threading
    from dataclasses import asdict

    from stages.lib.builders.recipe import TinyModel
    from stages.lib.builders.tiny import build_tiny_model
    from stages.lib.distributed.ds_config import build_ds_config
    from stages.lib.distributed.spawn import Ranks, launch
    from stages.rl import RLConfig
    from stages.rl.algo.logprobs import Sample
    from stages.rl.roles.brief import ActorBrief
    from stages.rl.roles.channel import StageEnd
    from stages.rl.roles.frozen import load_reference, reference_logprobs

    # hidden 160: the MLP matrices pass ZeRO-3's persistence threshold and are really split
    tiny = {"hidden_size": 160, "num_layers": 1, "num_heads": 4, "vocab_size": 300}
    model = str(tmp_path / "m")
    build_tiny_model(TinyModel(**tiny), [f"{a} + {a} = {2 * a}" for a in range(50)], model, 0)
    cfg = RLConfig(input="d.jsonl", kl_coef=0.1, zero_stage=3, micro_train_batch_size=2)
    end = StageEnd()
    brief = ActorBrief(
        config=cfg,
        model_dir=model,
        stage_dir=str(tmp_path),
        device="cpu",
        trainer="deepspeed",
        ds_config=build_ds_config(cfg, 2, model_dir=model),
        threads=1,
        channel=end.address,
        authkey=end.authkey.hex(),
        sync_backend="gloo",
        sync_store="",
        resume_tag=None,
        total_updates=1,
    )
    brief.write(str(tmp_path / "ref_brief.json"))
    log = str(tmp_path / "ref_log.txt")
    args = ("stages.rl.roles.ref", str(tmp_path / "ref_brief.json"), Ranks(world=2), "cpu", 1, log)
    ranks = threading.Thread(target=launch, args=(*args, logging.getLogger("test")), daemon=True)
    ranks.start()
    end.accept(ranks.is_alive, timeout_s=300)
    samples = [Sample(ids=tuple(range(5, 9 + n)), prompt_len=3) for n in range(5)]
    payload = {"samples": [asdict(s) for s in samples]}
    got = end.request("ref_logprobs", payload, timeout_s=300, alive=ranks.is_alive)
    end.request("stop", timeout_s=60, alive=ranks.is_alive)
    ranks.join(timeout=60)
    end.close()
    text = Path(log).read_text()
    assert "rank 0 of 2, frozen reference, torch.float32" in text, text[-2000:]
    held = re.search(r"zero 3: (\d+) of (\d+) elements held on this rank", text)
    assert held and int(held.group(1)) < int(held.group(2)), text[-2000:]  # really split
    whole, _ = load_reference(model, False, None, "cpu")
    want = reference_logprobs(whole, samples, "cpu", cfg, 0)
    assert [len(x) for x in got] == [s.completion_len for s in samples]
    for mine, theirs in zip(got, want, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)
