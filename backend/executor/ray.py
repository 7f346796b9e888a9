"""The ``ray`` executor: one Ray actor per device, in a placement group, on one or many machines.

Ray is the cluster layer: it places the actors (one placement-group bundle each: a GPU, or a CPU
on CPU-only clusters), starts them on whichever nodes have room, and reports their deaths. The
engine connects to the cluster this process already joined (``ray.init``), else to the one
``RAY_ADDRESS`` or a local ``ray start`` names, else starts a local one (on a thread of its own,
and ends it after the last Ray engine: see ray_connection.py). Ranks are ordered by
node, so a tensor-parallel group stays on one machine when it fits; rank 0's node hosts the
torch.distributed rendezvous. Each step's message is the same delta as the ``mp`` executor's.

Every node must have Tandem (and the model at the same path) installed, like any Ray job.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
from typing import Any, Optional

from backend.distributed import get_parallel_state, output_rank
from backend.executor.base import Executor
from backend.executor.ray_connection import RayConnection, connect_ray
from backend.executor.step_delta import StepDecoder, StepEncoder
from backend.messages.runner_output import ModelRunnerOutput
from backend.messages.scheduler_output import SchedulerOutput
from backend.models.resolve import config_for_workers
from backend.types.config import EngineConfig
from backend.types.errors import InvalidRequestError

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = float(os.environ.get("TANDEM_RAY_PLACEMENT_TIMEOUT_S", 120))


def import_ray():
    try:
        import ray
    except ImportError:
        raise InvalidRequestError(
            "The 'ray' executor needs Ray, which is not installed: pip install 'tandem[ray]'.",
            param="distributed_executor_backend") from None
    return ray


class RayWorker:
    """What runs inside each actor: a ``Worker`` plus the step-delta mirror."""

    def __init__(self) -> None:
        self.worker = None
        self.decoder = StepDecoder()
        self.is_output_rank = False
        self._stopped = threading.Event()

    def node_info(self) -> tuple[str, str, list[str]]:
        """(node ID, node IP, IDs of the GPUs Ray gave this actor)."""
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id(), ray.util.get_node_ip_address(), [str(g) for g in ray.get_gpu_ids()]

    def free_port(self) -> int:
        with socket.socket() as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def setup(self, config: EngineConfig, rank: int, local_rank: int, init_method: str,
              env: dict[str, str]) -> None:
        import ray

        from backend.worker.worker import Worker

        os.environ.update(env)
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
        num_threads = max(1, int(cpus)) if cpus and config.device_type == "cpu" else None
        self.worker = Worker(config, rank, local_rank, init_method, num_threads)
        self.is_output_rank = get_parallel_state().is_output_rank

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def execute_model(self, payload: bytes) -> Optional[ModelRunnerOutput]:
        output = self.worker.execute_model(self.decoder.decode(pickle.loads(payload)))
        return output if self.is_output_rank else None

    def wait_until_stopped(self) -> None:
        """Runs in its own concurrency group; it only returns (or fails) when the actor stops
        (or dies), which is how the engine hears of a death between steps."""
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()
        if self.worker is not None:
            self.worker.shutdown()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.ray = ray = import_ray()
        self.world_size = config.world_size
        self.output_rank = output_rank(config.tensor_parallel_size, config.pipeline_parallel_size)
        self.encoder = StepEncoder()
        self.actors: list[Any] = []
        self._stopping = False
        self._placement_group, self._owns_placement_group = None, False
        self._connection: RayConnection = connect_ray(ray)
        try:
            self._start_actors()
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _bundle(self) -> dict[str, float]:
        return {"GPU": 1.0} if self.config.device_type == "cuda" else {"CPU": 1.0}

    def _start_actors(self) -> None:
        ray = self.ray
        from ray.util.placement_group import get_current_placement_group, placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle()
        pg = get_current_placement_group()
        if pg is None:
            pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
            self._owns_placement_group = True
        self._placement_group = pg
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise InvalidRequestError(
                f"The Ray cluster did not offer {self.world_size} x {bundle} within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s (cluster resources: {ray.cluster_resources()}); add "
                "nodes or lower tensor_parallel_size x pipeline_parallel_size.",
                param="tensor_parallel_size")
        actor_cls = ray.remote(concurrency_groups={"monitor": 1})(RayWorker)
        actors = [actor_cls.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=i)).remote()
            for i in range(self.world_size)]
        self.actors = actors  # shutdown() kills them, whatever fails next
        infos = ray.get([a.node_info.remote() for a in actors])
        # Rank order: node by node (in order of first appearance), so TP groups share a machine.
        nodes = list(dict.fromkeys(node for node, _, _ in infos))
        order = sorted(range(len(actors)), key=lambda i: (nodes.index(infos[i][0]), i))
        self.actors = [actors[i] for i in order]
        self.node_ids = [infos[i][0] for i in order]
        master_ip = infos[order[0]][1]
        port = ray.get(self.actors[0].free_port.remote())
        init_method = f"tcp://{master_ip}:{port}" if self.world_size > 1 else None
        setups, worker_config = [], config_for_workers(self.config)
        for rank, actor in enumerate(self.actors):
            same_node = [r for r in range(self.world_size) if self.node_ids[r] == self.node_ids[rank]]
            env = {}
            if self.config.device_type == "cuda":  # each actor sees its node's GPUs, by local rank
                gpus = [g for r in same_node for g in infos[order[r]][2]]
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            setups.append(actor.setup.remote(worker_config, rank, same_node.index(rank), init_method, env))
        self._wait_all(setups)
        self._monitors = [a.wait_until_stopped.options(concurrency_group="monitor").remote()
                          for a in self.actors]
        threading.Thread(target=self._watch, name="tandem-ray-monitor", daemon=True).start()
        logger.info("ray executor: %d actors on %d node(s)", self.world_size, len(nodes))

    # ---- waiting on actors ---------------------------------------------------------------

    def _watch(self) -> None:
        """A monitor call returns only when its actor stops or dies."""
        done, _ = self.ray.wait(self._monitors, num_returns=1)
        if self._stopping:
            return
        rank = self._monitors.index(done[0])
        try:
            self.ray.get(done[0])
            detail = "stopped unexpectedly"
        except Exception as error:
            detail = f"died: {type(error).__name__}: {str(error).strip().splitlines()[0]}"
        self._fail(f"Ray worker rank {rank} (node {self.node_ids[rank][:12]}) {detail}; the engine "
                   "cannot continue.")

    def _wait_all(self, refs: list) -> list[Any]:
        """Results of ``refs`` (one per rank), raising at the first failure, whichever rank."""
        pending = list(refs)
        while pending:
            done, pending = self.ray.wait(pending, num_returns=1)
            try:
                self.ray.get(done[0])
            except Exception as error:
                rank = refs.index(done[0])
                raise self._fail(f"Ray worker rank {rank} failed: {type(error).__name__}: {error}") from None
        return self.ray.get(refs)

    # ---- the executor interface -------------------------------------------------------------

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self._check_alive()
        return self._wait_all([a.call.remote(method, *args) for a in self.actors])

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._check_alive()
        payload = pickle.dumps(self.encoder.encode(sched), protocol=pickle.HIGHEST_PROTOCOL)
        return self._wait_all([a.execute_model.remote(payload) for a in self.actors])[self.output_rank]

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        ray = self.ray
        try:
            if self.failure is None and self.actors:
                try:  # let the workers leave torch.distributed cleanly
                    ray.wait([a.stop.remote() for a in self.actors], num_returns=len(self.actors),
                             timeout=10)
                except Exception:
                    pass
            for actor in self.actors:
                ray.kill(actor)
            if self._owns_placement_group and self._placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._placement_group)
        finally:  # ends Ray if Tandem started it and no other engine uses it
            self._connection.release()
