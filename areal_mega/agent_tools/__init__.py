"""Tools an agent can call (not the repository's ``tools/`` scripts): one small registry, shared
by the tool workflow (tag syntax) and OpenAI-style tool calls (JSON arguments).

    registry = build_tools([ToolConfig(kind="calculator", name="calc"), ToolConfig(kind="python")])
    await registry.call("calc", {"expression": "12 * (3 + 4)"})        # "84"

Invariant: ``ToolRegistry.call`` never raises for a tool's own failure; it returns
``"error: ..."`` text, which is what the model sees. The :class:`Tool` contract, built-ins and
user tools: docs/rewards.md ("Tools", "Module notes").
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol, Sequence, runtime_checkable

from areal_mega.agent_tools.calculator import calculator
from areal_mega.kinds import fill_default_options, resolve
from areal_mega.sandbox import Sandbox, SandboxConfig


@runtime_checkable
class Tool(Protocol):
    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments object (``{"type": "object", "properties": ..., "required": ...}``)."""

    async def call(self, args: dict[str, Any]) -> str: ...

    def close(self) -> None: ...


@dataclass
class FunctionTool:
    """A tool from a Python function (sync functions run in a thread: they may block)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    closer: Callable[[], None] | None = None

    async def call(self, args: dict[str, Any]) -> str:
        if inspect.iscoroutinefunction(self.fn):
            out = await self.fn(**args)
        else:
            out = await asyncio.to_thread(self.fn, **args)
        return out if isinstance(out, str) else str(out)

    def close(self) -> None:
        if self.closer is not None:
            self.closer()


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def schema_of(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn``'s keyword arguments (required = those without a default)."""
    props: dict[str, Any] = {}
    required = []
    hints = {}
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations: untyped properties
        pass
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        t = _JSON_TYPES.get(hints.get(p.name))  # type: ignore[arg-type]
        props[p.name] = {"type": t} if t else {}
        if p.default is p.empty:
            required.append(p.name)
    return {"type": "object", "properties": props, "required": required}


def _first_paragraph(doc: str | None) -> str:
    return inspect.cleandoc(doc or "").split("\n\n")[0].replace("\n", " ").strip()


