"""`jaxllm serve [MODEL]`: the OpenAI-compatible server (jaxllm/entrypoints/openai/), with
vLLM's flags. Unlike vLLM it binds 127.0.0.1 unless --host says otherwise."""

from __future__ import annotations

import argparse
import logging
import os
import signal

from jaxllm.engine.arg_utils import EngineArgs
from jaxllm.lora.request import LoRARequest

API_KEY_ENV = "JAXLLM_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 4 << 20


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server",
                       description=__doc__)
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="checkpoint directory, .gguf file, Hugging Face Hub model id "
                        "(owner/name, owner/name:QUANT for one file of a GGUF repo) or "
                        "tiny-qwen2 (same as --model)")
    p.add_argument("--headless", action="store_true",
                   help="run only this host's data-parallel engine cores, ranks "
                        "--data-parallel-start-rank onwards (--data-parallel-size-local of "
                        "them), for the frontend at --data-parallel-address:"
                        "--data-parallel-rpc-port; they take every other engine setting from "
                        "the frontend; no HTTP server")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (vLLM binds 0.0.0.0; we do only when asked)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model` (default: MODEL as given, or the "
                        "embedded model's name)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) a request's `model` may name, listed "
                        "by /v1/models; needs --enable-lora")
    p.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 routes (or set "
                        f"{API_KEY_ENV})")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body; larger ones get 413 (default: 4 MiB)")
    p.add_argument("--request-body-timeout", type=float, default=60.0,
                   help="seconds a client gets to send a request body; slower ones get 408 "
                        "(default: 60)")
    p.add_argument("--request-header-timeout", type=float, default=30.0,
                   help="seconds a connection gets to send a request's headers (from its "
                        "opening or the request's first byte) before it is closed (default: 30)")
    p.add_argument("--limit-concurrency", type=int, default=1024,
                   help="open connections and requests in progress beyond which new requests "
                        "get 503 (uvicorn's; default: 1024)")
    p.add_argument("--timeout-keep-alive", type=int, default=5,
                   help="seconds an idle keep-alive connection stays open (default: 5)")
    p.add_argument("--h11-max-incomplete-event-size", type=int, default=16 << 10,
                   help="largest request line plus headers in bytes; larger ones get 400 and "
                        "the connection is closed (default: 16 KiB, h11's)")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=10.0,
                   help="on SIGTERM, seconds running requests get to finish before they are "
                        "aborted (default: 10)")
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help='defaults for constrained requests that do not set them, e.g. '
                        '\'{"disable_any_whitespace": true}\' (no whitespace between JSON '
                        'tokens: small or untrained models need it to close objects); keys: '
                        'disable_any_whitespace, disable_additional_properties')
    limits = p.add_argument_group("request limits", "what one request may ask; past a "
                                  "limit, a 400 naming it")
    limits.add_argument("--max-structured-output-bytes", type=int, default=128 << 10,
                        help="largest output constraint (schema, regex, grammar, choices, "
                             "the tools of tool_choice) as JSON text (default: 128 KiB)")
    limits.add_argument("--max-structured-output-depth", type=int, default=128,
                        help="deepest nesting of a JSON schema, its local $refs followed "
                             "(default: 128, at most 512)")
    limits.add_argument("--structured-output-timeout", type=float, default=10.0,
                        help="seconds a constraint's validation (in a worker process) may "
                             "take (default: 10)")
    limits.add_argument("--structured-output-memory-mib", type=int, default=1024,
                        help="address space of a constraint validation worker in MiB "
                             "(default: 1024)")
    limits.add_argument("--max-stop-strings", type=int, default=64,
                        help="most stop strings per request (default: 64)")
    limits.add_argument("--max-stop-bytes", type=int, default=8192,
                        help="largest total size of a request's stop strings in UTF-8 bytes "
                             "(default: 8192)")
    limits.add_argument("--max-prompt-logprob-entries", type=int, default=2_000_000,
                        help="most prompt logprob entries in a completions response: prompt "
                             "tokens x (logprobs + 1) x n, for echo with logprobs and for "
                             "prompt_logprobs (default: 2,000,000)")
    limits.add_argument("--max-parallel-tool-calls", type=int, default=None,
                        help="most calls in an answer forced by tool_choice 'required' with "
                             "parallel_tool_calls (default: the number of tools)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests bring their own chat template (chat_template, "
                        "chat_template_kwargs.chat_template): it runs the client's code in the "
                        "server, so only for trusted clients (default: refused with a 400)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"))
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=cmd_serve)


def raise_open_file_limit(connections: int, log: logging.Logger) -> None:
    """Lift the soft open-file limit to the hard one (as vLLM does): with a soft limit near
    --limit-concurrency the process runs out of descriptors (and stops accepting for a while)
    before uvicorn answers the connections beyond the limit with 503."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        log.warning("could not raise the open-file limit from %d: %s", soft, e)
        return
    if hard != resource.RLIM_INFINITY and hard < connections + 64:
        log.warning("the open-file limit (%d) is close to --limit-concurrency (%d): "
                    "connections beyond it may fail before they get a 503", hard, connections)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from jaxllm.engine.async_llm import AsyncLLM
    from jaxllm.engine.gc_utils import freeze_gc_heap
    from jaxllm.entrypoints.openai.api_server import (
        build_app,
        header_timeout_protocol,
        make_state,
    )
    from jaxllm.entrypoints.openai.metrics import ServerMetrics
    from jaxllm.entrypoints.openai.serving_engine import ServerLimits, StructuredOutputsConfig
    from jaxllm.model_executor.model_loader.default_model import DEFAULT_MODEL_NAME

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("jaxllm.server")
    if args.model_tag is not None and args.model is not None \
            and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    tag = args.model_tag or args.model
    if args.headless:
        from jaxllm.config import UsageContext
        from jaxllm.engine.headless import run_headless

        engine_args = EngineArgs.from_cli_args(args, model=tag)
        return run_headless(engine_args.create_launch_config(UsageContext.ASYNC_LLM),
                            tag)
    if args.skip_tokenizer_init:
        raise ValueError("the server needs the tokenizer (drop --skip-tokenizer-init)")
    for flag in ("max_request_bytes", "request_body_timeout", "request_header_timeout",
                 "limit_concurrency", "timeout_keep_alive", "h11_max_incomplete_event_size",
                 "max_structured_output_bytes", "max_structured_output_depth",
                 "structured_output_timeout", "structured_output_memory_mib",
                 "max_stop_strings", "max_stop_bytes", "max_prompt_logprob_entries"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got "
                             f"{getattr(args, flag)}")
    if args.max_parallel_tool_calls is not None and args.max_parallel_tool_calls < 1:
        raise ValueError(f"--max-parallel-tool-calls must be positive, got "
                         f"{args.max_parallel_tool_calls}")
    lora_modules = parse_lora_modules(args.lora_modules)
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.enable_lora and not lora_modules:
        # A request names an adapter only through --lora-modules: the slots cost every step.
        log.warning("--enable-lora without --lora-modules: no request can name an adapter, "
                    "and every step still computes the adapter slots")
    if args.max_structured_output_depth > 512:  # counted by recursion in Python
        raise ValueError(f"--max-structured-output-depth must be at most 512, got "
                         f"{args.max_structured_output_depth}")
    raise_open_file_limit(args.limit_concurrency, log)
    so_config = StructuredOutputsConfig() if args.structured_outputs_config is None \
        else StructuredOutputsConfig.from_json(args.structured_outputs_config)
    engine_args = EngineArgs.from_cli_args(args, model=tag)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    name = args.served_model_name or tag or DEFAULT_MODEL_NAME
    metrics = ServerMetrics(name, engine_args.max_loras if engine_args.enable_lora else 0)
    engine = AsyncLLM.from_engine_args(engine_args, stat_loggers=[metrics.record_stats])
    pid = getattr(engine.engine_core, "core_pid", None)
    if pid is not None:
        log.info("engine core process pid %d", pid)
    pids = getattr(engine.engine_core, "core_pids", None)
    if pids is not None:
        log.info("data-parallel engine core process pids %s", pids)
    engine_config = engine.engine_config
    limits = ServerLimits(
        max_structured_output_bytes=args.max_structured_output_bytes,
        max_structured_output_depth=args.max_structured_output_depth,
        structured_output_timeout=args.structured_output_timeout,
        structured_output_memory_mib=args.structured_output_memory_mib,
        max_stop_strings=args.max_stop_strings, max_stop_bytes=args.max_stop_bytes,
        max_prompt_logprob_entries=args.max_prompt_logprob_entries,
        max_parallel_tool_calls=args.max_parallel_tool_calls)
    state = make_state(engine, name,
                       engine_config.model if tag is None else engine_config.model_path,
                       metrics, args.max_request_bytes, so_config,
                       args.trust_request_chat_template, limits,
                       engine_config.reasoning_parser, lora_modules)
    state.body_timeout = args.request_body_timeout
    app = build_app(state, api_key)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=args.graceful_shutdown_timeout,
                            http=header_timeout_protocol(args.request_header_timeout),
                            limit_concurrency=args.limit_concurrency,
                            timeout_keep_alive=args.timeout_keep_alive,
                            h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
                            lifespan="off")
    # uvicorn raises the signal that stopped it again once it has shut down gracefully; with
    # the default handler that would end the process by SIGTERM instead of exit code 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    # Start-up work the first requests would otherwise do on the event loop's time (a worker
    # thread holding the GIL is as bad): the text-length bound reads the whole vocabulary.
    _ = engine.processor.max_prompt_chars
    freeze_gc_heap()  # start-up is done: later collections skip its objects
    try:
        uvicorn.Server(config).run()
    finally:
        state.completion.validator.close()
        engine.shutdown()
    log.info("server stopped")
    return 0


def parse_lora_modules(specs: list[str] | None) -> dict[str, LoRARequest]:
    """`--lora-modules name=path ...` -> name -> LoRARequest, ids 1, 2, ... in order."""
    out: dict[str, LoRARequest] = {}
    for spec in specs or ():
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = LoRARequest(name, len(out) + 1, path)
    return out
