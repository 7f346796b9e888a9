"""The ``external_launcher`` executor under ``torchrun --nproc-per-node 2``: each rank runs its own
engine (TP=2 between them) and both give the single worker's outputs, sampled ones included;
ranks given different requests fail with a clear error instead of hanging."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_correctness import make_engine, random_prompts, run_engine

from backend.types.sampling_params import SamplingParams

pytestmark = pytest.mark.timeout(600)

REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, os, sys
    from backend.types.errors import EngineDeadError
    from frontend import LLM, SamplingParams

    model_dir, out_dir, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rank = int(os.environ["RANK"])
    llm = LLM(model=model_dir, dtype="float32", block_size=4, num_kv_blocks=256,
              tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    result = {}
    greedy = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    result["greedy"] = [o.outputs[0].token_ids for o in greedy]
    sampled = llm.generate([{"prompt_token_ids": prompts[0]}] * 3,  # unseeded: the RNG of rank 0 decides
                           SamplingParams(temperature=1.0, max_tokens=8), use_tqdm=False)
    result["sampled"] = [o.outputs[0].token_ids for o in sampled]
    try:  # rank 1 is given one more prompt than rank 0
        llm.generate([{"prompt_token_ids": p} for p in prompts[:1 + rank]],
                     SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        result["disagreement"] = "no error"
    except EngineDeadError as error:
        result["disagreement"] = str(error)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    llm.shutdown()
""")


def test_torchrun_two_ranks_give_identical_outputs(tiny_checkpoint, tmp_path):
    model_dir = tiny_checkpoint("llama")
    prompts = random_prompts([2, 9, 30], 384, seed=4)
    one = make_engine(model_dir)
    expected = run_engine(one, prompts, SamplingParams(temperature=0.0, max_tokens=10))
    one.shutdown()

    script = tmp_path / "run_llm.py"
    script.write_text(SCRIPT)
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "GLOO_SOCKET_IFNAME": "lo"}
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script), str(model_dir),
         str(tmp_path), json.dumps(prompts)],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["greedy"] == rank1["greedy"] == expected
    assert rank0["sampled"] == rank1["sampled"] and len(set(map(tuple, rank0["sampled"]))) > 1
    for result in (rank0, rank1):
        assert "disagree" in result["disagreement"], result["disagreement"]
