"""The bottom of the gateway: the types every layer shares, importing nothing of the gateway above them.

    errors.py     GatewayError and the Upstream* tree; error_body (OpenAI's shape, lmfleet.errors.openai_error_body)
    request.py    ParsedRequest (a validated request), check_context (prompt + max_tokens within the context)
    headers.py    the provenance header names (x-lmfleet-served-by, -route-reason, ...)
    tokens.py     prompt and answer token counts with the model's own tokenizer

The layers above call down only: front -> routing -> relay -> observe -> core
(tests/unit/test_architecture.py reads the graph).
"""
