"""gRPC server reflection under both names clients ask: grpc.reflection.v1 and v1alpha.

grpcio-reflection implements only ``grpc.reflection.v1alpha``; grpcurl and newer tools
ask ``grpc.reflection.v1``. The two protocols are the same messages, field numbers
included, under another package (protos/grpc/reflection/v1/reflection.proto), so v1 is
served by re-reading each v1 request's bytes as v1alpha, letting grpcio-reflection
answer, and re-reading its answer's bytes as v1: one implementation, two names.
"""

from __future__ import annotations

from typing import AsyncIterable, AsyncIterator, Iterable

import grpc
from grpc_reflection.v1alpha import reflection as reflection_v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_pb2_grpc

from protos.grpc.reflection.v1 import reflection_pb2 as v1_pb2
from protos.grpc.reflection.v1 import reflection_pb2_grpc as v1_pb2_grpc

V1_SERVICE_NAME = v1_pb2.DESCRIPTOR.services_by_name["ServerReflection"].full_name  # grpc.reflection.v1...
V1ALPHA_SERVICE_NAME = reflection_v1alpha.SERVICE_NAME


class ReflectionV1Servicer(v1_pb2_grpc.ServerReflectionServicer):
    """``grpc.reflection.v1`` answered by a v1alpha servicer: one response per request, in order."""

    def __init__(self, v1alpha: reflection_v1alpha.aio.ReflectionServicer) -> None:
        self._v1alpha = v1alpha

    async def ServerReflectionInfo(self, request_iterator: AsyncIterable[v1_pb2.ServerReflectionRequest],
                                   context: grpc.aio.ServicerContext,
                                   ) -> AsyncIterator[v1_pb2.ServerReflectionResponse]:
        async def as_v1alpha() -> AsyncIterator[v1alpha_pb2.ServerReflectionRequest]:
            async for request in request_iterator:
                yield v1alpha_pb2.ServerReflectionRequest.FromString(request.SerializeToString())

        async for response in self._v1alpha.ServerReflectionInfo(as_v1alpha(), context):
            yield v1_pb2.ServerReflectionResponse.FromString(response.SerializeToString())


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both
    reflection services; descriptors come from protobuf's default pool."""
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    v1alpha = reflection_v1alpha.aio.ReflectionServicer(names)
    v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(v1alpha, server)
    v1_pb2_grpc.add_ServerReflectionServicer_to_server(ReflectionV1Servicer(v1alpha), server)
