"""/load and /version: what the server reports about itself."""

from __future__ import annotations

from frontend.protocol.common import ResponseModel


class LoadResponse(ResponseModel):
    server_load: int  # generation requests this frontend is answering


class VersionResponse(ResponseModel):
    version: str
