"""The HTTP routes. Thin: each parses its body (pydantic), finds the served model and delegates.

Inference routes (/v1/*, /tokenize, /detokenize) sit behind the API-key check in app.EdgeGuard; /health,
/ready and /version never need a key, so probes work without one.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.responses import Response

from tessera.server.chat import create_chat_completion
from tessera.server.completions import create_completion
from tessera.server.errors import RETRY_LATER_HEADERS, model_not_found
from tessera.server.openapi import body_doc
from tessera.server.prepare import ServedModel, chat_prompt_ids, check_model, check_token_ids, text_prompt_ids
from tessera.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionInfo,
)
from tessera.server.state import AppState
from tessera.server.version import tessera_version
from tessera.server.workers import json_body

router = APIRouter()

def _state(request: Request) -> AppState:
    return request.app.state.tessera


def _json(result: BaseModel | Response) -> Response:
    return result if isinstance(result, Response) else JSONResponse(result.model_dump(mode="json"))


# ---- inference ------------------------------------------------------------------------------------


@router.post("/v1/chat/completions", response_model=None, openapi_extra=body_doc("/v1/chat/completions"))
async def chat_completions(request: Request,
                           body: ChatCompletionRequest = Depends(json_body(ChatCompletionRequest))) -> Response:
    state = _state(request)
    served = state.require_model()
    return _json(await create_chat_completion(body, served, state.inflight, request, state.workers, state.limits))


@router.post("/v1/completions", response_model=None, openapi_extra=body_doc("/v1/completions"))
async def completions(request: Request, body: CompletionRequest = Depends(json_body(CompletionRequest))) -> Response:
    state = _state(request)
    served = state.require_model()
    return _json(await create_completion(body, served, state.inflight, request, state.workers, state.limits))


# ---- models ---------------------------------------------------------------------------------------


def _card(served: ServedModel) -> ModelCard:
    info = served.info
    return ModelCard(id=info.name, created=info.created, root=info.root, max_model_len=info.max_model_len)


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    served = _state(request).served
    return ModelList(data=[_card(served)] if served is not None else [])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def get_model(model_id: str, request: Request) -> ModelCard:
    served = _state(request).served
    if served is None or model_id != served.info.name:
        raise model_not_found(model_id)
    return _card(served)


# ---- tokenizer --------------------------------------------------------------------------------------


@router.post("/tokenize", response_model=TokenizeResponse, openapi_extra=body_doc("/tokenize"))
async def tokenize(request: Request, body: TokenizeRequest = Depends(json_body(TokenizeRequest))) -> Response:
    state = _state(request)
    served = state.require_model()
    check_model(body.model, served.info)
    # Tokenizing and writing a million ids as JSON take a while: both in the worker pool.
    return await state.workers.run(_tokenize, body, served)


def _tokenize(body: TokenizeRequest, served: ServedModel) -> Response:
    if body.prompt is not None:
        ids = text_prompt_ids(served.tokenizer, body.prompt, add_bos=body.add_special_tokens)
    else:
        # The same rendering as /v1/chat/completions, so the count is what a chat request would use.
        chat = ChatCompletionRequest(model=served.info.name, messages=body.messages or [], tools=body.tools,
                                     chat_template_kwargs=body.chat_template_kwargs)
        chat.unsupported_values()
        ids = chat_prompt_ids(served.tokenizer, chat, chat.thinking(), body.add_generation_prompt)
    return _json(TokenizeResponse(count=len(ids), max_model_len=served.info.max_model_len, tokens=ids))


@router.post("/detokenize", response_model=DetokenizeResponse, openapi_extra=body_doc("/detokenize"))
async def detokenize(request: Request,
                     body: DetokenizeRequest = Depends(json_body(DetokenizeRequest))) -> DetokenizeResponse:
    served = _state(request).require_model()
    check_model(body.model, served.info)
    check_token_ids(body.tokens, served.tokenizer.vocab_size, param="tokens")
    return DetokenizeResponse(prompt=await _state(request).workers.run(served.tokenizer.decode, body.tokens))


# ---- probes ---------------------------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: the process answers, and the engine thread (once started) is alive."""
    state = _state(request)
    served = state.served
    if served is not None and not state.is_draining and not served.engine.stats().is_alive:
        return JSONResponse({"status": "engine_dead"}, status_code=503, headers=RETRY_LATER_HEADERS)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 only while serving; 503 while the model loads or the server drains."""
    phase = _state(request).phase
    if phase == "ready":
        return JSONResponse({"status": phase})
    return JSONResponse({"status": phase}, status_code=503, headers=RETRY_LATER_HEADERS)


@router.get("/version", response_model=VersionInfo)
async def version() -> VersionInfo:
    return VersionInfo(version=tessera_version())
