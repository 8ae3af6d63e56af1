"""`/openapi.json` and `/docs` from the real request and response models (docs/design.md §4.2).

The generation routes read their raw body (strict parsing, size limit, our error shape), so
FastAPI cannot infer their schemas; they are added here from the pydantic models the service
parses with, and the error shape every route answers with.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from deploy.openai.bodies import ChatCompletionResponse, CompletionResponse
from deploy.openai.schema import ChatCompletionRequest, CompletionRequest

ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def body_spec(request: type[BaseModel], response: type[BaseModel]) -> dict[str, Any]:
    """The `openapi_extra` of a POST route parsing `request` and answering `response` or SSE."""
    errors = {str(s): {"description": d, "content": {"application/json": {"schema": _ref("Error")}}}
              for s, d in ((400, "invalid request"), (404, "unknown model"), (413, "body too large"),
                           (429, "busy"), (503, "unavailable"))}  # fmt: skip
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request.__name__)}}},
        "responses": {
            "200": {
                "description": "the completion, or server-sent events with `stream: true`",
                "content": {
                    "application/json": {"schema": _ref(response.__name__)},
                    "text/event-stream": {"schema": {"type": "string"}},
                },
            },
            **errors,
        },
    }


def install_openapi(app: FastAPI, model_name: str) -> None:
    """Make `app.openapi()` include the request/response models of the generation routes; the
    `model` field lists the one served name (anything else is a 404)."""
    models = (CompletionRequest, ChatCompletionRequest, CompletionResponse, ChatCompletionResponse)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas["Error"] = ERROR_SCHEMA
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}", by_alias=True)
                schemas.update(schema.pop("$defs", {}))
                if "model" in schema.get("properties", {}) and model.__name__.endswith("Request"):
                    schema["properties"]["model"]["enum"] = [model_name]
                schemas[model.__name__] = schema
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
