"""A package's own Jinja chat template, rendered in a sandbox with bounded time and output.

Packages carry ``chat_template``: ``None`` or ``"chatml"`` select the fixed ChatML renderer of
:mod:`calserve.models.tokenizer`; any other string is the model's Jinja template (what Hugging Face
``tokenizer_config.json`` / GGUF ``tokenizer.chat_template`` hold), rendered here the way Hugging
Face's ``apply_chat_template`` does:

- ``jinja2.sandbox.ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks`` and
  the ``loopcontrols`` extension (``break``/``continue``); no attribute of a Python object that the
  sandbox deems unsafe, no mutation of lists or dicts;
- the variables ``messages`` (a list of ``{"role", "content"}`` dicts, with ``tool_calls`` /
  ``tool_call_id`` for a template that shows tools itself), ``add_generation_prompt``,
  ``bos_token``, ``eos_token``, ``tools`` when the request's tools are the template's to show
  (``api/tools_hermes.py``, ``api/tools_llama.py``), and the request's ``chat_template_kwargs``
  (``enable_thinking``, ...); the helpers ``raise_exception(msg)``, ``strftime_now(fmt)`` and a
  ``tojson`` filter that keeps non-ASCII text (``ensure_ascii=False``, as Hugging Face's).

A template is the operator's (signed with the package), the messages are the client's: a template
that raises (``raise_exception("Conversation roles must alternate ...")``), fails on the messages it
got, or runs away (a ``range`` loop, recursion, ``'x' * 10**9``) ends the request with a 400 naming
``messages``, never a 500 and never a stuck event loop. The bounds: :data:`MAX_RENDER_SECONDS` of
wall time (checked at every loop step of ``range``, every call and every chunk of output),
:data:`MAX_RENDER_CHARS` of output, ``range`` of at most 100,000 items (the sandbox's own), and
``*``/``**``/``+`` refused when their result would exceed the output bound (and a call whose result
does). A template that does not
compile is refused when the package is loaded (:class:`~calserve.errors.ValidationError`).
"""

from __future__ import annotations

import datetime
import json
import operator
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final, NoReturn

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from calserve.errors import RequestError, ValidationError

__all__ = ["ChatTemplate", "MAX_RENDER_SECONDS", "MAX_RENDER_CHARS", "is_chatml",
           "RESERVED_VARIABLES"]

#: Wall time one rendering may take (an ordinary template renders in well under a millisecond).
MAX_RENDER_SECONDS: Final = 0.5
#: Characters one rendering may produce (far above any context: the prompt is checked against the
#: model's context after rendering, README "Per-request limits").
MAX_RENDER_CHARS: Final = 4 * 2**20
_CHECK_EVERY: Final = 256  # range items between two clock reads
#: The variables and helpers a rendering sets itself (a request's own variables may not).
RESERVED_VARIABLES: Final = frozenset({"messages", "add_generation_prompt", "bos_token",
                                       "eos_token", "tools", "raise_exception", "strftime_now",
                                       "range", "namespace", "loop", "self"})

_local = threading.local()  # the deadline of the rendering running on this thread


class _Overrun(Exception):
    """The rendering passed one of its bounds."""


def is_chatml(template: str | None) -> bool:
    """True when ``template`` selects the built-in ChatML renderer (None or ``"chatml"``)."""
    return template is None or template.strip().lower() == "chatml"


def _check_deadline() -> None:
    deadline = getattr(_local, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _Overrun(f"rendering took more than {MAX_RENDER_SECONDS} s")


def _bounded_range(*args: int) -> Iterator[int]:
    for i, v in enumerate(safe_range(*args)):  # safe_range: at most 100,000 items
        if i % _CHECK_EVERY == 0:
            _check_deadline()
        yield v


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _size(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


class _Env(ImmutableSandboxedEnvironment):
    """The sandbox plus the render bounds (deadline on every call, sizes of ``*``/``**``/``+``)."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            n, k = (_size(left), right) if _size(left) is not None else (_size(right), left)
            if n is not None and isinstance(k, int) and n * k > MAX_RENDER_CHARS:
                raise _Overrun("a repetition larger than the output bound")
            return operator.mul(left, right)
        if op == "**":
            if (isinstance(left, int) and isinstance(right, int) and abs(left) > 1
                    and right * max(abs(left), 2).bit_length() > 64 * 1024):
                raise _Overrun("a power larger than the bound")
            return operator.pow(left, right)
        if op == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None and a + b > MAX_RENDER_CHARS:
                raise _Overrun("a concatenation larger than the output bound")
            return operator.add(left, right)
        return super().call_binop(context, op, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_deadline()
        out = super().call(__context, __obj, *args, **kwargs)
        n = _size(out)
        if n is not None and n > MAX_RENDER_CHARS:  # ''.center(10**8), ''.ljust(...), ...
            raise _Overrun("a call returned more than the output bound")
        return out


def _env() -> _Env:
    env = _Env(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = _bounded_range
    env.filters["tojson"] = _tojson
    return env


class ChatTemplate:
    """One compiled Jinja chat template with its special-token strings."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _env().from_string(source)
        except jinja2.TemplateError as e:
            raise ValidationError(f"chat_template does not compile: {e}") from None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text; a failing or runaway template is a RequestError naming ``messages``.
        ``tools`` (OpenAI's ``tools`` list) is the template's ``tools`` variable when not None;
        ``variables``: more of them (a request's ``chat_template_kwargs``: none of the names
        above, :data:`RESERVED_VARIABLES`)."""
        ctx: dict[str, Any] = dict(variables or {})
        ctx.update({"messages": [dict(m) for m in messages],
                    "add_generation_prompt": add_generation_prompt,
                    "bos_token": self.bos_token, "eos_token": self.eos_token})
        if tools is not None:
            ctx["tools"] = [dict(t) for t in tools]
        prev = getattr(_local, "deadline", None)
        _local.deadline = time.monotonic() + MAX_RENDER_SECONDS
        parts: list[str] = []
        size = 0
        try:
            for chunk in self._template.generate(**ctx):
                size += len(chunk)
                if size > MAX_RENDER_CHARS:
                    raise _Overrun(f"the rendering is longer than {MAX_RENDER_CHARS} characters")
                parts.append(chunk)
                _check_deadline()
        except _Overrun as e:
            raise RequestError(f"the model's chat template was stopped: {e}",
                               param="messages") from None
        except (jinja2.TemplateError, SecurityError) as e:
            raise RequestError(f"the model's chat template refused these messages: {e}",
                               param="messages") from None
        except Exception as e:  # whatever else a template does wrong: the client's 400, not a 500
            raise RequestError(
                f"the model's chat template failed on these messages ({type(e).__name__}: "
                f"{str(e)[:200]})", param="messages") from None
        finally:
            _local.deadline = prev
        return "".join(parts)