def calculator_tool(name: str = "calculator") -> Tool:
    def calc(expression: str) -> str:
        return calculator(expression)

    return FunctionTool(name, "Evaluate an arithmetic expression (+ - * / // % ** and parentheses, numbers only).",
                        {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                        calc)


def python_tool(cfg: SandboxConfig, name: str = "python") -> Tool:
    """Runs ``code`` in a sandbox of its own; the result is its stdout, or ``error (<reason>):``
    with the end of its stderr."""
    sandbox = Sandbox(cfg)

    async def run(code: str) -> str:
        res = await sandbox.run(code)
        if res.ok:
            return res.stdout
        return f"error ({res.reason}): {res.stderr.strip()[-500:]}"

    return FunctionTool(name, "Run a Python program (stdlib only, no network, no files kept) and return what it prints.",
                        {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                        run, closer=sandbox.close)


def function_tool(path: str, name: str = "", description: str = "") -> Tool:
    """The user tool at ``path`` ("module:function"): a function, or an object with the Tool
    attributes (used as it is; ``name`` renames it)."""
    obj = resolve("tool", path)
    if not inspect.isroutine(obj) and all(hasattr(obj, a) for a in ("name", "description", "parameters", "call")):
        if name:
            obj.name = name
        return obj
    return FunctionTool(name or obj.__name__, description or _first_paragraph(obj.__doc__) or obj.__name__,
                        schema_of(obj), obj)


@dataclass
class ToolConfig:
    kind: str = "calculator"
    """"calculator": arithmetic; "python": run code in the sandbox (``sandbox``); "function":
    the user tool at ``function``; or "package.module:Name", called as ``Name(cfg) -> Tool``
    (its own settings in ``options``)."""
    options: Any = None
    """The typed options of a user tool kind (its ``Options`` dataclass)."""
    name: str = ""
    """The tool's name (the tag in the tool workflow's call syntax, the function name in
    OpenAI-style calls); "" = the kind for built-ins, the function's own name for user tools."""
    function: str = ""
    """kind "function": "module:function" (a function, or an object with the Tool attributes)."""
    description: str = ""
    """kind "function": the description shown to the model ("" = the docstring's first paragraph)."""
    sandbox: SandboxConfig = field(default_factory=lambda: SandboxConfig(num_workers=1, timeout_s=5.0))
    """kind "python": the sandbox the code runs in."""

    OPEN_KINDS: ClassVar[dict[str, str]] = {"kind": "tool"}

    def __post_init__(self) -> None:
        fill_default_options(self)

    def tool_name(self) -> str:
        """The name the tool will have (before importing a user tool object, which may name itself)."""
        return self.name or (self.function.partition(":")[2] if self.kind == "function" else self.kind)

    def validate(self) -> None:
        if self.kind == "function" and ":" not in self.function:
            raise ValueError(f"function: kind 'function' needs 'module:function', got {self.function!r}")
        if self.kind != "function" and self.function:
            raise ValueError(f"function: only kind 'function' takes a function (kind is {self.kind!r})")
        if self.name and not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"name: letters, digits, '_' and '-' only (it is a tag and a function name), got {self.name!r}")
        try:
            self.sandbox.validate()
        except ValueError as e:
            raise ValueError(f"sandbox.{e}") from None


class ToolRegistry:
    """Tools by exact name."""

    def __init__(self, tools: Sequence[Tool], *, timeout_s: float = 30.0, max_output_chars: int = 4000) -> None:
        self.tools: dict[str, Tool] = {}
        for t in tools:
            if t.name in self.tools:
                raise ValueError(f"tools: two tools are named {t.name!r}")
            self.tools[t.name] = t
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars

    def names(self) -> list[str]:
        return list(self.tools)

    def get(self, name: str) -> Tool:
        if name not in self.tools:
            raise KeyError(f"unknown tool {name!r} (known: {self.names()})")
        return self.tools[name]

    def schemas(self) -> list[dict[str, Any]]:
        """The tools in the OpenAI chat-completions ``tools`` format."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
                for t in self.tools.values()]

    def args_from_text(self, name: str, text: str) -> dict[str, Any]:
        """The arguments of a tag-syntax call: a JSON object as is, else the text as the tool's
        first required parameter (``<calc>1+2</calc>`` -> {"expression": "1+2"})."""
        stripped = text.strip()
        if stripped.startswith("{"):
            try:
                value = json.loads(stripped)
                if isinstance(value, dict):
                    return value
            except json.JSONDecodeError:
                pass
        params = self.get(name).parameters
        first = (params.get("required") or list(params.get("properties", {})) or ["input"])[0]
        return {first: text}

    async def call_openai(self, name: str, arguments: str) -> str:
        """An OpenAI-style tool call (``tool_call.function.name`` / ``.arguments``, a JSON
        object as text): its output, or "error: ..." as :meth:`call` answers."""
        try:
            args = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            return f"error: {name} arguments are not JSON: {arguments[:200]!r}"
        if not isinstance(args, dict):
            return f"error: {name} arguments must be a JSON object, got {type(args).__name__}"
        return await self.call(name, args)

    async def call(self, name: str, args: dict[str, Any]) -> str:
        """The tool's output, or "error: ..." (unknown tool, bad arguments, exception, timeout)."""
        if name not in self.tools:
            return f"error: unknown tool {name!r} (known: {', '.join(self.names())})"
        tool = self.tools[name]
        missing = [k for k in tool.parameters.get("required", []) if k not in args]
        unknown = [k for k in args if k not in tool.parameters.get("properties", {})]
        if missing or (unknown and tool.parameters.get("properties")):
            return f"error: {name} takes {sorted(tool.parameters.get('properties', {}))}, got {sorted(args)}"
        try:
            out = await asyncio.wait_for(tool.call(args), self.timeout_s)
        except asyncio.TimeoutError:
            return f"error: {name} timed out after {self.timeout_s} s"
        except Exception as e:  # the tool's failure is the model's observation
            return f"error: {type(e).__name__}: {e}"
        return out if len(out) <= self.max_output_chars else out[: self.max_output_chars] + "...(truncated)"

    def close(self) -> None:
        for t in self.tools.values():
            t.close()


def builtin_calculator(cfg: ToolConfig) -> Tool:
    return calculator_tool(cfg.name or "calculator")


def builtin_python(cfg: ToolConfig) -> Tool:
    return python_tool(cfg.sandbox, cfg.name or "python")


def builtin_function(cfg: ToolConfig) -> Tool:
    return function_tool(cfg.function, cfg.name, cfg.description)


def build_tools(cfgs: Sequence[ToolConfig], *, timeout_s: float = 30.0, max_output_chars: int = 4000) -> ToolRegistry:
    """Each tool kind (a built-in or "package.module:Name", ``areal_mega.kinds``) is called as
    ``Kind(cfg: ToolConfig) -> Tool``."""
    built: list[Tool] = []
    try:
        for c in cfgs:
            c.validate()
            built.append(resolve("tool", c.kind)(c))
        return ToolRegistry(built, timeout_s=timeout_s, max_output_chars=max_output_chars)
    except BaseException:
        for t in built:
            t.close()
        raise


__all__ = ["FunctionTool", "Tool", "ToolConfig", "ToolRegistry", "build_tools", "calculator", "calculator_tool",
           "function_tool", "python_tool", "schema_of", "builtin_calculator", "builtin_function", "builtin_python"]
