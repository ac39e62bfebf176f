"""A small pipeline with trigger conditions for the pod harness and the CEL subset
(tests/pipelines/test_kfp_cel.py): a ParallelFor over structs whose iterations run a branch only
when a task's output equals a parameter (the pipeline's compression branch), a loop item's field
read through a parameterExpressionSelector, and conditions of each parameter type the SDK
compiles, inside an exit handler. No `from __future__ import annotations`: KFP reads the
components' annotations as types."""

from typing import List  # noqa: UP035 - KFP reads the annotation

from kfp import dsl


def component(func):
    """A lightweight component that installs nothing when its pod starts."""
    return dsl.component(
        base_image="python:3.11", packages_to_install=[], install_kfp_package=False
    )(func)


@component
def jobs() -> List[dict]:  # noqa: UP006
    return [{"name": "a", "tag": "first"}, {"name": "b", "tag": "second"}]


@component
def named(job: dict) -> str:
    return job["name"]


@component
def show(text: str):
    print("show", text)


@component
def end(status: dsl.PipelineTaskFinalStatus):
    print("state", status.state)


@dsl.pipeline(name="conditions")
def conditions(want: str = "a", steps: int = 3, rate: float = 0.5, flag: bool = False):
    with dsl.ExitHandler(end()):
        made = jobs()
        with dsl.ParallelFor(made.output) as job:
            name = named(job=job)
            with dsl.If(name.output == want, name="chosen"):
                show(text=job.tag)
        with dsl.If(steps > 2, name="int-gt"):
            show(text="steps")
        with dsl.If(rate <= 0.25, name="float-le"):
            show(text="rate")
        with dsl.If(flag == True, name="bool-eq"):  # noqa: E712 - a KFP condition, not Python
            show(text="flag")
        with dsl.If(want != "b", name="str-ne"):
            show(text="not b")
