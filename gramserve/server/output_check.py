"""The last check of a constrained output: does the finished text validate against the request's schema?

The grammar backends make outputs valid by construction; this check is the guarantee behind them. A request whose
JSON schema (or json_object) constraint ran from the first output token and that ended on its own (EOS, not a
stop string the client asked for, not max_tokens) has its whole text validated with `jsonschema` (the draft its
`$schema` names, Draft 2020-12 otherwise; formats checked). A failure is never reported as a success: the
TokenizerManager ends the request with finish_reason ``invalid_output`` and the validation message, and the count
shows in /get_server_info (``output_checks``). The tool calls of a chat request made under its tools' grammar are
checked the same way: each call the response would return, its arguments against its tool's parameters.

Validation runs on a thread of its own pool with a time bound, so a costly schema cannot stall the event loop, and
`pattern` is matched with the `regex` module under a time limit (Python's `re` would backtrack for hours on
``^(a|aa)+$``, holding the thread). An output whose check runs past its bound, or whose schema cannot be checked (a
`$ref` that does not resolve, a schema the validator refuses), counts as unchecked and is returned as it is.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import operator
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from decimal import MAX_EMAX, MIN_EMIN, Decimal
from typing import Any

import jsonschema
import regex
from jsonschema.exceptions import ValidationError

from gramserve.grammar.pattern_dialect import for_backends
from gramserve.grammar.schema_normalize import integral_counts
from gramserve.messages import GrammarRequest
from gramserve.parsers.tool_calls.base import parameters_of
from gramserve.server.chat_output import first_calls_until_repeat
from gramserve.server.tool_requests import ToolPlan

# What an output is held to: the request's JSON constraint, or the tools its calls must fit.
CheckTarget = GrammarRequest | ToolPlan

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 2.0  # a check running longer is given up (its output returned unchecked)
QUEUE_TIMEOUT_S = 30.0  # the longest an output waits for a free check thread
PATTERN_TIMEOUT_S = 0.5
CHECK_THREADS = 2
VALIDATOR_CACHE = 256
CHECKED_KINDS = ("json_schema", "json_object")


@dataclass(frozen=True)
class CheckResult:
    """Valid (``error`` None), invalid (``error`` says why), or not checked (``checked`` False)."""

    checked: bool
    error: str | None = None


class PatternTimeout(Exception):
    """A pattern took too long to match: the output cannot be checked."""


def _search(pattern: str, text: str) -> bool:
    try:  # read as Python's `re` reads it, as the grammars were made to (pattern_dialect.py)
        return regex.search(for_backends(pattern), text, timeout=PATTERN_TIMEOUT_S) is not None
    except TimeoutError:
        raise PatternTimeout(pattern) from None


def _pattern_keyword(validator, pattern, instance, schema):
    """jsonschema's `pattern` with the `regex` module and a time limit instead of `re`."""
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


