"""Tool-call parsers: the model's text -> OpenAI `tool_calls`, whole or streamed (vLLM's
`--tool-call-parser`). Qwen2 models use the `hermes` format."""

from jaxllm.entrypoints.openai.tool_parsers.hermes_tool_parser import (
    TOOL_CALL_END,
    TOOL_CALL_START,
    DeltaMessage,
    ExtractedToolCalls,
    HermesToolParser,
    ToolCall,
    ToolCallDelta,
    extract_tool_calls,
    tool_call_grammar,
)

__all__ = ["TOOL_CALL_END", "TOOL_CALL_START", "DeltaMessage", "ExtractedToolCalls",
           "HermesToolParser", "ToolCall", "ToolCallDelta", "extract_tool_calls",
           "tool_call_grammar"]
