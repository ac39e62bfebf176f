"""The KFP driver's CEL in the pod harness (`tests/cluster/kfp_cel.py`: cel-python with the
driver's `parseJson`): the conditions and selectors the pinned SDK compiles evaluate as the
driver's would, CEL's errors are the driver's, the known differences from cel-go are pinned, and
the harness runs a pipeline with branches as the backend does (an untriggered branch is
CANCELED, fails nothing, and leaves its DAG unsettled)."""

from __future__ import annotations

import re

import pytest
import yaml
from kfp import compiler

from pipelines.bert_pipeline import SPEC
from tests.cluster import kfp_cel, pod_env, pod_harness
from tests.condition_pipeline import conditions
from tests.pipeline_helpers import cluster_objects


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    path = tmp_path_factory.mktemp("conditions") / "conditions.yaml"
    compiler.Compiler().compile(conditions, str(path))
    return path


def _conditions(path) -> dict[str, str]:
    """Branch name -> its compiled trigger condition, over every DAG of the spec (of branches
    compiled twice, as the fan-out's in both branches of phase two, the last)."""
    (pipeline, *_) = yaml.safe_load_all(path.read_text())
    dags = [
        c["dag"]["tasks"]
        for c in [pipeline["root"], *pipeline["components"].values()]
        if "dag" in c
    ]
    branches = [t for d in dags for t in d.values() if "condition" in t.get("triggerPolicy", {})]
    return {t["taskInfo"]["name"]: t["triggerPolicy"]["condition"] for t in branches}


def test_each_condition_the_sdk_compiles_evaluates_as_python_would(spec):
    """A parameter is a protobuf Value (a number is a double, which the SDK casts with int()
    for an int parameter): each condition compared with the same test in Python."""
    found = _conditions(spec)
    assert set(found) == {"chosen", "int-gt", "float-le", "bool-eq", "str-ne"}
    channel = "pipelinechannel--"
    cases = [(3, 0.5, False, "a"), (2, 0.25, True, "b"), (10, 0.1, True, "")]
    for steps, rate, flag, want in cases:
        params = {
            f"{channel}steps": steps,
            f"{channel}rate": rate,
            f"{channel}flag": flag,
            f"{channel}want": want,
            f"{channel}named-Output": "a",
        }
        expected = {
            "chosen": want == "a",
            "int-gt": steps > 2,
            "float-le": rate <= 0.25,
            "bool-eq": flag is True,
            "str-ne": want != "b",
        }
        got = {name: kfp_cel.condition(text, params) for name, text in found.items()}
        assert got == expected, (params, found)


@pytest.mark.parametrize(
    "branch, parameter", [("compress", "compress_task"), ("deploy", "deploy_task")]
)
def test_the_pipelines_branches_run_for_the_named_job_only(branch, parameter):
    condition = _conditions(SPEC)[branch]
    (finetune,) = re.findall(r"pipelinechannel--(finetune[-\d]*)-Output", condition)
    output = f"pipelinechannel--{finetune}-Output"
    task = {f"pipelinechannel--{parameter}": "SST-2"}
    for job, runs in [("SST-2", True), ("SST-2 (random init)", False), ("STS-B", False)]:
        assert kfp_cel.condition(condition, task | {output: job}) is runs
    off = {f"pipelinechannel--{parameter}": "none", output: "SST-2"}
    assert kfp_cel.condition(condition, off) is False


def test_phase_two_runs_when_it_has_steps_and_its_other_branch_when_not():
    """The pipeline's phase-two branch and its `dsl.Else`: exactly one runs, by the steps
    given (the driver hands an int parameter to CEL as a double)."""
    found = _conditions(SPEC)
    for steps, phase2 in [(0, False), (0.0, False), (2000.0, True), (1, True)]:
        params = {"pipelinechannel--pretrain_phase2_steps": steps}
        assert kfp_cel.condition(found["phase2"], params) is phase2, steps
        assert kfp_cel.condition(found["phase1-only"], params) is not phase2, steps


def test_the_pipelines_selectors_read_a_fine_tuning_jobs_field():
    """The committed spec's selectors (a loop item's field) on a job as finetune-jobs makes it:
    a STRUCT value, whose `string_value` is its JSON."""
    (pipeline, *_) = yaml.safe_load_all(SPEC.read_text())
    tasks = [
        t
        for c in [pipeline["root"], *pipeline["components"].values()]
        for t in c.get("dag", {}).get("tasks", {}).values()
    ]
    selectors = {
        p["parameterExpressionSelector"]
        for t in tasks
        for p in t.get("inputs", {}).get("parameters", {}).values()
        if "parameterExpressionSelector" in p
    }
    assert selectors == {'parseJson(string_value)["data_digest"]'}
    job = {"name": "SST-2", "task": "SST-2", "data_digest": "sha256:ab", "options": ["--x", "1"]}
    assert kfp_cel.select(selectors.pop(), job) == "sha256:ab"


