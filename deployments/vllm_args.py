"""`engine_args` as the `vllm serve` command line: every engine and frontend flag vLLM's own
argument parser accepts (tool and reasoning parsers, chat templates, LoRA modules, ...), parsed
and checked by that parser, so a value means on Iris what it means on `vllm serve`.

Config keys are the flags' names with underscores (`tool_call_parser: hermes` is
`--tool-call-parser hermes`); `true`/`false` switch a flag on or off, lists give one value per
item, mappings go as JSON. What Iris owns is refused with where it lives in Iris's config.
"""

from __future__ import annotations

import argparse
import json
from functools import cache
from typing import Any

from pipeline.model import engine_settings

# Flags Iris sets itself: where each lives in Iris's config instead.
OWNED = {
    "model": "the app's `model`",
    "model_tag": "the app's `model`",
    "served_model_name": "the app's `served_model_name`",
    "dtype": "the app's `dtype` (one setting for the encoder and vLLM)",
    "limit_mm_per_prompt": "the app's `max_images_per_prompt` and `max_videos_per_prompt`",
    "ec_transfer_config": "the app's `decoder_features` (Iris's EC connector)",
    "otlp_traces_endpoint": "the app's `tracing.otlp_endpoint`",
    "api_key": "the app's `auth` (checked by the Ingress)",
    "host": "Serve's `http_options` in serve_config.yaml",
    "port": "Serve's `http_options` in serve_config.yaml",
    "uds": "Serve's `http_options` in serve_config.yaml",
    "root_path": "Serve's `route_prefix`",
    "ssl_keyfile": "the proxy in front of Serve",
    "ssl_certfile": "the proxy in front of Serve",
    "ssl_ca_certs": "the proxy in front of Serve",
    "api_server_count": "the Ingress's and LLMDecode's replica counts in serve_config.yaml",
    "headless": "the LLMDecode deployment",
}
PLACEHOLDER = "placeholder-model"  # the model, for checks that load nothing
# vLLM settings Iris relies on; users may not turn them off.
REQUIRED = {"enable_mm_embeds": True, "enable_prefix_caching": True}


class _Refused(ValueError):
    pass


@cache
def _parser() -> argparse.ArgumentParser:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message):  # argparse would print and exit the process
            raise _Refused(message)

    return make_arg_parser(Parser(prog="vllm serve"))


@cache
def _defaults() -> dict[str, Any]:
    """Every flag's name (its argparse dest) and default value."""
    return vars(_parser().parse_args(["--model", PLACEHOLDER]))


def check_engine_args(values: dict[str, Any]) -> None:
    """ValueError naming what `vllm serve` would refuse, or what Iris sets itself."""
    for name in values:
        if name in OWNED:
            raise ValueError(f"engine_args.{name}: set through {OWNED[name]}, not engine_args")
    for name, required in REQUIRED.items():
        if name in values and values[name] != required:
            raise ValueError(
                f"engine_args.{name} must be {required}: Iris feeds features as embeddings and relies on prefix caching"
            )
    unknown = sorted(set(values) - set(_defaults()))
    if unknown:
        raise ValueError(
            f"unknown vLLM flags {unknown} (engine_args takes `vllm serve`'s flags, "
            "with underscores: `vllm serve --help`)"
        )
    args = serve_args(PLACEHOLDER, values)  # vLLM's parser and its own cross-checks
    problems = engine_settings.refusals(args)
    if problems:
        raise ValueError("; ".join(problems))


def model_settings(values: dict[str, Any]) -> dict[str, Any]:
    """The model part of these settings (revision, tokenizer, trust_remote_code, hf_overrides,
    mm_processor_kwargs, ...) as vLLM's EngineArgs fields, where they differ from `vllm serve`'s
    defaults: what every stage loads the checkpoint with (pipeline/model/engine_settings.py)."""
    return engine_settings.model_settings(serve_args(PLACEHOLDER, values), serve_args(PLACEHOLDER, {}))


def adapter_names(values: dict[str, Any]) -> list[str]:
    """The LoRA adapters these settings load at start-up (`lora_modules`), by the names clients send as `model`."""
    return [module.name for module in serve_args(PLACEHOLDER, values).lora_modules or []]


def argv(values: dict[str, Any]) -> list[str]:
    """The command line for these settings (vLLM's flags are their names with dashes)."""
    out: list[str] = []
    defaults = _defaults()
    for name, value in values.items():
        if name not in defaults:
            raise ValueError(f"unknown vLLM flag {name!r}")
        flag = "--" + name.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):  # a switch: --x on; --no-x off, where it is on by default
            if value:
                out.append(flag)
            elif defaults[name] is not False:  # (None: vLLM decides, e.g. prefix caching)
                out.append("--no-" + name.replace("_", "-"))
            continue
        items = value if isinstance(value, list) else [value]
        out.append(flag)
        out.extend(v if isinstance(v, str) else json.dumps(v) for v in items)
    return out


def serve_args(model: str, values: dict[str, Any]) -> argparse.Namespace:
    """vLLM's parsed `vllm serve` arguments for `model` with these settings, checked as `vllm serve`
    checks them before loading anything."""
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    try:
        args = _parser().parse_args(["--model", model, *argv(values)])
        validate_parsed_serve_args(args)
    except (_Refused, TypeError) as err:
        raise ValueError(f"vLLM refuses engine_args: {err}") from None
    return args
