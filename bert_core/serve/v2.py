"""The Open Inference (V2) protocol for `bert serve`: KServe's own server code around our model.

A client written against the laptop must work against the cluster, where KServe serves the model
as an InferenceService. So the V2 routes (`/v2/health/live`, `/v2/health/ready`,
`/v2/models/NAME`, `/v2/models/NAME/ready`, `/v2/models/NAME/infer`, and KServe's V1
`/v1/models/NAME:predict`) are not ours: they are the `kserve` SDK's REST server and data plane
(kserve 0.20.0, `kserve.protocol.rest`, the newest release whose source, tag v0.20.0, we could
read), the code a KServe custom predictor runs, with our model as a `kserve.Model` (`V2Model`).
Its error bodies are KServe's (`{"error": "..."}`: 400 for input the model refuses, 404 for
another model name).

Why not KServe's MLflow runtime (MLServer with mlserver-mlflow): MLServer 1.7.1 requires
fastapi < 0.116, which holds starlette at 0.46, under the fixes of CVE-2025-54121 (0.47.2) and
CVE-2025-62727 (0.49.1); our lock's starlette is 1.10. The kserve SDK asks starlette >= 1.0.1;
its own pins (pandas < 3, psutil < 6) cost the lock a pandas 2.3 and a psutil 5.9.

The tensors are the model's MLflow signature, a tensor per column (shape [rows]): every input
BYTES, named as the model's columns (`text`, `text_pair`, `question`, `context`, ...); every
output field of the answer a tensor: BYTES for text, FP64 / INT64 / BOOL for numbers and flags,
and BYTES holding each row's JSON for a list or an object (NER's entities, fill-mask's
candidates), as MLServer's pandas codec sends object columns.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pandas as pd
from fastapi.exceptions import RequestValidationError
from fastapi.responses import ORJSONResponse
from kserve import Model
from kserve.errors import InvalidInput
from kserve.protocol.infer_type import InferOutput, InferRequest, InferResponse
from kserve.utils.utils import generate_uuid
from starlette.exceptions import HTTPException

from bert_core.serve.mlflow_model import RefusedInput

log = logging.getLogger("uvicorn.error")  # the server's log (bert_core.serve.server's)

# MLflow signature types -> V2 datatypes; an Array or Object (anything else) is JSON in BYTES
DATATYPES = {
    "string": "BYTES",
    "double": "FP64",
    "float": "FP32",
    "long": "INT64",
    "integer": "INT32",
    "boolean": "BOOL",
}


def datatype(mlflow_type: Any) -> str:
    return DATATYPES.get(str(getattr(mlflow_type, "name", mlflow_type)), "BYTES")


class V2Model(Model):
    """One served model as KServe sees it: `predict` takes a V2 request (or a V1 `instances`
    list of row objects) and answers with `model`, the batched pyfunc model `bert serve`
    also hands MLflow's scoring app, so both protocols give the same answers."""

    def __init__(self, name: str, model, signature):
        super().__init__(name)
        self.model = model
        self.inputs = [(c.name, not c.required) for c in signature.inputs.inputs]
        self.outputs = [(c.name, datatype(c.type)) for c in signature.outputs.inputs]
        self.ready = True

    def get_input_types(self) -> list[dict]:
        return [{"name": name, "datatype": "BYTES", "shape": [-1]} for name, _ in self.inputs]

    def get_output_types(self) -> list[dict]:
        return [{"name": name, "datatype": kind, "shape": [-1]} for name, kind in self.outputs]

    async def predict(self, payload, headers=None, response_headers=None):
        if isinstance(payload, dict):  # V1: {"instances": [{"text": ...}, ...]}
            rows = payload.get("instances")
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise InvalidInput('expected {"instances": [{COLUMN: TEXT, ...}, ...]}')
            return {"predictions": await self._answer(pd.DataFrame(rows))}
        answers = await self._answer(self.frame(payload))
        # the request's id, else a new one, as KServe's own models answer (utils.generate_uuid)
        return InferResponse(payload.id or generate_uuid(), self.name, self.tensors(answers))

    def frame(self, request: InferRequest) -> pd.DataFrame:
        """The request's tensors as the model's input rows: each a 1-D BYTES tensor named as
        a column of the model, all of one length."""
        known = {name for name, _ in self.inputs}
        columns: dict[str, list[str]] = {}
        for tensor in request.inputs:
            if tensor.name not in known:
                raise InvalidInput(
                    f"input {tensor.name!r}: not an input of this model (its "
                    f"inputs: {sorted(known)})"
                )
            if tensor.datatype != "BYTES" or len(tensor.shape) != 1:
                raise InvalidInput(
                    f"input {tensor.name!r}: expected a BYTES tensor of shape "
                    f"[rows], got {tensor.datatype} {tensor.shape}"
                )
            try:  # KServe reshapes the data to the declared shape
                values = tensor.as_numpy().tolist()
            except ValueError:
                raise InvalidInput(
                    f"input {tensor.name!r}: its data do not fit its shape {tensor.shape}"
                ) from None
            for row, v in enumerate(values):  # MLflow's schema check would fail with a 500
                if not isinstance(v, str | bytes):
                    raise InvalidInput(
                        f"input {tensor.name!r}: row {row} is {type(v).__name__}, not text"
                    )
            columns[tensor.name] = [_text(v) for v in values]
        missing = [name for name, optional in self.inputs if not optional and name not in columns]
        if missing:  # MLflow's schema check would fail with a 500
            raise InvalidInput(
                f"missing input {', '.join(map(repr, missing))} (this model's "
                f"inputs: {sorted(known)})"
            )
        if len({len(v) for v in columns.values()}) > 1:
            shapes = {k: len(v) for k, v in columns.items()}
            raise InvalidInput(f"inputs of different lengths: {shapes}")
        return pd.DataFrame(columns)

    def tensors(self, answers: list[dict]) -> list[InferOutput]:
        """One tensor per field of the model's answer (see the module doc)."""
        out = []
        for name, kind in self.outputs:
            values = [row.get(name) for row in answers]
            if kind == "BYTES":
                values = [v if isinstance(v, str) else json.dumps(v) for v in values]
            out.append(InferOutput(name, [len(values)], kind, values))
        return out

    async def _answer(self, frame: pd.DataFrame) -> list[dict]:
        """The model's answers, computed in a worker thread (the batching queue joins them with
        concurrent requests of either protocol); refused input -> KServe's 400."""
        try:
            return await asyncio.to_thread(self.model.predict, frame)
        except RefusedInput as e:
            raise InvalidInput(e.message) from None


