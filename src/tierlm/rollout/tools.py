"""Tools a model may call while it generates. The calculator evaluates arithmetic from its syntax
tree (numbers and + - * / // % ** and parentheses only): no `eval`, no names, no calls, bounded size. The
python tool runs the request as a program in the sandbox (`tierlm.tasks.sandbox`) and answers what it printed.
"""

from __future__ import annotations

import ast
import operator
from typing import Callable, Protocol

from tierlm.special_tokens import TOOL_CALL_END, TOOL_CALL_START, TOOL_RESULT_END, TOOL_RESULT_START  # noqa: F401
from tierlm.tasks.sandbox import Limits, Sandbox

_BINARY: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Tool(Protocol):
    name: str

    def __call__(self, request: str) -> str:
        """The text to splice back for the model's request (an error message is a valid answer)."""
        ...


def call_tool(tools: dict[str, Tool], request: str) -> str:
    """The answer to a model's tool request: `name: argument` calls the tool of that name; a bare request goes to
    the first tool.

    >>> tools = {"calculator": Calculator()}
    >>> call_tool(tools, "calculator: 2 + 3"), call_tool(tools, "2 * 3"), call_tool(tools, "search: cats")
    ('5', '6', "error: no tool named 'search'")
    """
    name, colon, argument = request.partition(":")
    if not (colon and name.strip().isidentifier()):
        name, argument = next(iter(tools)), request
    tool = tools.get(name.strip())
    return tool(argument) if tool is not None else f"error: no tool named {name.strip()!r}"


class Calculator:
    """Arithmetic on integers and decimals.

    >>> calc = Calculator()
    >>> calc("23 + 45"), calc("(7 - 10) * 3"), calc("7 / 2"), calc("2 ** 10")
    ('68', '-9', '3.5', '1024')
    >>> calc("__import__('os')"), calc("1 / 0"), calc("9 ** 9 ** 9")
    ('error: not arithmetic', 'error: division by zero', 'error: number too large')
    """

    name = "calculator"

    def __init__(self, max_chars: int = 200, max_abs: float = 1e15):
        self.max_chars, self.max_abs = max_chars, max_abs

    def __call__(self, request: str) -> str:
        if len(request) > self.max_chars:
            return "error: expression too long"
        try:
            value = self._eval(ast.parse(request.strip(), mode="eval").body)
        except ZeroDivisionError:
            return "error: division by zero"
        except OverflowError:
            return "error: number too large"
        except (SyntaxError, ValueError, TypeError):
            return "error: not arithmetic"
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(round(value, 6) if isinstance(value, float) else value)

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise OverflowError
            return self._bounded(_BINARY[type(node.op)](left, right))
        raise ValueError("not arithmetic")

    def _bounded(self, value: int | float) -> int | float:
        if abs(value) > self.max_abs:
            raise OverflowError
        return value


class PythonTool:
    """A Python program run in the sandbox: the answer is what it printed (or its error's last line), at most
    `max_chars` characters. A hostile or endless program answers an error; the run goes on.

    >>> tool = PythonTool()
    >>> tool("print(sum(range(10)))"), tool("1 / 0"), tool("while True: pass")
    ('45', 'error: ZeroDivisionError: division by zero', 'error: stopped at a time or resource limit')
    """

    name = "python"

    def __init__(self, limits: Limits = Limits(cpu_seconds=2, wall_seconds=4), max_chars: int = 500, workers: int = 2):
        self.limits, self.max_chars, self.workers, self._sandbox = limits, max_chars, workers, None

    def __call__(self, request: str) -> str:
        if self._sandbox is None:  # started on the first call
            self._sandbox = Sandbox(self.limits, self.workers)
        result = self._sandbox.run(request)
        if result.status == "ok":
            return result.stdout.strip()[: self.max_chars]
        if result.status in ("timeout", "killed"):
            return "error: stopped at a time or resource limit"
        lines = result.stderr.strip().splitlines()
        return ("error: " + (lines[-1] if lines else f"exit status {result.returncode}"))[: self.max_chars]
