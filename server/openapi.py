"""The OpenAPI document (/openapi.json) as the server really behaves.

Request bodies are parsed in the worker pool (server/workers.py), not by FastAPI, so FastAPI would document
none; their schemas are added here. FastAPI's automatic 422 is replaced by the statuses the server sends
(400, 401, 404, 413, 500, 503), each with OpenAI's error object as its schema.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from tessera.server.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")  # routes that need an API key (app.EdgeGuard checks them)

_ERROR_DESCRIPTIONS = {
    400: "Invalid request: the message names the parameter (`param`)",
    401: "Missing or invalid API key",
    404: "Unknown model or route",
    413: "Request body larger than max_body_bytes",
    500: "The server failed while serving this request",
    503: "Loading, draining, a dead engine or a full queue; see Retry-After",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body."""

    error: ErrorDetail


class ProbeStatus(BaseModel):
    status: str


def body_doc(path: str) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON request body, by reference to the schema added below."""
    model = REQUEST_BODIES[path]
    schema = {"$ref": REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI) -> None:
    """Replace app.openapi with one that documents request bodies and the real error statuses."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            _add_schemas(document)
            for path, operations in document.get("paths", {}).items():
                for method, operation in operations.items():
                    _document_errors(path, method, operation)
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_schemas(document: dict[str, Any]) -> None:
    models = [*REQUEST_BODIES.values(), ErrorResponse, ProbeStatus]
    _, definitions = models_json_schema([(model, "validation") for model in models], ref_template=REF)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(definitions.get("$defs", {}))
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)


def _document_errors(path: str, method: str, operation: dict[str, Any]) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    statuses = {500}
    if path.startswith(PROTECTED_PREFIXES):
        statuses.add(401)
    if method == "post":
        statuses |= {400, 404, 413, 503}
    if "{model_id" in path:
        statuses.add(404)
    for status in sorted(statuses):
        responses[str(status)] = {
            "description": _ERROR_DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}},
        }
    if path in ("/health", "/ready"):
        responses["503"] = {
            "description": "Not live (a dead engine) or not ready (loading, draining)",
            "content": {"application/json": {"schema": {"$ref": REF.format(model="ProbeStatus")}}},
        }
