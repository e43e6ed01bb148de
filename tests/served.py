"""serve's app over an `LLM` in this process, for the tests that drive it with the
clients people use (openai, the Agents SDK, LangChain) rather than a server subprocess."""

from qwen3_spmd.run.serve.app import ServerState, make_app
from qwen3_spmd.run.serve.command import _service


def app_over(llm, max_seq_len: int, chat_template: str | None = None, **state):
    """A ready app serving `llm`'s scheduler as "tiny", the tokenizer's chat template
    replaced by `chat_template` when given; `state`: more ServerState fields."""
    text = llm.spec.text()
    if chat_template is not None:
        text.config = {**text.config, "chat_template": chat_template}
    service = _service(llm.scheduler, llm.spec, text, "tiny", max_seq_len, llm.pooling)
    return make_app(ServerState("tiny", service=service, text=text, status="ready", **state))


def langchain_chat(http, **settings):
    """LangChain's ChatOpenAI, unchanged, over `http` (a TestClient of such an app)."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model="tiny",
        base_url="http://testserver/v1",
        api_key="unused",
        http_client=http,
        max_retries=0,
        **settings,
    )
