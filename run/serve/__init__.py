"""`qwen3-spmd serve`: an OpenAI-compatible HTTP server over the continuous-batching
scheduler (`pipeline.scheduling.scheduler`).

    detok     token ids -> text deltas: whole UTF-8 characters, stop strings held back
    protocol  the request bodies (pydantic), the error body, the response objects
    service   a request -> scheduler requests -> choices, as events; drain and abort
    reasoning Qwen3's <think>...</think> -> reasoning_content (--reasoning-parser qwen3)
    tools     tools and tool_choice checked; <tool_call> JSON -> tool_calls (hermes)
    message   a chat choice's text -> message deltas through those parsers; fold
    app       the HTTP routes (FastAPI): auth, errors, server-sent events, disconnects
    command   the flags, loading in the background, uvicorn, SIGTERM, followers
"""
