"""Where the daemon's errors become gRPC statuses: one decorator on every method of the Node
and Peer services.

Below the edge, code raises ``SmddpError``s (each knows its gRPC code); only here are they
turned into ``context.abort``, logged (rate-limited per cause) and counted, so that no service
method repeats a try/abort of its own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import grpc

from smddp.server.errors import SmddpError

Method = TypeVar("Method", bound=Callable[..., Any])


class EdgeService:
    """What the decorator calls back on the service whose method it wraps."""

    def _refused(self, what: str, exc: SmddpError) -> None:
        """A call was refused with ``exc`` (before the abort): log and count it where the
        service does."""

    def _finished(self, method: str, code: grpc.StatusCode) -> None:
        """A call ended with ``code`` (OK too): count it where the service does."""


def _refuse(
    service: EdgeService, what: str, exc: SmddpError, context: grpc.ServicerContext
) -> None:
    service._refused(what, exc)
    context.abort(exc.code, str(exc))


def _code(context: grpc.ServicerContext) -> grpc.StatusCode:
    # ServicerContext.code() exists since grpc 1.38; typeshed's stub does not declare it.
    code: grpc.StatusCode | None = context.code()  # type: ignore[attr-defined]
    return code or grpc.StatusCode.UNKNOWN


def edge(what: str | None = None) -> Callable[[Method], Method]:
    """Decorates a service method: an ``SmddpError`` it raises aborts the call with its code.

    Args:
        what: how the refusal log names the call (default: the method's name).
    """

    def wrap(method: Method) -> Method:
        label = what or method.__name__
        name = method.__name__

        if inspect.isgeneratorfunction(method):

            @functools.wraps(method)
            def stream(
                self: EdgeService, request: Any, context: grpc.ServicerContext
            ) -> Iterator[Any]:
                try:
                    yield from method(self, request, context)
                except SmddpError as exc:
                    self._finished(name, exc.code)
                    _refuse(self, label, exc, context)
                except BaseException:
                    self._finished(name, _code(context))
                    raise
                self._finished(name, grpc.StatusCode.OK)

            return cast(Method, stream)

        @functools.wraps(method)
        def unary(self: EdgeService, request: Any, context: grpc.ServicerContext) -> Any:
            try:
                reply = method(self, request, context)
            except SmddpError as exc:
                self._finished(name, exc.code)
                _refuse(self, label, exc, context)
                raise  # not reached: abort raises
            except BaseException:
                self._finished(name, _code(context))
                raise
            self._finished(name, grpc.StatusCode.OK)
            return reply

        return cast(Method, unary)

    return wrap
