"""/v1/models: the one model this server serves, under its served name."""

from __future__ import annotations

from backend.types.errors import ModelNotFoundError
from frontend import protocol as P
from frontend.serving.base import OpenAIServing


class OpenAIServingModels(OpenAIServing):
    """List the served model, or describe it by name (404 for any other name)."""

    def models(self) -> P.ModelList:
        return P.ModelList(data=[self.model_card(self.model_name)])

    def model_card(self, model_id: str) -> P.ModelCard:
        if model_id != self.model_name:
            raise ModelNotFoundError(f"The model `{model_id}` does not exist.")
        return P.ModelCard(id=self.model_name, root=self.model_name, max_model_len=self.model_info.max_model_len)
