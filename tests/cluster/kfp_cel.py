"""The two CEL evaluations of the KFP backend's driver, for the pod harness, on cel-python.

The driver evaluates CEL (google/cel-go v0.27.0, its go.mod at kubeflow/pipelines 2.17.0) in
two places (`backend/src/v2/expression/expression.go`): a task's `triggerPolicy.condition`
(`Condition`, over the task's resolved inputs as an ExecutorInput: `inputs.parameter_values
['NAME']`; true runs the task, false creates its execution CANCELED and Argo skips it,
driver/dag.go 84-91, container.go 88-95, compiler/argocompiler/dag.go 278-280) and an input's
`parameterExpressionSelector` (`Select`, over the fields of one protobuf Value plus
`string_value`, its text: metadata/converter.go PbValueToText; driver/resolve.go 145-165). Both
environments declare one custom function, `parseJson(string) -> dyn` (encoding/json into
`interface{}`: every number a double).

Here the same expressions run on cel-python (`celpy`) with `parseJson` registered the same way.
The SDK writes (kfp 2.17.0 `compiler/pipeline_spec_builder.py`:
`_single_binary_operation_to_cel_condition`, `_binary_operations_to_cel_conjunctive` for
`dsl.If`; `parseJson(string_value)["KEY"]` for a loop item's field) comparisons of input
parameters and literals joined by `&&`, each maybe negated as `!(...)`, both sides cast to one
type with `int(...)` / `double(...)` or quoted; cel-python evaluates that grammar as cel-go does
(tests/pipelines/test_kfp_cel.py: every condition the SDK compiles, against Python). A parameter
value is a protobuf Value, so a number is a CEL double (`_value`), as in the driver.

Where cel-python 0.5.0 and cel-go 0.27.0 differ (none of it in what the SDK writes, which never
compares two types; the test pins each, so an upgrade that changes one shows):
- equality across types: cel-go answers `1.0 == 1` true and `'a' == 1` false (heterogeneous
  equality; the backend's own expression_test.go "errorOnTypeMismatch" expects true), cel-python
  fails with no matching overload; and `true == 1` is true in cel-python (its bool is a Python
  int), false in cel-go;
- `int(true)`: cel-go has no int(bool) overload, cel-python gives 1.

What CEL fails on (a key that is not an input, an operator with no overload, a parse error, a
condition that is not a bool) is an `EvaluationError`: the driver's error, which fails the task.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import celpy
from celpy import celtypes


class EvaluationError(ValueError):
    """What CEL fails on (the driver then fails the task)."""


def _parse_json(text: Any) -> Any:
    """expression.go celParseJson: a string's JSON, numbers as doubles (Go's float64)."""
    if not isinstance(text, celtypes.StringType):
        raise celpy.CELEvalError(f"no such overload: parseJson({type(text).__name__})")
    try:
        return celpy.json_to_cel(json.loads(text, parse_int=float))
    except ValueError as e:
        raise celpy.CELEvalError(f"failed to unmarshal JSON: {e}") from None


_ENV = celpy.Environment()


@functools.cache
def _program(expression: str) -> celpy.Runner:
    try:
        return _ENV.program(_ENV.compile(expression), functions={"parseJson": _parse_json})
    except celpy.CELParseError as e:
        raise EvaluationError(f"{expression!r}: {str(e).splitlines()[0]}") from None


def _evaluate(expression: str, activation: dict[str, Any]) -> Any:
    try:
        return _program(expression).evaluate(activation)
    except celpy.CELEvalError as e:
        raise EvaluationError(f"{expression!r}: {e.args[0] if e.args else e}") from None


def _value(value: Any) -> Any:
    """A parameter value as the driver holds it, a protobuf Value: numbers are doubles."""
    return celpy.json_to_cel(json.loads(json.dumps(value), parse_int=float))


def _plain(value: Any) -> Any:
    """A CEL result back as a parameter value (structpb.NewValue: a number is a double, which
    protojson writes without a fraction when it is whole)."""
    if isinstance(value, celtypes.BoolType):
        return bool(value)
    if isinstance(value, (celtypes.IntType, celtypes.UintType, celtypes.DoubleType)):
        number = float(value)
        return int(number) if number.is_integer() else number
    if isinstance(value, celtypes.StringType):
        return str(value)
    if isinstance(value, celtypes.MapType):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, celtypes.ListType):
        return [_plain(v) for v in value]
    return value


def condition(expression: str, parameters: dict[str, Any]) -> bool:
    """`Condition`: whether a task with this trigger condition runs, given its input
    parameter values."""
    result = _evaluate(expression, {"inputs": _value({"parameter_values": parameters})})
    if not isinstance(result, celtypes.BoolType):
        raise EvaluationError(f"{expression!r}: return type is not bool, got {result!r}")
    return bool(result)


def select(expression: str, value: Any) -> Any:
    """`Select`: a parameterExpressionSelector applied to one input value: the Value's field
    that is set (`string_value`, `number_value`, `bool_value`, `struct_value`, `list_value`)
    and `string_value` as its text (a string as it is, anything else as JSON)."""
    kind = {
        bool: "bool_value",
        str: "string_value",
        dict: "struct_value",
        list: "list_value",
        int: "number_value",
        float: "number_value",
    }.get(type(value))
    fields = {kind: _value(value)} if kind else {}
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    fields["string_value"] = celtypes.StringType(text)
    return _plain(_evaluate(expression, fields))
