"""The headers hotwire adds to responses, and the one it reads on requests, named once for the server and every
client."""

__all__ = ["KEY_HEADER", "LENIENT_HEADER", "RECEIPT_HEADER"]

RECEIPT_HEADER = "x-hotwire-receipt"  # the versions that steered the response
LENIENT_HEADER = "x-hotwire-lenient"  # why lenient mode served the request unsteered
KEY_HEADER = "X-Hotwire-Key"  # a steered request's hotwire key, beside vLLM's in Authorization (auth.py)
