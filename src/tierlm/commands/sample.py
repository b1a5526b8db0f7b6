"""`tierlm sample`: generate from a trained model (a chat model's prompt rendered as a user turn, with the calculator
where its tokenizer has the tool tokens; a base model continues the text; an encoder-decoder reads it)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tierlm.commands.options import COMPILE_HELP, DEVICE_TYPES, Command, positive_int, sampling_filters, temperature
from tierlm.errors import ConfigError, TierlmError


def arguments(sample: argparse.ArgumentParser) -> None:
    sample.add_argument("--checkpoint", required=True, help="a run directory, checkpoint or model folder, or a hub id")
    sample.add_argument("--prompt", required=True, help="the prompt (a user message for chat models)")
    sample.add_argument("--system", default=None, help="a chat model's system message, before the prompt")
    sample.add_argument("--max-new-tokens", type=positive_int, default=64)
    sample.add_argument("--temperature", type=temperature, default=0.0, help="0 is greedy")
    sample.add_argument("--top-k", type=positive_int, default=None)
    sampling_filters(sample)
    sample.add_argument("--seed", type=int, default=0)
    mode = sample.add_mutually_exclusive_group()
    mode.add_argument("--chat", dest="chat", action="store_true", default=None, help="render the prompt as a user turn")
    mode.add_argument("--raw", dest="chat", action="store_false", help="continue the prompt as plain text")
    sample.add_argument("--device-type", default="auto", choices=DEVICE_TYPES)
    sample.add_argument("--compile", action="store_true", help=COMPILE_HELP)


def run(args: argparse.Namespace) -> None:
    import torch

    from tierlm.checkpoint.folders import verified_model_location
    from tierlm.checkpoint.verify import MODEL_META_FILE
    from tierlm.data import load_tokenizer
    from tierlm.models import family_of, load_pretrained_model
    from tierlm.primitives import resolve_device
    from tierlm.rollout.engine import Engine
    from tierlm.rollout.sampling import SamplingParams
    from tierlm.rollout.text import encoder_prompt_tokens, prompt_tokens, readable_text
    from tierlm.rollout.tools import Calculator
    from tierlm.stages import STAGES

    location = verified_model_location(args.checkpoint)
    tokenizer = load_tokenizer(location)
    model = load_pretrained_model(location, device=resolve_device(args.device_type))
    meta_file = Path(location) / MODEL_META_FILE
    try:
        stage = json.loads(meta_file.read_text()).get("stage") if meta_file.is_file() else None
    except (OSError, ValueError, AttributeError) as e:
        raise TierlmError(f"{meta_file} is not readable JSON ({e}); restore it or delete it") from None
    chat = (
        args.chat if args.chat is not None else (stage in STAGES and STAGES[stage].chat and tokenizer.has_chat_template)
    )
    seq2seq = family_of(model).seq2seq  # the prompt goes to the encoder, as text
    chat = chat and not seq2seq
    if args.system is not None and not chat:
        raise ConfigError(
            f"--system is a chat model's system message, and {args.checkpoint} is sampled as plain text: drop "
            "--system (or --raw), or give --chat to render the prompt as a conversation"
        )
    if seq2seq:
        prompt_ids = encoder_prompt_tokens(tokenizer, args.prompt)
    else:
        prompt_ids = prompt_tokens(tokenizer, args.prompt, chat, args.system)
    tools = [Calculator()] if chat and tokenizer.tool_ids() else []
    engine = Engine(model, tokenizer.stop_ids, tokenizer, tools, compile=args.compile)
    generator = torch.Generator(device=engine.device).manual_seed(args.seed)
    params = SamplingParams(
        args.temperature, args.top_k, args.top_p, args.min_p, repetition_penalty=args.repetition_penalty
    )
    completion = engine.generate(prompt_ids, 1, args.max_new_tokens, params, generator)[0]
    print(readable_text(tokenizer, completion.tokens))
    if completion.finished and len(completion.tokens) == 1 and not chat:  # an empty line alone would say nothing
        first = tokenizer.hf.convert_ids_to_tokens(completion.tokens[0])
        print(
            f"tierlm: note: the model ended the text at once (its first token, {first}, ends a document). A prompt "
            "whose last characters training saw only inside a longer token (a colon and the new line after it, say) "
            "often does: end the prompt with the space or new line that follows, or sample with --temperature 1",
            file=sys.stderr,
        )


COMMAND = Command(arguments, run)
