"""gRPC requests that do not parse: refused with INVALID_ARGUMENT by the daemon itself.

grpc-python (1.85) answers an undecodable message on a request stream with INTERNAL from
its own receive callback, and then sends a second status when the handler ends. That second
status never completes, the call stays in the server's books, and ``server.stop()`` waits
for it forever: one client sending garbage on an Ops (or reflection) stream would keep
smddpd from ever shutting down. So the daemon parses requests itself, through this
interceptor, and every undecodable request ends its call once, as INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc


class _Undecodable:
    """Stands in for a request that did not parse, until the handler wrapper refuses it."""

    def __init__(self, error: str) -> None:
        self.error = error


def _refuse(request: Any, context: grpc.ServicerContext) -> Any:
    if isinstance(request, _Undecodable):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
    return request


class RefuseUndecodable(grpc.ServerInterceptor):
    """Gives every method a deserializer that cannot fail and refuses what did not parse."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        parse = handler.request_deserializer
        method = handler_call_details.method

        def tolerant(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:
                return _Undecodable(
                    f"{method}: undecodable request message of {len(data)} bytes ({exc})"
                )

        behavior: Callable[..., Any]
        if handler.request_streaming:
            kind = "stream_stream" if handler.response_streaming else "stream_unary"
            stream_behavior = getattr(handler, kind)

            def stream_refusing(
                requests: Iterator[Any], context: grpc.ServicerContext, *args: Any
            ) -> Any:
                return stream_behavior((_refuse(r, context) for r in requests), context, *args)

            behavior, original = stream_refusing, stream_behavior
        else:
            kind = "unary_stream" if handler.response_streaming else "unary_unary"
            unary_behavior = getattr(handler, kind)

            def unary_refusing(request: Any, context: grpc.ServicerContext, *args: Any) -> Any:
                return unary_behavior(_refuse(request, context), context, *args)

            behavior, original = unary_refusing, unary_behavior
        # The health service's Watch answers through a callback when it says so; keep that.
        # (grpc reads the attribute off the function; function attributes have no types.)
        behavior.experimental_non_blocking = getattr(  # type: ignore[attr-defined]
            original, "experimental_non_blocking", False
        )
        # grpc's handlers are namedtuples at run time; typeshed's RpcMethodHandler says not.
        replaced: grpc.RpcMethodHandler[Any, Any] = handler._replace(  # type: ignore[attr-defined]
            request_deserializer=tolerant, **{kind: behavior}
        )
        return replaced
