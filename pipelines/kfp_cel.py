"""The two CEL expressions the KFP backend's driver evaluates, for the pod harness.

The driver evaluates CEL (google/cel-go) in two places (kubeflow/pipelines 2.17.0,
`backend/src/v2/expression/expression.go`): a task's `triggerPolicy.condition` (`Condition`,
over the task's resolved inputs as an ExecutorInput: `inputs.parameter_values['NAME']`; true
runs the task, false creates its execution CANCELED and Argo skips it, driver/dag.go 84-91,
container.go 88-95, compiler/argocompiler/dag.go 278-280) and an input's
`parameterExpressionSelector` (`Select`, over one value whose `string_value` is its text,
metadata/converter.go PbValueToText; driver/resolve.go 145-165).

No CEL implementation is installed here, and the harness needs only what the KFP SDK writes
(kfp 2.17.0 `compiler/pipeline_spec_builder.py`: `_binary_operation_to_cel_condition` and
`_binary_operations_to_cel_conjunctive` for `dsl.If`, `parseJson(string_value)["KEY"]` for a loop
item's field): comparisons of input parameters and literals joined by `&&`, each maybe negated,
operands cast with `int(...)` / `double(...)`. That grammar is parsed exactly; anything else is
refused (`Unsupported`) rather than guessed; what CEL itself fails on is an `EvaluationError`
(the driver's error): a key that is not an input, comparing values of two types (no overload:
the SDK casts both sides to one type).
A parameter holds a protobuf Value, so a number is a CEL double unless `int(...)` casts it.
"""

from __future__ import annotations

import json
import operator
import re
from typing import Any

PARAM = r"inputs\.parameter_values\['(?P<name>[^']*)'\]"
OPERAND = re.compile(
    rf"^(?:(?P<cast>int|double)\((?P<inner>.*)\)|{PARAM}|'(?P<text>[^']*)'|(?P<bool>true|false)"
    r"|(?P<number>-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?))$"
)
COMPARISON = re.compile(r"^(?P<left>.+?) (?P<op>==|!=|<=|>=|<|>) (?P<right>.+)$")
SELECT = re.compile(r'^parseJson\(string_value\)\["(?P<key>[^"]*)"\]$')
OPERATORS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
             ">": operator.gt, ">=": operator.ge}  # fmt: skip


class Unsupported(ValueError):
    """An expression outside the grammar the SDK writes: not modelled."""


class EvaluationError(ValueError):
    """What CEL fails on (the driver then fails the task): a key that is not an input, a
    comparison of two types, a cast that does not apply."""


def condition(expression: str, parameters: dict[str, Any]) -> bool:
    """`Condition`: whether a task with this trigger condition runs, given its input
    parameter values."""
    result = True
    for clause in expression.split(" && "):
        negated = clause.startswith("!(") and clause.endswith(")")
        body = clause[2:-1] if negated else clause
        match = COMPARISON.match(body)
        if not match:
            raise Unsupported(f"trigger condition {expression!r}: {clause!r} is not a comparison")
        left = _operand(match["left"], parameters, expression)
        right = _operand(match["right"], parameters, expression)
        if type(left) is not type(right):
            types = f"{type(left).__name__} {match['op']} {type(right).__name__}"
            raise EvaluationError(f"trigger condition {expression!r}: no such overload {types}")
        result = result and (OPERATORS[match["op"]](left, right) != negated)
    return result


def _operand(text: str, parameters: dict[str, Any], expression: str) -> Any:
    match = OPERAND.match(text.strip())
    if not match:
        raise Unsupported(f"trigger condition {expression!r}: operand {text!r} not modelled")
    if match["cast"]:
        value = _operand(match["inner"], parameters, expression)
        try:
            if isinstance(value, bool):
                raise TypeError  # CEL has no int(bool) / double(bool)
            return int(value) if match["cast"] == "int" else float(value)
        except (TypeError, ValueError):
            raise EvaluationError(f"{expression!r}: {match['cast']}({value!r}) fails") from None
    if match["name"] is not None:
        if match["name"] not in parameters:
            raise EvaluationError(f"trigger condition {expression!r}: no such key {match['name']}")
        value = parameters[match["name"]]
        # a protobuf Value: numbers are doubles, a bool stays a bool
        return float(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if match["text"] is not None:
        return match["text"]
    if match["bool"]:
        return match["bool"] == "true"
    number = match["number"]
    return float(number) if any(c in number for c in ".eE") else int(number)


def select(expression: str, value: Any) -> Any:
    """`Select`: a parameterExpressionSelector applied to one input value (`string_value` is
    the value's text: a string as it is, anything else as JSON)."""
    match = SELECT.match(expression)
    if not match:
        raise Unsupported(f"parameter expression selector {expression!r} not modelled")
    text = value if isinstance(value, str) else json.dumps(value)
    parsed = json.loads(text)
    if not isinstance(parsed, dict) or match["key"] not in parsed:
        raise EvaluationError(f"selector {expression!r}: no such key in {text[:80]}")
    return parsed[match["key"]]
