"""`rollout.tool_parser` against vLLM's tool parser registry: the name checked before an engine starts, and
the keywords and parser class vLLM's OpenAI serving classes build from it."""
from __future__ import annotations


def tool_parser_names() -> list[str]:
    """Every tool parser name the installed vLLM registers (`rollout.tool_parser` must be one)."""
    from vllm.tool_parsers import ToolParserManager

    return list(ToolParserManager.list_registered())


def check_tool_parser(name: str | None) -> None:
    """`rollout.tool_parser` names a registered parser (None: auto tool choice off); raises ValueError.
    Cheap next to an engine start, so the replica checks it first."""
    if name is None:
        return
    names = tool_parser_names()
    if name not in names:
        import vllm

        raise ValueError(f"rollout.tool_parser: {name!r} is not a tool parser of vLLM {vllm.__version__} (known: "
                         f"{', '.join(names)}); null turns auto tool choice off")


def tool_serving_kwargs(name: str | None) -> dict:
    """The auto-tool keywords of vLLM's OnlineRenderer and OpenAIServingChat for `rollout.tool_parser`
    (`--enable-auto-tool-choice --tool-call-parser NAME`); both take them: the renderer refuses a
    tool_choice no parser can serve and adjusts the request (the grammar of a forced call), the chat class
    turns the text into tool_calls."""
    return {} if name is None else {"enable_auto_tools": True, "tool_parser": name}


def chat_tool_parser(name: str, tokenizer, model_name: str | None = None):
    """The parser class OpenAIServingChat builds for `rollout.tool_parser` over `tokenizer`, by the same
    call (vLLM's ParserManager, which also tries the parser on the tokenizer); raises ValueError naming
    rollout.tool_parser when the parser cannot serve this tokenizer."""
    from vllm.parser import ParserManager

    check_tool_parser(name)
    try:
        return ParserManager.get_parser(tool_parser_name=name, enable_auto_tools=True, model_name=model_name,
                                        tokenizer=tokenizer)
    except Exception as e:
        raise ValueError(tool_parser_error(name, e)) from e


def tool_parser_error(name: str, e: Exception) -> str:
    return (f"rollout.tool_parser: {name!r} cannot serve this model's tokenizer ({e}); use another parser or "
            "null (auto tool choice off)")
