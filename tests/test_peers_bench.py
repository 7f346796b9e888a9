"""bench/peers.py's bookkeeping (no server runs): the workload every server gets, llama.cpp's settings
and command lines, and the summary's choice of the faster llama.cpp build."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import llamacpp, peers


def args(**overrides) -> argparse.Namespace:
    values = dict(num_prompts=None, waves=2, prompt_len=20, output_len=8, warmup_tokens=4, timeout=5.0)
    return argparse.Namespace(**(values | overrides))


def test_workload_prompts_are_fixed_distinct_and_apart_from_the_warmup():
    workload = peers.Workload(args(), [1, 4], tokenizer=None)
    again = peers.Workload(args(), [1, 4], tokenizer=None)
    assert workload.prompts == again.prompts and workload.warmups == again.warmups  # every server alike
    assert [len(workload.prompts[c]) for c in (1, 4)] == [2, 8]
    assert [len(workload.warmups[c]) for c in (1, 4)] == [1, 4]
    measured = workload.prompts[1] + workload.prompts[4]
    warmups = workload.warmups[1] + workload.warmups[4]
    firsts = [p.split(".")[0] for p in measured + warmups]  # "Document i": no shared prefixes
    assert len(set(firsts)) == len(firsts)


def test_tuned_settings_follow_the_level_and_the_cores():
    s = llamacpp.tuned_settings(8, 248, threads=3, n_batch=256, n_ubatch=512)
    assert (s.n_parallel, s.n_ctx, s.n_threads, s.n_threads_batch) == (8, 8 * (248 + 64), 3, 3)
    assert s.flash_attn and s.n_batch == 256 and s.n_ubatch == 256  # the micro-batch fits the batch
    assert llamacpp.tuned_settings(1, 10).n_threads == llamacpp.physical_cores() >= 1


def test_native_command_line_carries_every_setting(tmp_path):
    s = llamacpp.tuned_settings(4, 100, threads=2)
    argv = llamacpp.server_argv("/opt/llama-server", Path("m.gguf"), 1234, s, tmp_path / "r.json")
    flags = {a: b for a, b in zip(argv, argv[1:])}  # each flag -> the word after it
    assert argv[0] == "/opt/llama-server" and flags["--model"] == "m.gguf" and flags["--port"] == "1234"
    assert flags["--parallel"] == "4" and flags["--ctx-size"] == str(4 * 164)
    assert flags["--threads"] == flags["--threads-batch"] == "2" and flags["--flash-attn"] == "on"
    assert flags["--batch-size"] == "2048" and flags["--ubatch-size"] == "512" and "--cont-batching" in argv


def level(tok_s: float, ttft_s: float) -> dict:
    return {"output_throughput": tok_s, "ttft_s": {"p50": ttft_s}}


def test_summary_compares_against_the_faster_build_per_level():
    runs = [{"wheel": [level(10, 1.0), level(50, 4.0)], "native": [level(8, 2.0), level(60, 3.0)],
             "tandem": [level(12, 0.5), level(120, 1.5)]},
            {"wheel": [level(12, 1.0), level(40, 4.0)], "native": [level(9, 2.0), level(70, 3.0)],
             "tandem": [level(6, 0.5), level(140, 1.5)]}]
    one, many = peers.summarize(runs, [1, 32], ["wheel", "native"])
    assert one["faster_llamacpp"] == "wheel" and many["faster_llamacpp"] == "native"
    assert one["tok_ratio"] == [12 / 10, 6 / 12] and many["tok_ratio"] == [120 / 60, 140 / 70]
    assert many["ttft_ratio"] == [0.5, 0.5]
    assert peers.spread([1.0, 3.0, 2.0], 2) == "2.00 (1.00-3.00)"


def _pairing_args(model: str, pairing: str, int4_file: str = "Q4_1") -> argparse.Namespace:
    return argparse.Namespace(model=model, pairing=pairing, int4_file=int4_file)


def test_int4_pairing_serves_the_same_q4_file_on_both_sides(tmp_path):
    from backend.models.default_model import GGUF_MEMBER

    own = tmp_path / "default-model" / Path(GGUF_MEMBER).name
    one_b = tmp_path / "bench-1b"
    (one_b / "hf").mkdir(parents=True)
    own.parent.mkdir()
    for path in (own, one_b / "hf" / "model.safetensors.index.json", one_b / "bench-1b.Q4_0.gguf",
                 one_b / "bench-1b.BF16.gguf"):
        path.write_bytes(b"")  # present, so nothing is written or downloaded

    args, gguf, tokenizer = peers.resolve_pairing(_pairing_args("default", "int4"), tmp_path)
    assert gguf == own and args[0] == str(own) and tokenizer is None
    assert args[1:] == ["--quantization", "gguf"]  # activations in the machine's default dtype

    args, gguf, tokenizer = peers.resolve_pairing(_pairing_args("bench-1b", "int4", "Q4_0"), tmp_path)
    assert gguf == one_b / "bench-1b.Q4_0.gguf" and args[0] == str(gguf) and tokenizer == one_b / "hf"

    args, gguf, tokenizer = peers.resolve_pairing(_pairing_args("bench-1b", "bf16"), tmp_path)
    assert args[0] == str(one_b / "hf") and gguf == one_b / "bench-1b.BF16.gguf"
