"""A stand-in backend: the real gRPC contract (protos/), no model, token IDs as fast as asked.

    python tests/stand_in_backend.py --tokenizer DIR [--port 0] [--model-name NAME] [--step-ms 0]
                                     [--no-generate-stream] [--stream-interval 1]

It serves every RPC a frontend and its router call (``GenerateStream``, ``Generate``, ``Abort``,
``GetModelInfo``, ``GetTokenizer``, ``GetLoad``, ``GetMetrics`` and
``grpc.health.v1``), so a real frontend process runs against it unchanged and
is the only thing a benchmark measures (``bench/frontend_capacity.py``). It
prints ``READY <port>`` on stdout once it serves. ``--no-generate-stream``
answers GenerateStream UNIMPLEMENTED, as a backend older than that RPC does.

``GenerateStream`` steps every request of the call together, as an engine
does: each step sends one message with one response per running sequence of
every request (the same responses ``Generate`` sends), a request's last entry
carrying its status (OK; DEADLINE_EXCEEDED past its ``timeout_ms``).

``Generate`` streams one response per sequence per step, as the real backend
does: sequence ``i`` of ``n`` cycles through a fixed script of token IDs
(the tokenizer's encoding of ordinary text), starting ``i`` tokens in, and
never emits EOS, so every sequence ends by length after exactly ``max_tokens``
tokens (``finish_reason`` LENGTH). ``step_ms`` > 0 paces the steps (a
simulated engine step); 0 streams as fast as gRPC's flow control lets it.
With ``logprobs`` set, each token has logprob -0.25 (rank 1) and the top-k
alternatives are the next token IDs with -1, -2, ...; ``prompt_logprobs`` come
in each sequence's first response. ``--stream-interval N`` makes every response
after a sequence's first carry N tokens (its last, what is left), as the real
backend's flag does. ``Abort`` and a cancelled call end the
request's stream with ABORT or at once. Torch-free: it needs only grpc, the
generated stubs and ``tokenizers``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from backend.types.tokenizer_files import tokenizer_file_names, tokenizer_fingerprint  # noqa: E402
from protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc  # noqa: E402

SCRIPT = ("Tandem serves language models with a paged KV cache and continuous batching. The capital of France "
          "is Paris, and the largest ocean is the Pacific Ocean. Once upon a time, a small model generated "
          "tokens one by one, and every one of them crossed the wire as an ID.")
CHUNK_BYTES = 1 << 20  # GetTokenizer's chunk size (the proto's bound)
DEFAULT_MAX_TOKENS = 16


class StandInServicer(engine_pb2_grpc.EngineServiceServicer):
    """EngineService without a model (see the module docstring for what it streams)."""

    def __init__(self, tokenizer_dir: str, model_name: str = "stand-in", max_model_len: int = 4096,
                 step_ms: float = 0.0, generate_stream: bool = True, stream_interval: int = 1) -> None:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
        self.tokenizer_dir = tokenizer_dir
        self.files = tokenizer_file_names(tokenizer_dir)
        self.fingerprint = tokenizer_fingerprint(tokenizer_dir)
        self.script = tokenizer.encode(SCRIPT, add_special_tokens=False).ids
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        eos = tokenizer.token_to_id("<|im_end|>") or tokenizer.token_to_id("<|endoftext|>")
        self.eos_token_ids = [eos] if eos is not None else []
        self.model_name, self.max_model_len, self.step_s = model_name, max_model_len, step_ms / 1000
        self.generate_stream = generate_stream
        self.stream_interval = stream_interval  # tokens per response after the first, as --stream-interval
        self.running_ids: set[str] = set()
        self.aborted: set[str] = set()  # a subset of running_ids
        self.num_generate_calls = 0
        self.num_generate_stream_calls = 0
        self.num_stream_messages = 0  # GenerateStreamResponses sent
        self.num_stream_aborts = 0  # request IDs received in GenerateStreamRequest.abort_request_ids

    def _position(self, token: int, k: int) -> engine_pb2.PositionLogprobs:
        top = [engine_pb2.Logprob(token_id=(token + 1 + j) % self.vocab_size, logprob=-1.0 - j, rank=2 + j)
               for j in range(k)]
        return engine_pb2.PositionLogprobs(token=engine_pb2.Logprob(token_id=token, logprob=-0.25, rank=1),
                                           top_logprobs=[t for t in top if t.token_id != token])

    def _count(self, step: int, max_tokens: int) -> int:
        """Tokens in the response that starts at ``step``: the first alone, then the interval's."""
        return 1 if step == 0 else min(self.stream_interval, max_tokens - step)

    def _response(self, request: engine_pb2.GenerateRequest, index: int, step: int,
                  max_tokens: int) -> engine_pb2.GenerateResponse:
        """Sequence ``index``'s response starting at token ``step`` (0-based) of a request of
        ``max_tokens``: ``_count`` tokens."""
        params = request.sampling_params
        end = step + self._count(step, max_tokens)
        tokens = [self.script[(index + s) % len(self.script)] for s in range(step, end)]
        response = engine_pb2.GenerateResponse(
            index=index, new_token_ids=tokens, num_prompt_tokens=len(request.prompt_token_ids),
            num_completion_tokens=end,
            finish_reason=engine_pb2.FINISH_REASON_LENGTH if end == max_tokens else 0)
        if params.HasField("logprobs"):
            response.new_logprobs.extend(self._position(token, params.logprobs) for token in tokens)
        if step == 0 and params.HasField("prompt_logprobs"):
            response.prompt_logprobs.positions.extend(
                self._position(t, params.prompt_logprobs) for t in request.prompt_token_ids[1:])
        return response

    def _max_tokens(self, request: engine_pb2.GenerateRequest) -> int:
        params = request.sampling_params
        room = self.max_model_len - len(request.prompt_token_ids)
        return min(params.max_tokens if params.HasField("max_tokens") else DEFAULT_MAX_TOKENS, room)

    async def Generate(self, request: engine_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        n = request.sampling_params.n or 1
        max_tokens = self._max_tokens(request)
        self.running_ids.add(request.request_id)
        self.num_generate_calls += 1
        try:
            step = 0
            while step < max_tokens:
                for index in range(n):
                    if request.request_id in self.aborted:
                        for rest in range(n):
                            await context.write(engine_pb2.GenerateResponse(
                                index=rest, finish_reason=engine_pb2.FINISH_REASON_ABORT,
                                num_prompt_tokens=len(request.prompt_token_ids)))
                        return
                    await context.write(self._response(request, index, step, max_tokens))
                step += self._count(step, max_tokens)
                if self.step_s:
                    await asyncio.sleep(self.step_s)
        finally:
            self.running_ids.discard(request.request_id)
            self.aborted.discard(request.request_id)

    async def GenerateStream(self, requests, context: grpc.aio.ServicerContext) -> None:
        self.num_generate_stream_calls += 1
        if not self.generate_stream:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        running: dict[str, list] = {}  # request ID -> [request, next step, max_tokens, deadline]
        arrived = asyncio.Event()

        async def read() -> None:
            async for message in requests:
                now = time.monotonic()
                for item in message.requests:
                    request = item.request
                    deadline = now + item.timeout_ms / 1000 if item.HasField("timeout_ms") else None
                    running[request.request_id] = [request, 0, self._max_tokens(request), deadline]
                    self.running_ids.add(request.request_id)
                self.num_stream_aborts += len(message.abort_request_ids)
                self.aborted.update(running.keys() & set(message.abort_request_ids))
                arrived.set()

        reader = asyncio.ensure_future(read())
        reader.add_done_callback(lambda _: arrived.set())
        try:
            while running or not reader.done():
                if not running:
                    arrived.clear()
                    await arrived.wait()
                    continue
                message = engine_pb2.GenerateStreamResponse()
                now = time.monotonic()
                for request_id, state in list(running.items()):
                    request, step, max_tokens, deadline = state
                    n = request.sampling_params.n or 1
                    entry = message.requests.add(request_id=request_id)
                    if request_id in self.aborted:
                        entry.responses.extend(engine_pb2.GenerateResponse(
                            index=i, finish_reason=engine_pb2.FINISH_REASON_ABORT,
                            num_prompt_tokens=len(request.prompt_token_ids)) for i in range(n))
                        entry.status.code = grpc.StatusCode.OK.value[0]
                    elif deadline is not None and now >= deadline:
                        entry.status.code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
                        entry.status.message = "The request's deadline passed."
                    else:
                        entry.responses.extend(self._response(request, i, step, max_tokens) for i in range(n))
                        state[1] = step = step + self._count(step, max_tokens)
                        if step < max_tokens:
                            continue
                        entry.status.code = grpc.StatusCode.OK.value[0]
                    del running[request_id]
                    self.running_ids.discard(request_id)
                    self.aborted.discard(request_id)
                await context.write(message)
                self.num_stream_messages += 1
                await asyncio.sleep(self.step_s)  # 0: lets the reader take new requests between steps
        finally:
            reader.cancel()
            for request_id in running:
                self.running_ids.discard(request_id)
                self.aborted.discard(request_id)

    async def Abort(self, request, context):
        self.aborted.update(self.running_ids.intersection(request.request_ids))  # unknown IDs: ignored
        return engine_pb2.AbortResponse()

    async def GetModelInfo(self, request, context):
        return engine_pb2.GetModelInfoResponse(
            model_name=self.model_name, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids, tokenizer_fingerprint=self.fingerprint, backend_version="stand-in")

    async def GetTokenizer(self, request, context):
        for name in self.files:
            data = Path(self.tokenizer_dir, name).read_bytes()
            for offset in range(0, max(len(data), 1), CHUNK_BYTES):
                await context.write(engine_pb2.GetTokenizerResponse(
                    file_name=name, file_size=len(data), offset=offset, data=data[offset:offset + CHUNK_BYTES]))

    async def GetLoad(self, request, context):
        return engine_pb2.GetLoadResponse(num_requests_running=len(self.running_ids), num_requests_waiting=0,
                                          kv_cache_usage=0.0)

    async def GetMetrics(self, request, context):
        return engine_pb2.GetMetricsResponse(prometheus_text="")


class StandInEngineClient:
    """The same stream as an in-process ``EngineClient`` (no gRPC): what the frontend's own code
    costs per token, with the wire and the HTTP server taken away (``bench/frontend_capacity.py
    --parts``). Takes the tokenizer's script, vocabulary size and EOS from a ``StandInServicer``."""

    def __init__(self, servicer: StandInServicer) -> None:
        from backend.types.outputs import EngineLoad, EngineOutput, FinishReason, Logprob, ModelInfo

        self._types = EngineOutput, FinishReason, Logprob
        self._info = ModelInfo(servicer.model_name, servicer.max_model_len, servicer.vocab_size,
                               servicer.eos_token_ids)
        self._load = EngineLoad(0, 0, 0.0)
        self.script, self.vocab_size = servicer.script, servicer.vocab_size

    async def generate(self, request_id, prompt_token_ids, params, *, deadline=None, cache_salt=None):
        EngineOutput, FinishReason, Logprob = self._types
        script, length = self.script, len(self.script)
        max_tokens = min(params.max_tokens, self._info.max_model_len - len(prompt_token_ids))
        for step in range(max_tokens):
            for index in range(params.n):
                token = script[(index + step) % length]
                logprobs = None
                if params.logprobs is not None:
                    position = {token: Logprob(-0.25, 1)}
                    for j in range(params.logprobs):
                        position.setdefault((token + 1 + j) % self.vocab_size, Logprob(-1.0 - j, 2 + j))
                    logprobs = [position]
                yield EngineOutput(request_id, index, [token], logprobs,
                                   FinishReason.LENGTH if step + 1 == max_tokens else None,
                                   num_prompt_tokens=len(prompt_token_ids))

    async def abort(self, request_id):
        pass

    async def model_info(self):
        return self._info

    async def get_load(self):
        return self._load

    async def health(self):
        return True


async def start_server(servicer: StandInServicer, host: str = "127.0.0.1", port: int = 0) -> tuple[grpc.aio.Server, int]:
    """Serve ``servicer`` and health (SERVING) on ``host:port`` (0: any free port); return the server and port."""
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20),
                                      ("grpc.max_receive_message_length", 64 << 20)])
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for service in ("", "tandem.engine.v1.EngineService"):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, bound


async def _serve(args: argparse.Namespace) -> None:
    servicer = StandInServicer(args.tokenizer, args.model_name, args.max_model_len, args.step_ms,
                               generate_stream=not args.no_generate_stream, stream_interval=args.stream_interval)
    server, port = await start_server(servicer, args.host, args.port)
    print(f"READY {port}", flush=True)
    await server.wait_for_termination()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", required=True, help="a tokenizer directory (tokenizer.json, ...)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed as READY <port>)")
    parser.add_argument("--model-name", default="stand-in")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--step-ms", type=float, default=0.0, help="pause between steps (0: as fast as asked)")
    parser.add_argument("--no-generate-stream", action="store_true",
                        help="answer GenerateStream UNIMPLEMENTED, as a backend older than that RPC")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="tokens per response after a sequence's first, as the backend's --stream-interval")
    args = parser.parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
