"""The response headers hotwire adds, named once for the server (``admission``) and every client."""

__all__ = ["LENIENT_HEADER", "RECEIPT_HEADER"]

RECEIPT_HEADER = "x-hotwire-receipt"  # the versions that steered the response
LENIENT_HEADER = "x-hotwire-lenient"  # why lenient mode served the request unsteered