def test_cel_errors_are_the_drivers():
    """As expression.go and its tests at 2.17.0: a missing key, a condition that is not a bool,
    an operator with no overload and a parse error fail; `!`, `&&`, casts and any CEL run."""
    with pytest.raises(kfp_cel.EvaluationError, match="no such key"):
        kfp_cel.condition("inputs.parameter_values['x'] == 'a'", {})
    with pytest.raises(kfp_cel.EvaluationError, match="not bool"):
        kfp_cel.condition("inputs.parameter_values['s']", {"s": "a"})
    with pytest.raises(kfp_cel.EvaluationError, match="overload"):
        kfp_cel.condition("inputs.parameter_values['s'] < 2", {"s": "a"})
    with pytest.raises(kfp_cel.EvaluationError):
        kfp_cel.condition("inputs.parameter_values['s'] ==", {"s": "a"})
    assert kfp_cel.condition("int(inputs.parameter_values['n']) == 2", {"n": 2.0})
    assert kfp_cel.condition("inputs.parameter_values['n'] == 2.0", {"n": 2})  # a Value: double
    assert kfp_cel.condition("!(inputs.parameter_values['s'] == 'a') && true == true", {"s": "b"})
    assert kfp_cel.condition("inputs.parameter_values['s'] == 'a && b'", {"s": "a && b"})
    assert kfp_cel.condition("size(inputs.parameter_values['l']) == 0", {"l": []})
    selector = 'parseJson(string_value)["tag"]'
    assert kfp_cel.select(selector, {"tag": "x", "n": 1}) == "x"
    assert kfp_cel.select(selector, '{"tag": "y"}') == "y"  # a string value: its text is JSON
    assert kfp_cel.select('parseJson(string_value)["n"] == 1.0', {"n": 1}) is True  # a double
    assert kfp_cel.select("string_value", {"n": 1}) == '{"n":1}'
    with pytest.raises(kfp_cel.EvaluationError, match="no such key"):
        kfp_cel.select(selector, {"other": 1})
    with pytest.raises(kfp_cel.EvaluationError, match="unmarshal"):
        kfp_cel.select(selector, "not json")


def test_where_cel_python_differs_from_the_drivers_cel_go():
    """cel-python 0.5.0 against cel-go 0.27.0 (the backend's): no heterogeneous equality
    (cel-go: `1.0 == 1` true, `'a' == 1` false; backend/src/v2/expression/expression_test.go
    "errorOnTypeMismatch"), a bool equal to 1, int(bool). The SDK never writes these (it casts
    both sides to one type); when this fails, cel-python changed: update kfp_cel's docstring."""
    for text in ("inputs.parameter_values['n'] == 1", "inputs.parameter_values['s'] == 1"):
        with pytest.raises(kfp_cel.EvaluationError, match="overload"):  # cel-go: true, false
            kfp_cel.condition(text, {"n": 1, "s": "a"})
    assert kfp_cel.condition("inputs.parameter_values['b'] == 1", {"b": True})  # cel-go: false
    assert kfp_cel.condition("int(inputs.parameter_values['b']) == 1", {"b": True})  # cel-go: error


def test_the_harness_skips_untriggered_branches_as_the_backend_does(spec, tmp_path):
    """want "a": iteration 0's branch runs (the selector gives its struct's `tag`), iteration
    1's is created CANCELED and skipped; the run succeeds. Iteration 1 published nothing after
    its branch was created, so it, the loop and the body stay RUNNING (only launchers settle a
    DAG: metadata/client.go UpdateDAGExecutionsState), and the exit handler is handed RUNNING."""
    objects = cluster_objects(
        pod_env.manifest_objects(), "http://127.0.0.1:1", "http://127.0.0.1:1"
    )
    harness = pod_harness.Harness(spec, objects, tmp_path)
    assert harness.run({"want": "a", "steps": 1, "flag": True}) == pod_harness.SUCCEEDED
    ran = {t.path: t for t in harness.tasks}
    chosen = [p for p in ran if p.startswith("/exit-handler-1/for-loop-2[")]
    assert sorted(chosen) == [
        "/exit-handler-1/for-loop-2[0]/condition-3/show",
        "/exit-handler-1/for-loop-2[0]/named",
        "/exit-handler-1/for-loop-2[1]/named",
    ]
    assert ran["/exit-handler-1/for-loop-2[0]/condition-3/show"].parameters == {"text": "first"}
    top = sorted(p.split("/")[2] for p in ran if p.count("/") == 3 and "for-loop" not in p)
    assert top == ["condition-6", "condition-7"]  # flag == true, want != "b"; not steps > 2
    (body,) = [e for e in harness.dag.children if e.name == "exit-handler-1"]
    states = {e.name: e.state for e in body.children}
    assert states["condition-4"] == states["condition-5"] == "CANCELED"
    (loop,) = [e for e in body.children if e.name == "for-loop-2"]
    assert [i.state for i in loop.children] == ["COMPLETE", "RUNNING"]
    assert [c.state for c in loop.children[1].children] == ["COMPLETE", "CANCELED"]
    (end,) = [t for t in harness.tasks if "status" in t.parameters]
    assert end.parameters["status"]["state"] == "RUNNING"