# `re` does not read ECMA-262's Unicode classes (\p{L}, \P{C}: 290 of the 1,898 CloudFormation schemas use them), so
# the keywords that match property names use the `regex` module as well.
def _pattern_properties_keyword(validator, patterns, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


def _additional_properties_keyword(validator, additional, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    declared, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extras = [k for k in instance if k not in declared and not any(_search(p, k) for p in patterns)]
    if validator.is_type(additional, "object"):
        for key in extras:
            yield from validator.descend(instance[key], additional, path=key)
    elif additional is False and extras:
        yield ValidationError(f"Additional properties are not allowed ({', '.join(map(repr, extras))} unexpected)")


def _multiple_of_keyword(validator, divisor, instance, schema):
    """jsonschema's `multipleOf` with exact arithmetic: its `Decimal % Decimal` raises DivisionImpossible past 28
    digits of quotient (a random-weight model writes 30-digit numbers), which left the whole output unchecked."""
    if not validator.is_type(instance, "number") or not validator.is_type(divisor, "number") or divisor <= 0:
        return
    if isinstance(instance, Decimal) and instance.is_finite() and instance.adjusted() in (MAX_EMAX, MIN_EMIN):
        raise ClampedNumber(instance)  # output_number kept only its sign and magnitude: it cannot be checked
    if not is_multiple(instance, divisor):
        text = str(instance)
        yield ValidationError(f"{text if len(text) <= 40 else text[:37] + '...'} is not a multiple of {divisor}")


def _bound_keyword(name: str, holds: Callable[[Any, Any], bool], exclusive_key: str = "", holds_exclusive=None):
    """A numeric bound that the number meets both exactly and as a double, which is how most clients read it:
    0.999999999999999969999 is under an exclusiveMaximum of 1, but json.loads and pydantic read 1.0 (an output
    sampled so was returned as valid, and pydantic refused it). Drafts 3 and 4 (`exclusive_key`): `minimum` /
    `maximum` are exclusive where that boolean says so, tested with `holds_exclusive`."""

    def keyword(validator, bound, instance, schema):
        if not validator.is_type(instance, "number") or not validator.is_type(bound, "number"):
            return
        test, what = holds, name
        if exclusive_key and schema.get(exclusive_key) is True:
            test, what = holds_exclusive, f"exclusive {name}"
        if not test(instance, bound):
            yield ValidationError(f"{instance} does not meet the {what} {bound}")
        elif isinstance(instance, Decimal) and not test(float(instance), _as_double(bound)):
            as_double = float(instance)
            yield ValidationError(f"{instance} does not meet the {what} {bound} once read as a double ({as_double!r})")

    return keyword


def _as_double(x) -> float:
    try:
        return float(x)
    except OverflowError:  # an integer past the doubles' range
        return math.copysign(math.inf, x)


BOUND_KEYWORDS = {  # drafts 6 on, where the exclusive bounds are numbers
    "minimum": _bound_keyword("minimum", operator.ge),
    "maximum": _bound_keyword("maximum", operator.le),
    "exclusiveMinimum": _bound_keyword("exclusiveMinimum", operator.gt),
    "exclusiveMaximum": _bound_keyword("exclusiveMaximum", operator.lt),
}
LEGACY_BOUND_KEYWORDS = {  # drafts 3 and 4, where they are booleans beside minimum / maximum
    "minimum": _bound_keyword("minimum", operator.ge, "exclusiveMinimum", operator.gt),
    "maximum": _bound_keyword("maximum", operator.le, "exclusiveMaximum", operator.lt),
}


class ClampedNumber(ArithmeticError):
    """An output number past Decimal's range, clamped by `output_number`: its digits are gone."""


def is_multiple(value, divisor) -> bool:
    """Is `value` an integer multiple of `divisor` (> 0)? Exact for ints, Decimals and floats (by their decimal
    text), whatever their size: with value = c1 x 10^e1 and divisor = c2 x 10^e2 (integers c1, c2), it is when c2
    divides c1 x 10^(e1 - e2), which modular powers decide without writing 10^(e1 - e2) out."""
    value = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)
    divisor = Decimal(repr(divisor)) if isinstance(divisor, float) else Decimal(divisor)
    if not value.is_finite():
        return False
    if not divisor.is_finite():
        return True  # a schema's Infinity: no finite multiple, nothing to hold the value to
    (c1, n1, e1), (c2, _, e2) = _coefficient(value), _coefficient(divisor)
    if c1 == 0:
        return True
    shift = e1 - e2
    if shift >= 0:
        return c1 * pow(10, shift, c2) % c2 == 0
    if -shift > n1:  # c2 x 10^-shift > c1 > 0
        return False
    return c1 % (c2 * 10**-shift) == 0


def _coefficient(d: Decimal) -> tuple[int, int, int]:
    """|d| as (integer coefficient, its number of digits, exponent); Decimal to int is not bound by Python's
    4,300-digit limit on int and str conversions."""
    _, digits, exponent = d.as_tuple()
    return int(Decimal((0, digits, 0))), len(digits), exponent


# The keywords the check does its own way (the regex module with a time limit; exact multiples).
CHECK_KEYWORDS = {
    "pattern": _pattern_keyword,
    "patternProperties": _pattern_properties_keyword,
    "additionalProperties": _additional_properties_keyword,
    "multipleOf": _multiple_of_keyword,
}


class OutputChecker:
    def __init__(self, timeout_s: float = CHECK_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(CHECK_THREADS, thread_name_prefix="output-check")
        # retried: attempts sampled again after a failed check; recovered: requests whose retry passed
        self.stats = {"checked": 0, "invalid": 0, "unchecked": 0, "retried": 0, "recovered": 0}

    @staticmethod
    def applies(grammar: GrammarRequest | None) -> bool:
        """Is this constraint's output checked? Only whole-output JSON constraints (not after reasoning)."""
        return grammar is not None and grammar.kind in CHECKED_KINDS and not grammar.start_after

    @classmethod
    def target(cls, grammar: GrammarRequest | None, tools: ToolPlan | None = None) -> CheckTarget | None:
        """What the output of a request is checked against, if anything: its JSON constraint, or, for the tool-call
        grammar of a chat request, the parameter schemas of its tools (the calls' arguments are validated)."""
        if cls.applies(grammar):
            return grammar
        if tools is not None and grammar is not None and grammar.kind == "structural_tag" and not grammar.start_after:
            return tools
        return None

    async def check(self, target: CheckTarget, text: str) -> CheckResult:
        """The check on a pool thread. Its time bound counts from when a thread takes it, not from the queue: when
        hundreds of outputs finish at once, each waits its turn (a GPU run over 2,786 held-out schemas left 285 of
        1,503 unchecked while the bound counted the queue too), up to `QUEUE_TIMEOUT_S`."""
        started: list[float] = []

        def run() -> CheckResult:
            started.append(time.monotonic())
            return self.check_now(target, text)

        work = asyncio.get_running_loop().run_in_executor(self._pool, run)
        queued_until = time.monotonic() + QUEUE_TIMEOUT_S
        result = None
        while result is None:
            until = started[0] + self.timeout_s if started else queued_until
            left = until - time.monotonic()
            if left <= 0:
                logger.info(
                    "an output was left unchecked: its check %s", "ran too long" if started else "never started"
                )
                result = CheckResult(False, None)
                break
            try:
                result = await asyncio.wait_for(asyncio.shield(work), min(left, 0.25))
            except asyncio.TimeoutError:
                continue
            except Exception:  # noqa: BLE001 - a bug in the check must not fail the request
                logger.exception("an output was left unchecked: its check failed")
                result = CheckResult(False, None)
        self.stats["unchecked" if not result.checked else "invalid" if result.error else "checked"] += 1
        return result

    def check_now(self, target: CheckTarget, text: str) -> CheckResult:
        if isinstance(target, ToolPlan):
            return self._check_calls(target, text)
        return self._check_json(target.kind, target.text, text)

    def _check_calls(self, plan: ToolPlan, text: str) -> CheckResult:
        """Each call the response would return (up to a repeat, as chat_output does), against its tool's schema;
        an answer without calls against the response format it must follow, if any."""
        tools = {t.name: t for t in plan.tools}
        parsed = plan.new_parser().parse(text)
        if not parsed.calls and plan.answer is not None:
            return self._check_json(plan.answer.kind, plan.answer.text, parsed.content or "")
        if not parsed.calls and plan.whole and plan.mode in ("required", "named"):
            # the grammar held a call the parser cannot read (pythonic: a number past the doubles, 1114E4921...)
            return CheckResult(True, "the output holds no call that can be read, though the request requires one")
        checked = True
        for call in first_calls_until_repeat(parsed.calls):
            tool = tools.get(call.name)
            if tool is None:
                return CheckResult(True, f"the output calls {call.name!r}, which is not among the tools")
            result = self._check_json("json_schema", json.dumps(parameters_of(tool)), call.arguments)
            if result.error is not None:
                return CheckResult(True, f"the arguments of the call to {call.name!r}: {result.error}")
            checked = checked and result.checked
        return CheckResult(checked)

    def _check_json(self, kind: str, schema_text: str, text: str) -> CheckResult:
        try:
            # Decimals, not floats: 10000.89 is a multiple of 0.01 as JSON text, not as a binary float.
            value = json.loads(text, parse_float=output_number, object_pairs_hook=_object_without_repeats)
        except RepeatedKey as exc:  # json.loads keeps the last value; other parsers keep the first, or refuse
            return CheckResult(True, f"the output repeats a key in an object: {exc}")
        except ArithmeticError as exc:  # not expected (output_number clamps), but never a 500
            logger.info("an output was left unchecked: %s reading a number", type(exc).__name__)
            return CheckResult(False)
        except ValueError as exc:
            if "integer string conversion" in str(exc):
                logger.info("an output was left unchecked: an integer of more than 4300 digits")
                return CheckResult(False)  # JSON, but Python will not read it
            return CheckResult(True, f"the output is not JSON: {exc}")
        if kind == "json_object":
            return CheckResult(True, None if isinstance(value, dict) else "the output is not a JSON object")
        validator = _validator(schema_text)
        if validator is None:
            logger.info("an output was left unchecked: the validator cannot read its schema")
            return CheckResult(False)
        try:
            error = next(iter(validator.iter_errors(value)), None)
        except Exception as exc:  # noqa: BLE001 - unresolvable $ref and the like: the schema cannot be checked here
            logger.info("an output was left unchecked: %s: %s", type(exc).__name__, str(exc)[:200])
            return CheckResult(False)
        if error is None:
            return CheckResult(True)
        where = "/".join(str(p) for p in error.absolute_path)
        return CheckResult(True, f"the output does not validate against the schema at /{where}: {error.message[:300]}")


class RepeatedKey(ValueError):
    """An object of the output names a key twice."""


def _object_without_repeats(pairs: list[tuple[str, Any]]) -> dict:
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        raise RepeatedKey(next(repr(k) for k, _ in pairs if k in seen or seen.add(k)))
    return value


@functools.lru_cache(maxsize=VALIDATOR_CACHE)  # thread-safe; one validator per distinct schema text
def _validator(schema_text: str):
    """A validator for the schema (its `$schema`'s draft, formats, timed patterns), or None if it cannot be read.

    The schema is not checked against its metaschema here: every schema that reaches a check was, when its grammar
    compiled (grammar/schema_checks.py), and that check (1 ms for a typical corpus schema) ran again here, in the
    main process, while the output's last chunk waited for it."""
    try:
        # Integral counts as ints: "maxLength": 2.0 read as a Decimal would not be a count.
        schema = integral_counts(json.loads(schema_text, parse_float=_decimal_or_int))
        cls = _checking_class(jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator))
        return cls(schema, format_checker=cls.FORMAT_CHECKER)
    except Exception:  # noqa: BLE001 - the backends accepted it; the validator does not: leave it unchecked
        return None


@functools.lru_cache(maxsize=None)  # one per draft: making the class costs 0.4 ms
def _checking_class(draft):
    """The draft's validator class with timed `regex` patterns and Decimal integers (5.0 is an integer in JSON
    Schema; outputs are read as Decimals, which the default type checker calls numbers only)."""
    types = draft.TYPE_CHECKER.redefine("integer", _is_integer)
    numeric_exclusive = draft not in (jsonschema.Draft3Validator, jsonschema.Draft4Validator)  # booleans there
    keywords = {**CHECK_KEYWORDS, **(BOUND_KEYWORDS if numeric_exclusive else LEGACY_BOUND_KEYWORDS)}
    return jsonschema.validators.extend(draft, keywords, type_checker=types)


def output_number(text: str) -> Decimal:
    """A JSON number of an output as an exact Decimal. Random weights write exponents past Decimal's range
    (``1e`` and twenty digits): those are clamped to the range's edge, which keeps their sign, whether they are
    integers, and how they compare with any bound a schema can state (they went unchecked before)."""
    try:
        return Decimal(text)
    except ArithmeticError:
        mantissa, _, exponent = text.lower().partition("e")
        sign = "-" if mantissa.startswith("-") else ""
        if not any(c in "123456789" for c in mantissa):
            return Decimal(f"{sign}0")
        # 1 at the edge: the adjusted exponent of a longer mantissa would fall past the range again
        return Decimal(f"{sign}1e{MIN_EMIN if exponent.startswith('-') else MAX_EMAX}")


def _decimal_or_int(text: str):
    """A JSON float literal of the schema: an int when integral (2.0), else an exact Decimal."""
    value = Decimal(text)
    return int(value) if value == value.to_integral_value() and abs(value.adjusted()) < 30 else value


def _is_integer(checker, instance) -> bool:
    if isinstance(instance, bool):
        return False
    if isinstance(instance, Decimal):
        return instance.is_finite() and instance == instance.to_integral_value()
    return isinstance(instance, int) or (isinstance(instance, float) and instance.is_integer())