def _text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def v2_app(model: V2Model):
    """KServe's REST app serving `model` alone: its V2 and V1 routes, middleware and error
    handlers (`RESTServer`), on a FastAPI app made as kserve.model_server makes its own."""
    from importlib.metadata import version

    from fastapi import FastAPI
    from kserve.model_repository import ModelRepository
    from kserve.protocol.dataplane import DataPlane
    from kserve.protocol.model_repository_extension import ModelRepositoryExtension
    from kserve.protocol.rest.server import RESTServer

    repository = ModelRepository()
    repository.update(model)
    rest = RESTServer(
        "kserve.model_server:app",
        DataPlane(repository),
        ModelRepositoryExtension(repository),
        http_port=0,
    )
    app = FastAPI(
        title="KServe ModelServer",
        version=version("kserve"),
        docs_url=None,
        redoc_url=None,
        default_response_class=ORJSONResponse,
    )
    # what RESTServer.create_application does to kserve.model_server's module-level app (one per
    # process), done to this one: a process may build an app per model (the tests do)
    rest._add_middlewares(app)
    rest._register_endpoints(app)
    rest._add_exception_handlers(app)
    # in the V2 error shape too: FastAPI's own refusals (a body that is not JSON or nested past
    # the parser's depth: 400; fields of the wrong type: 422, both `{"detail": ...}` by default),
    # and anything unexpected, which KServe answers 500 with the exception's type and text
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(Exception, _internal_error)
    return app


async def _http_error(request, exc):
    return ORJSONResponse({"error": str(exc.detail)}, exc.status_code, headers=exc.headers)


async def _invalid_request(request, exc):
    first = (exc.errors() or [{}])[0]
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    if first.get("type") == "json_invalid":  # a malformed request, not a wrong value: 400
        return ORJSONResponse({"error": f"the body is not JSON (error at character {where})"}, 400)
    message = f"{where or 'request'}: {first.get('msg', 'not a valid request')}"
    return ORJSONResponse({"error": message}, 422)


async def _internal_error(request, exc):
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return ORJSONResponse({"error": "internal error (the server's log has the details)"}, 500)
