"""The server's request limits: their defaults, shared by the command line and the serving layer."""

DEFAULT_MAX_REQUEST_BYTES = 8 << 20  # 8 MiB: a 128k-token prompt is about 0.5 MB of text, 0.9 MB of token ids
DEFAULT_BODY_READ_TIMEOUT = 30.0  # seconds from a request's headers to the end of its body
