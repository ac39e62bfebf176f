"""A three-component pipeline for the pod harness's empty-loop test
(tests/pipelines/test_cluster_harness.py): a ParallelFor over a list parameter, its outputs
`dsl.Collected` into one task, inside an exit handler. No `from __future__ import annotations`:
KFP reads the components' annotations as types."""

from typing import List  # noqa: UP035 - KFP reads the annotation

from kfp import dsl


def component(func):
    """A lightweight component that installs nothing when its pod starts."""
    return dsl.component(
        base_image="python:3.11", packages_to_install=[], install_kfp_package=False
    )(func)


@component
def make(n: str, out: dsl.Output[dsl.Dataset]):
    with open(out.path, "w") as f:
        f.write(n)


@component
def total(parts: dsl.Input[List[dsl.Dataset]]) -> int:  # noqa: UP006
    return len(parts)


@component
def end(status: dsl.PipelineTaskFinalStatus):
    print("state", status.state)


@dsl.pipeline(name="empty-loop")
def empty_loop(items: list = []):  # noqa: B006 - KFP stores the default in the spec
    with dsl.ExitHandler(end()):
        with dsl.ParallelFor(items) as item:
            made = make(n=item)
        total(parts=dsl.Collected(made.outputs["out"]))
