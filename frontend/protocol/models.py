"""/v1/models: the served model's card and the list of them."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from frontend.protocol.common import ResponseModel, created_now


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=created_now)
    owned_by: str = "tandem"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
